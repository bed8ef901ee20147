"""Lightning Fabric and the Trainer with shardscale's precision plugins, the real package, on 2
gloo ranks, FSDP2 (``ModelParallelStrategy``) and DDP."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.demo_records import parse_records, per_rank
from tests.test_train import ROOT, torchrun

pytestmark = [
    pytest.mark.integration,
    pytest.mark.torchrun,
    pytest.mark.xdist_group("torchrun"),
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs shardscale[lightning]"
    ),
]

DEMOS = ROOT / "launch" / "demos"


def _check_skip_at_step_3(records: list[dict[str, Any]], collectives: list[int]) -> None:
    skipped = per_rank(records, "skipped")
    assert skipped[0] == skipped[1] == [False, False, True, False, False]
    scales = per_rank(records, "scale")
    assert scales[0] == scales[1] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert {r["compute_dtype"] for r in records if "step" in r} == {"torch.float16"}  # on a CPU
    per_step = per_rank(records, "collectives")
    assert per_step[0] == per_step[1] == collectives


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_lightning_fabric_fp16_skips_on_every_rank_and_checkpoints(
    strategy: str, tmp_path: Path
) -> None:
    result = torchrun(
        2,
        "--strategy",
        strategy,
        "--inject-inf-at",
        "3",
        "--checkpoint",
        str(tmp_path / "checkpoint"),
        script=str(DEMOS / "lightning_fabric.py"),
    )
    records = parse_records(result.stdout)
    # the first step after the clip also checks the rest at a collective of its own (the clip
    # could not know the optimizer's parameters); after, the clip's one a step
    _check_skip_at_step_3(records, collectives=[2, 1, 1, 1, 1])
    finite = per_rank(records, "finite_norm")
    assert finite[0] == finite[1] == [True, True, False, True, True]
    assert [r["resumed_equal"] for r in records if "resumed_equal" in r] == [True, True]


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_lightning_trainer_fp16_skips_holds_the_lr_and_resumes(
    strategy: str, tmp_path: Path
) -> None:
    script = str(DEMOS / "lightning_trainer.py")
    checkpoint = str(tmp_path / "checkpoint")
    first = parse_records(
        torchrun(
            2, "--strategy", strategy, "--inject-inf-at", "3", "--save", checkpoint, script=script
        ).stdout
    )
    # The Trainer unscales before its hooks and clips: the first unscale_ agrees at once (2),
    # after which its check rides in the clip's collective (1).
    _check_skip_at_step_3(first, collectives=[2, 1, 1, 1, 1])
    lrs = per_rank(first, "lr")[0]
    assert lrs[2] == lrs[1]  # held on the skipped step
    assert lrs[3] < lrs[2]
    # on_before_optimizer_step saw unscaled gradients (scaled, they would be ~1024x)
    assert max(r["grad_absmax_in_hook"] for r in first if "step" in r) < 1.0
    resumed = parse_records(
        torchrun(
            2, "--strategy", strategy, "--steps", "7", "--resume", checkpoint, script=script
        ).stdout
    )
    assert per_rank(resumed, "step")[0] == [6, 7]
    final = {r["rank"]: r["final"] for r in resumed if "final" in r}
    assert final[0] == final[1]
    assert (final[0]["steps"], final[0]["skipped_steps"], final[0]["last_overflow_step"]) == (
        7,
        1,
        3,
    )
    assert final[0]["scale"] == 512.0


def test_lightning_refuses_fp16_with_model_parallel_without_the_plugin() -> None:
    """What the plugins unlock: Fabric and the Trainer refuse the string precision there."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from lightning.pytorch.strategies import ModelParallelStrategy

    refused = r"does not support `Fabric\(\.\.\., precision='16-mixed'\)`"
    with pytest.raises(ValueError, match=refused):
        L.Fabric(
            accelerator="cpu",
            devices=1,
            strategy=FabricModelParallel(lambda model, mesh: model),
            precision="16-mixed",
        )
    with pytest.raises(ValueError, match=refused):
        L.Trainer(
            accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), precision="16-mixed"
        )


def test_lightning_plugins_are_taken_as_lightnings_precision() -> None:
    """Lightning itself takes them as its precision plugin (not merely: they subclass its base)."""
    import lightning as L

    from shardscale import ShardedGradScaler
    from shardscale.integrations.lightning import FabricPrecision, TrainerPrecision

    trainer_plugin, fabric_plugin = TrainerPrecision("cpu"), FabricPrecision("cpu")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[trainer_plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert trainer.precision_plugin is trainer_plugin
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[fabric_plugin])
    assert fabric.strategy.precision is fabric_plugin
    assert TrainerPrecision("cpu", init_scale=8.0).scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match=r"a scaler or the keyword arguments .* \['init_scale'\]"):
        TrainerPrecision("cpu", scaler=ShardedGradScaler(), init_scale=8.0)
    with pytest.raises(TypeError, match=r"must be a shardscale.ShardedGradScaler, got GradScaler"):
        FabricPrecision("cpu", scaler=__import__("torch").amp.GradScaler("cpu"))
