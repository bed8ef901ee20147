"""End to end: the example job under real torchrun, its checkpoints, and `shardscale inspect`.

Few and small (each torchrun start costs seconds), sharing one set of runs per module.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from shardscale.cli import main as shardscale_cli

# One xdist worker runs the whole module (``--dist loadgroup``): its torchrun jobs share one set
# of runs, built once, and do not compete with each other for the two cores.
pytestmark = [pytest.mark.torchrun, pytest.mark.xdist_group("torchrun")]

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "launch" / "job" / "train.py")
# The same job with the faults these tests inject (an interruption, a killed rank).
WITH_FAULTS = str(ROOT / "tests" / "job_with_faults.py")
# Small and quick; an inf planted in rank 1's shard at steps 3 and 6.
JOB = [
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--growth-interval",
    "2",
    "--inject-inf-every",
    "3",
    "--inject-rank",
    "1",
]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", KINETO_LOG_LEVEL="5")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def torchrun(
    nproc: int,
    *args: str,
    launcher: list[str] | None = None,
    check: bool = True,
    script: str = TRAIN,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (the example job by default) under torchrun on ``nproc`` local ranks,
    with ``env`` added to the environment."""
    launcher = launcher or ["--standalone"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "--nproc-per-node",
        str(nproc),
        script,
        *args,
    ]
    result = subprocess.run(
        command,
        cwd=ROOT,
        env={**_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{command} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def _summary(path: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run, and the same run interrupted after step 4 and resumed."""
    folder = tmp_path_factory.mktemp("train")
    checkpoints = folder / "checkpoints"
    torchrun(2, *JOB, "--summary-json", str(folder / "full.json"))
    first = torchrun(
        2,
        "--exit-after",
        "4",
        *JOB,
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "2",
        "--summary-json",
        str(folder / "first.json"),
        script=WITH_FAULTS,
    )
    resumed = torchrun(
        2,
        *JOB,
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "2",
        "--resume",
        "--summary-json",
        str(folder / "resumed.json"),
    )
    return {
        "folder": folder,
        "checkpoints": checkpoints,
        "full": _summary(folder / "full.json"),
        "first": _summary(folder / "first.json"),
        "resumed": _summary(folder / "resumed.json"),
        "first_output": first.stdout,
        "resumed_output": resumed.stdout,
    }


def test_train_inject_inf_every_rank_skips_and_ranks_agree(runs: dict[str, Any]) -> None:
    full = runs["full"]
    assert (full["steps"], full["skipped_steps"], full["world_size"]) == (6, 2, 2)
    assert full["ranks_agree"] is True
    assert [h["step"] for h in full["history"] if h["skipped"]] == [3, 6]
    # clipped every step: the global norm is finite on taken steps, inf on skipped ones
    norms = [h["grad_norm"] for h in full["history"]]
    assert [math.isfinite(n) for n in norms] == [not h["skipped"] for h in full["history"]]
    # the planted inf, located: rank 1's first local gradient element, named as in the model
    assert (
        "step 3: skipped on all 2 rank(s) (non-finite gradients); scale 131072 -> 65536; "
        "located at rank 1: token_embedding.weight (1 inf, 0 NaN)"
    ) in runs["first_output"]
    assert full["parallel"] == "fsdp2"
    assert full["precision"] == "fp16"


def test_train_interrupted_and_resumed_equals_uninterrupted(runs: dict[str, Any]) -> None:
    full, first, resumed = runs["full"], runs["first"], runs["resumed"]
    assert first["interrupted"] is True
    assert first["steps"] == 4
    assert "resumed from" in runs["resumed_output"]
    for key in ("steps", "skipped_steps", "final_loss", "final_scale", "eval_loss"):
        assert resumed[key] == full[key], key  # bit for bit: same data, same reductions
    assert resumed["history"] == full["history"][4:]
    assert first["history"] == full["history"][:4]


@pytest.mark.parametrize("world_size", [1, 3])
def test_train_resume_at_another_world_size(
    runs: dict[str, Any], tmp_path: Path, world_size: int
) -> None:
    summary_path = tmp_path / "summary.json"
    checkpoints = tmp_path / "checkpoints"  # a copy: this run adds checkpoints of its own
    shutil.copytree(runs["checkpoints"], checkpoints)
    result = torchrun(
        world_size,
        *JOB,
        "--steps",
        "8",
        "--inject-rank",
        "0",
        "--checkpoint-dir",
        str(checkpoints),
        "--resume",
        "--summary-json",
        str(summary_path),
    )
    summary = _summary(summary_path)
    assert (
        f"at step 6 (scale {runs['full']['final_scale']:g}, world size {world_size})"
        in result.stdout
    )
    assert (summary["steps"], summary["world_size"], summary["ranks_agree"]) == (
        8,
        world_size,
        True,
    )
    assert summary["skipped_steps"] == 2  # the counters came along


def test_train_checkpoint_before_any_step_was_taken_resumes(tmp_path: Path) -> None:
    # Every step skipped: the optimizer has no state yet, and the skipped step's gradients are
    # still there when the checkpoint is written.
    checkpoints, summary_path = tmp_path / "checkpoints", tmp_path / "summary.json"
    options = [*JOB, "--checkpoint-dir", str(checkpoints), "--summary-json", str(summary_path)]
    torchrun(2, *options, "--steps", "2", "--inject-inf-every", "1")
    assert _summary(summary_path)["skipped_steps"] == 2
    result = torchrun(2, *options, "--steps", "3", "--inject-inf-every", "0", "--resume")
    assert "resumed from" in result.stdout
    summary = _summary(summary_path)
    assert (summary["steps"], summary["skipped_steps"]) == (3, 2)
    assert math.isfinite(summary["final_loss"])


def test_train_resume_without_checkpoint_fails_naming_the_folder(tmp_path: Path) -> None:
    result = torchrun(2, *JOB, "--checkpoint-dir", str(tmp_path / "none"), "--resume", check=False)
    assert result.returncode != 0
    assert (
        f"the checkpoint directory {tmp_path / 'none'} does not exist"
        in result.stdout + result.stderr
    )


def test_train_resume_from_truncated_shard_fails_naming_the_file(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged" / "step_000002"
    damaged.parent.mkdir()
    shutil.copytree(runs["checkpoints"] / "step_000002", damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    result = torchrun(2, *JOB, "--checkpoint-dir", str(damaged.parent), "--resume", check=False)
    assert result.returncode != 0
    assert f"checkpoint shard {shard} is truncated" in result.stdout + result.stderr


@pytest.mark.parametrize("parallel", ["ddp", "fsdp1"])
def test_train_other_parallelisms_agree(parallel: str, tmp_path: Path) -> None:
    torchrun(2, *JOB, "--parallel", parallel, "--summary-json", str(tmp_path / "s.json"))
    summary = _summary(tmp_path / "s.json")
    assert (summary["skipped_steps"], summary["ranks_agree"]) == (2, True)


def _free_port() -> int:
    """A free port below the kernel's ephemeral range, which no socket opened without a port
    (gloo's, another torchrun's) can take between this check and the agent's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(10_000, max(10_001, low)), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def test_train_two_nodes_on_loopback(tmp_path: Path) -> None:
    """Two torchrun agents, one process each, meet through c10d rendezvous as two nodes."""
    summary_path = tmp_path / "summary.json"
    rdzv = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-id",
        "two-nodes",
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rdzv,
        "--nproc-per-node",
        "1",
        TRAIN,
        *JOB,
        "--summary-json",
        str(summary_path),
    ]
    agents = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    summary = _summary(summary_path)
    assert (summary["world_size"], summary["ranks_agree"], summary["skipped_steps"]) == (2, True, 2)


def test_inspect_good_checkpoint_reports_scaler_and_agreeing_counters(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert shardscale_cli(["inspect", str(runs["checkpoints"])]) == 0
    out = capsys.readouterr().out
    assert "step_000006" in out  # the newest checkpoint of the folder
    assert "skipped_steps        2" in out
    assert "29 step counters, all 4: agree" in out
    assert "6 steps - 2 skipped = 4: consistent" in out


def test_inspect_tampered_checkpoint_fails(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flat = tmp_path / "checkpoint.pt"
    dcp_to_torch_save(runs["checkpoints"] / "step_000006", flat)
    state = torch.load(flat, weights_only=False)
    state["app"]["optim"]["state.head.weight.step"] += 1  # one shard "stepped" alone
    torch.save(state, flat)
    tampered = tmp_path / "tampered"
    torch_save_to_dcp(flat, tampered)
    assert shardscale_cli(["inspect", str(tampered)]) == 1
    err = capsys.readouterr().err
    assert "step counters disagree" in err
    assert "5: head.weight (1)" in err


def test_inspect_not_a_checkpoint_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert shardscale_cli(["inspect", str(tmp_path)]) == 2
    assert ".metadata is missing" in capsys.readouterr().err


def test_train_rank_killed_torchrun_restarts_and_resumes_intact(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """Rank 1 is killed (SIGKILL) at step 5; torchrun restarts the job, which resumes from the
    step-4 checkpoint and ends exactly where the uninterrupted run does."""
    summary_path = tmp_path / "summary.json"
    result = torchrun(
        2,
        "--kill",
        "5:1",
        *JOB,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "2",
        "--summary-json",
        str(summary_path),
        script=WITH_FAULTS,
        launcher=["--standalone", "--max-restarts", "1"],
    )
    output = result.stdout + result.stderr  # torchrun() has checked the exit status
    assert "rank 1: killed at step 5 (--kill)" in output
    assert f"resumed from {tmp_path / 'ckpt' / 'step_000004'} at step 4" in output
    summary, full = _summary(summary_path), runs["full"]
    assert summary["ranks_agree"] is True
    for key in ("steps", "skipped_steps", "final_loss", "final_scale", "eval_loss"):
        assert summary[key] == full[key], key


# ------------------------------------------------------------------ pipeline stages

# The inf lands in stage 0, which computes no loss and never calls scaler.scale().
PIPELINE_JOB = [*JOB[:-1], "0", "--parallel", "pp"]


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 stages on 2 ranks: uninterrupted, and interrupted after step 4 then resumed."""
    folder = tmp_path_factory.mktemp("pipeline")
    checkpoints = folder / "checkpoints"
    full = torchrun(2, *PIPELINE_JOB, "--summary-json", str(folder / "full.json"))
    saving = ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]
    torchrun(
        2,
        "--exit-after",
        "4",
        *PIPELINE_JOB,
        *saving,
        "--summary-json",
        str(folder / "a.json"),
        script=WITH_FAULTS,
    )
    torchrun(2, *PIPELINE_JOB, *saving, "--resume", "--summary-json", str(folder / "b.json"))
    return {
        "full": _summary(folder / "full.json"),
        "first": _summary(folder / "a.json"),
        "resumed": _summary(folder / "b.json"),
        "output": full.stdout,
    }


def test_train_pipeline_first_stage_overflow_skips_every_stage(
    pipeline_runs: dict[str, Any],
) -> None:
    full = pipeline_runs["full"]
    assert (full["steps"], full["skipped_steps"], full["pipeline_stages"]) == (6, 2, 2)
    assert full["ranks_agree"] is True  # each stage's parameters, every rank's steps and scale
    assert [h["step"] for h in full["history"] if h["skipped"]] == [3, 6]
    norms = [h["grad_norm"] for h in full["history"]]
    assert [math.isfinite(n) for n in norms] == [not h["skipped"] for h in full["history"]]
    assert (
        "step 3: skipped on all 2 rank(s) (non-finite gradients); scale 131072 -> 65536; "
        "located at rank 0: token_embedding.weight (1 inf, 0 NaN)"
    ) in pipeline_runs["output"]
    assert "2 (gloo, pp, 2 stages)" in pipeline_runs["output"]


def test_train_pipeline_interrupted_and_resumed_equals_uninterrupted(
    pipeline_runs: dict[str, Any],
) -> None:
    full, first, resumed = (pipeline_runs[k] for k in ("full", "first", "resumed"))
    assert first["history"] + resumed["history"] == full["history"]
    for key in ("skipped_steps", "final_loss", "final_scale", "eval_loss"):
        assert resumed[key] == full[key], key


def test_train_pp_fsdp2_one_shard_overflows_and_resumes_at_another_layout(tmp_path: Path) -> None:
    """2 stages x 2 FSDP2 shards on 4 ranks, an inf in rank 1 (stage 0, second shard) only;
    its checkpoint then loads into 2 plain stages on 2 ranks: the same weights and scaler."""
    checkpoints = tmp_path / "checkpoints"
    torchrun(
        4,
        *JOB[:-1],
        "1",
        "--parallel",
        "pp_fsdp2",
        "--checkpoint-dir",
        str(checkpoints),
        "--summary-json",
        str(tmp_path / "a.json"),
        timeout=420,
    )
    four = _summary(tmp_path / "a.json")
    assert (four["world_size"], four["pipeline_stages"], four["ranks_agree"]) == (4, 2, True)
    assert [h["step"] for h in four["history"] if h["skipped"]] == [3, 6]
    torchrun(
        2,
        *PIPELINE_JOB,
        "--checkpoint-dir",
        str(checkpoints),
        "--resume",
        "--summary-json",
        str(tmp_path / "b.json"),
    )
    two = _summary(tmp_path / "b.json")
    assert two["history"] == []  # resumed at its last step: nothing left to train
    assert (two["final_scale"], two["skipped_steps"]) == (four["final_scale"], 2)
    assert two["eval_loss"] == pytest.approx(four["eval_loss"], rel=1e-6)


# Every 3rd step rank 1's loss is inf (a forward overflow); at step 4 an inf is planted in rank
# 1's gradients in the batch's first run only; the scale starts at 2**18, where this model's fp16
# gradients overflow (2**16 is the highest that holds them).
RETRY_JOB = [
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--eval-batches",
    "0",
    "--growth-interval",
    "2",
    "--init-scale",
    str(2**18),
    "--retry",
    "--inject-forward-overflow-every",
    "3",
    "--inject-inf-every",
    "4",
    "--inject-rank",
    "1",
]


@pytest.mark.parametrize("parallel", ["fsdp2", "pp"])
def test_train_forward_overflows_hold_the_scale_and_retry_drops_no_other_batch(
    parallel: str, tmp_path: Path
) -> None:
    summary_path = tmp_path / "summary.json"
    result = torchrun(2, *RETRY_JOB, "--parallel", parallel, "--summary-json", str(summary_path))
    summary = _summary(summary_path)
    history = summary["history"]
    assert summary["ranks_agree"] is True
    # Only the batches whose loss was inf are dropped: no scale can fix those.
    assert [h["step"] for h in history if h["skipped"]] == [3, 6]
    assert (summary["batches_dropped"], summary["forward_overflows"]) == (2, 2)
    # ... and their steps held the scale (and its growth tracker: no growth at step 4 either)
    assert [h["scale"] for h in history[1:4]] == [2.0**17, 2.0**17, 2.0**16]
    assert history[5]["scale"] == history[4]["scale"]
    # The first batch overflowed at 2**18 and 2**17 and was rerun twice, trained at 2**16; the
    # planted inf of step 4 was gone in the rerun.
    assert [h["retries"] for h in history] == [2, 0, 0, 1, 0, 0]
    assert summary["retries"] == 3
    assert history[0]["scale"] == 2.0**16
    assert "batch rerun 2 time(s) at a lower scale" in result.stdout
    assert (
        "step 3: skipped on all 2 rank(s) (non-finite loss: a forward overflow); "
        "scale 131072 -> 131072; located at rank 1: <loss>"
    ) in result.stdout
    assert "batches dropped      2 (skipped steps; 2 of them forward overflows)" in result.stdout


def test_train_forward_overflow_injection_needs_a_rank_with_a_loss(tmp_path: Path) -> None:
    result = torchrun(
        2,
        "--parallel",
        "pp",
        "--steps",
        "1",
        "--inject-forward-overflow-every",
        "1",
        "--inject-rank",
        "0",
        check=False,
    )
    assert result.returncode != 0
    assert (
        "--inject-forward-overflow-every needs --inject-rank on the last pipeline stage "
        "(ranks [1]: only it has a loss), got 0"
    ) in result.stdout + result.stderr
