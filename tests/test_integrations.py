"""Lightning Fabric and accelerate, the real packages, on 2 gloo ranks under torchrun."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.test_train import ROOT, torchrun

pytestmark = [pytest.mark.torchrun, pytest.mark.xdist_group("torchrun")]


def _run_example(script: str, *args: str) -> list[dict[str, Any]]:
    """Run ``launch/<script>`` on 2 ranks; return the JSON records its ranks printed."""
    result = torchrun(2, *args, script=str(ROOT / "launch" / script))
    # two ranks print at once: their lines may interleave, so take every flat JSON object
    return [json.loads(match) for match in re.findall(r"\{[^{}]*\}", result.stdout)]


def _by_rank(records: list[dict[str, Any]], key: str) -> dict[int, list[Any]]:
    rows: dict[int, list[Any]] = {0: [], 1: []}
    for record in sorted((r for r in records if "step" in r), key=lambda r: r["step"]):
        rows[record["rank"]].append(record[key])
    return rows


def test_fabric_fsdp2_fp16_with_our_scaler_skips_on_every_rank() -> None:
    pytest.importorskip("lightning")
    records = _run_example("fabric_fsdp2.py", "--steps", "5", "--inject-inf-at", "3")
    skipped = _by_rank(records, "skipped")
    assert skipped[0] == skipped[1] == [False, False, True, False, False]
    scales = _by_rank(records, "scale")
    assert scales[0] == scales[1] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    finite = _by_rank(records, "finite_norm")
    assert finite[0] == finite[1] == [True, True, False, True, True]


def test_fabric_refuses_fp16_fsdp2_without_a_plugin() -> None:
    """What the plugin unlocks: the string precision is refused for ModelParallelStrategy."""
    lightning = pytest.importorskip("lightning")
    from lightning.fabric.strategies import ModelParallelStrategy

    with pytest.raises(
        ValueError, match=r"does not support `Fabric\(\.\.\., precision='16-mixed'\)`"
    ):
        lightning.Fabric(
            accelerator="cpu",
            devices=1,
            strategy=ModelParallelStrategy(lambda model, mesh: model),
            precision="16-mixed",
        )


def test_accelerate_uses_our_scaler_and_resumes_it(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    records = _run_example("accelerate_ddp.py", "--steps", "5", "--state-dir", str(tmp_path))
    skipped = _by_rank(records, "skipped")
    assert skipped[0] == skipped[1] == [False, False, True, False, False]
    scales = _by_rank(records, "scale")
    assert scales[0] == scales[1] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert [r["resumed_equal"] for r in records if "resumed_equal" in r] == [True, True]


def test_accelerate_fsdp2_resume_hooks_exist_on_our_scaler() -> None:
    """accelerate's FSDP2 load_state calls torch-private names; ours answer them."""
    from shardscale import ShardedGradScaler

    scaler = ShardedGradScaler()
    scaler.load_state_dict(ShardedGradScaler(init_scale=512.0).state_dict())
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler._scale is not None
    assert scaler._scale.item() == 512.0
