"""A job killed at any instant and restarted ends where the uninterrupted one ends, bit for bit
(issue 69; docs/reliability.md).

The example job (``launch/job/train.py``: FSDP2 on 2 gloo ranks, CPU autocast fp16, AdamW,
clipping in the scaler's one collective, data fixed by step, a DCP checkpoint every 2 steps)
starts at a scale its fp16 gradients overflow (2**18): steps 1 and 2 are skipped by real
overflows, so the checkpoint of step 2 is one taken while every step so far was skipped. One
rank is SIGKILLed (``tests/job_with_faults.py``) inside a step (its forward, its backward, the
scaler's all-reduce, between ``step`` and ``update``) or inside a save (as its shard file is
written, at the metadata commit); ``torchrun --max-restarts 1`` restarts the job, which resumes
from the last complete checkpoint. Its final checkpoint (model, optimizer, scaler, RNG) must be
the uninterrupted run's, bit for bit.

Each case is one torchrun job with one restart (two starts of torch on each rank: most of its
few seconds).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.test_train import WITH_FAULTS, torchrun

pytestmark = [pytest.mark.torchrun, pytest.mark.xdist_group("torchrun")]

JOB = [
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--growth-interval",
    "2",
    "--init-scale",
    str(2.0**18),
    "--checkpoint-every",
    "2",
]
# torchrun notices a dead worker within this many seconds (its default: 0.1 in torch 2.13)
RESTART = ["--standalone", "--max-restarts", "1", "--monitor-interval", "0.1"]


def _run(folder: Path, corpus: Path, *faults: str) -> dict[str, Any]:
    """The job (with `faults`) into `folder`: its output, summary and final checkpoint.
    `corpus`: where the job's corpus is kept between its starts (`tests/job_with_faults.py`)."""
    result = torchrun(
        2,
        *faults,
        *JOB,
        "--checkpoint-dir",
        str(folder / "ckpt"),
        "--summary-json",
        str(folder / "summary.json"),
        script=WITH_FAULTS,
        launcher=RESTART,
        env={"SHARDSCALE_TEST_CORPUS": str(corpus)},
    )
    final = folder / "final.pt"
    dcp_to_torch_save(folder / "ckpt" / "step_000006", final)
    return {
        "output": result.stdout + result.stderr,
        "summary": json.loads((folder / "summary.json").read_text()),
        "final": torch.load(final, weights_only=False),
    }


def _bits(value: Any) -> Any:
    """`value` with every tensor as (dtype, shape, its bytes): equal only if bit for bit."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
        return (str(value.dtype), tuple(value.shape), bytes(raw.tolist()))
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bits(v) for v in value]
    return value


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus") / "corpus.pt"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, Any]:
    run = _run(tmp_path_factory.mktemp("uninterrupted"), corpus)
    assert run["summary"]["skipped_steps"] == 2  # steps 1 and 2: real fp16 overflows
    assert run["summary"]["ranks_agree"] is True
    return run


@pytest.mark.parametrize(
    ("kill", "resumed_at"),
    [
        ("5:0:forward", 4),
        ("5:1:backward", 4),
        ("3:1:allreduce", 2),  # resumed from the checkpoint taken while every step was skipped
        ("5:0:update", 4),
        ("4:1:shard", 2),
        ("4:0:commit", 2),
    ],
)
def test_faults_killed_and_restarted_ends_bit_for_bit_where_uninterrupted_does(
    uninterrupted: dict[str, Any], corpus: Path, tmp_path: Path, kill: str, resumed_at: int
) -> None:
    run = _run(tmp_path, corpus, "--kill", kill)
    _, rank, point = kill.split(":")
    output = run["output"]
    assert f"rank {rank}: killed " in output, output
    assert f", {point} (--kill)" in output, output
    checkpoint = tmp_path / "ckpt" / f"step_{resumed_at:06d}"
    assert f"resumed from {checkpoint} at step {resumed_at}" in output, output
    summary, full = run["summary"], uninterrupted["summary"]
    assert summary["ranks_agree"] is True
    for key in ("steps", "skipped_steps", "final_loss", "final_scale", "eval_loss"):
        assert summary[key] == full[key], key
    final, expected = _bits(run["final"]), _bits(uninterrupted["final"])
    assert final.keys() == expected.keys()
    for key in expected:
        assert final[key] == expected[key], f"the final checkpoint's {key} differs"
