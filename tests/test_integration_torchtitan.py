"""torchtitan's own Trainer in fp16 through shardscale.integrations.torchtitan, on 2 CPU ranks.

Real torchrun jobs on gloo train torchtitan 0.3.0's llama3 debug model (short sequences: fp16
matmuls are ~30x slower than fp32 on a CPU). tests/torchtitan_job.py runs the trainers and holds
what torchtitan needs on a CPU with torch 2.13; each job runs several trainers in turn, since
importing torchtitan costs ~15 s per process. Every rank writes a record per step; the tests
read them. Each test runs its own jobs and shares nothing with the others, so tests run once
however xdist spreads them (with pytest 9, `xdist_group` does not group: xdist 3.8 sets
`item._nodeid`, which pytest 9 no longer reads).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.test_train import ROOT, torchrun
from tests.torchtitan_job import make_assets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.torchrun,
    pytest.mark.timeout(620),  # up to two jobs, each bounded at 300 s by torchrun()'s timeout
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None, reason="needs shardscale[torchtitan]"
    ),
]

JOB = str(ROOT / "tests" / "torchtitan_job.py")
# The LR grows at every step of the warmup (a held step shows), the same schedule in every run.
LR = ["--lr_scheduler.warmup_steps", "5", "--lr_scheduler.total_steps", "10"]
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "2"]
TENSOR_PARALLEL = [
    "--parallelism.tensor_parallel_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
]
DDP = [
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
]
FULL_DTENSOR = ["--parallelism.spmd_backend", "full_dtensor"]
SCALER_KEY = "shardscale_scaler"
SKIPPED_GRAD_NORM = -1.0  # shardscale.integrations.torchtitan's (importing it needs torchtitan)

Records = dict[str, dict[int, list[dict[str, Any]]]]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer and a data set: torchtitan's wheel ships neither."""
    folder = tmp_path_factory.mktemp("titan_assets")
    make_assets(str(folder))
    return folder


def _train(
    assets: Path, out: Path, runs: list[dict[str, Any]], *options: str
) -> tuple[Records, str]:
    """Run `runs` in one torchrun job on 2 ranks; their records (by run, rank, in step order)
    and the job's whole output. Rank 0's checks, if asked for, land in out/checks-0.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"SHARDSCALE_TITAN_ASSETS": str(assets), "SHARDSCALE_TITAN_OUT": str(out)}
    result = torchrun(2, "--runs", json.dumps(runs), *options, script=JOB, timeout=300, env=env)
    records: Records = {run["name"]: {0: [], 1: []} for run in runs}
    for rank in (0, 1):
        for record in _lines(out / f"records-{rank}.jsonl"):
            records[record["run"]][rank].append(record)
    return records, result.stdout + result.stderr


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(name: str, folder: Path, steps: int, *flags: str, **options: Any) -> dict[str, Any]:
    """One trainer run of a job (tests/torchtitan_job.py's Run), its outputs in folder/name."""
    flags = ("--training.steps", str(steps), *flags, "--dump_folder", str(folder / name))
    return {"name": name, "flags": list(flags), **options}


def _column(records: list[dict[str, Any]], key: str) -> list[Any]:
    return [record[key] for record in records]


def _agree(by_rank: dict[int, list[dict[str, Any]]], *keys: str) -> list[dict[str, Any]]:
    """Rank 0's records, after checking rank 1 holds the same values of `keys`."""
    for key in keys:
        assert _column(by_rank[0], key) == _column(by_rank[1], key), key
    return by_rank[0]


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * abs(b)


def test_fsdp2_inf_in_one_rank_every_rank_skips_gradients_match_bf16(
    assets: Path, tmp_path: Path
) -> None:
    """FSDP2 x2 through fp16(), torchtitan's default (chunked) loss, an inf in rank 1's gradient
    shard at step 4 of 5, against a bf16 run of the same steps: the skip, the scale, the
    optimizers' counters, the grad norm, the clip, the LR schedule and the metrics."""
    runs = [
        _run("bf16", tmp_path, 4, *LR, precision="bf16"),
        _run("fp16", tmp_path, 5, *LR, inject_at=4, inject_rank=1, check_clip=True),
    ]
    records, output = _train(assets, tmp_path, runs)
    keys = ("skipped", "scale", "scaler_steps", "skipped_steps", "optimizer_steps", "grad_norm")
    fp16, bf16 = _agree(records["fp16"], *keys, "loss", "lr"), records["bf16"][0]
    assert _column(fp16, "skipped") == [False, False, False, True, False]
    assert _column(fp16, "scale") == [65536.0] * 3 + [32768.0] * 2  # halved once
    assert _column(fp16, "skipped_steps") == [0, 0, 0, 1, 1]
    # AdamW's step counters (fused, as torchtitan builds it): the skipped step counted nowhere
    assert _column(fp16, "optimizer_steps") == [[1], [2], [3], [3], [4]]

    # ChunkedLossWrapper ignores grad_output in its backward: scaling its output would leave
    # the gradients S = 65536 times too small. Each of its 8 chunk losses is scaled instead.
    assert _column(fp16, "scale_calls") == [8, 16, 24, 32, 40]
    for ours, reference in zip(fp16[:3], bf16[:3], strict=True):  # same data and weights
        assert _close(ours["grad_norm"], reference["grad_norm"], 0.03)
        assert _close(ours["loss"], reference["loss"], 0.01)

    for rank in (0, 1):  # the clip is torchtitan's own, inside the scaler's one collective
        # (and at the first step the optimizer's own: the clip could not know its parameters)
        assert _column(records["fp16"][rank], "scaler_collectives") == [2, 1, 1, 1, 1]
        for record in records["fp16"][rank]:
            clip = record["clip"]
            if record["skipped"]:  # the scaler's norm is inf; torchtitan logs the stand-in
                assert math.isinf(clip["norm"])
                assert record["grad_norm"] == SKIPPED_GRAD_NORM
            else:
                assert record["grad_norm"] == clip["norm"]  # what torchtitan logged
                assert _close(clip["norm"], clip["titan_norm"], 1e-5)
                assert clip["max_grad_difference"] < 1e-6  # the same clipped gradients

    lr, reference_lr = _column(fp16, "lr"), _column(bf16, "lr")
    assert lr[:3] == reference_lr[:3]
    assert reference_lr[3] > reference_lr[2]  # the warmup goes on at step 4 without skips
    assert lr[3] == lr[2]  # held at the skipped step 4
    assert lr[4] == reference_lr[3]  # and goes on where it stopped

    for rank in (0, 1):
        metrics = _column(records["fp16"][rank], "metrics")
        assert metrics[3] == {
            "shardscale/scale": 32768.0,
            "shardscale/skipped_steps": 1,
            "shardscale/last_step_skipped": 1,
            "shardscale/forward_overflows": 0,
        }
        assert [m["shardscale/last_step_skipped"] for m in metrics] == [0, 0, 0, 1, 0]
    assert "shardscale: step 4 skipped (inf/NaN gradients on some rank), scale 32768" in output
    assert "shardscale: step 5 taken, scale 32768, skipped steps 1, forward overflows 0" in output


def test_finite_step_guard_after_0_3_0_overflow_is_a_skipped_step_not_a_stop(
    assets: Path, tmp_path: Path
) -> None:
    """torchtitan's finite-step guard (PR #4226, after 0.3.0: tests/torchtitan_job.py applies
    its trainer.py hunks to 0.3.0's `train_step`), FSDP2 x2, an inf in rank 1's gradient shard
    at step 2 of 3. The guard passes: the step is skipped on both ranks and training goes on,
    torchtitan logging SKIPPED_GRAD_NORM for it. Handed the scaler's own norm (inf), the same
    guard stops the job there, on both ranks: the test runs the guard's code path."""
    from shardscale.integrations import torchtitan as integration

    assert integration.SKIPPED_GRAD_NORM == SKIPPED_GRAD_NORM
    runs = [
        _run("guarded", tmp_path, 3, *LR, guard=True, inject_at=2, check_clip=True),
        _run("raw_norm", tmp_path, 3, guard=True, raw_norm=True, inject_at=2),
    ]
    records, _ = _train(assets, tmp_path, runs)
    keys = ("skipped", "scale", "grad_norm", "lr", "optimizer_steps", "scaler_collectives")
    guarded = _agree(records["guarded"], *keys)
    assert _column(guarded, "skipped") == [False, True, False]
    assert _column(guarded, "scale") == [65536.0, 32768.0, 32768.0]
    assert _column(guarded, "optimizer_steps") == [[1], [1], [2]]
    assert _column(guarded, "scaler_collectives") == [2, 1, 1]
    norms, lr = _column(guarded, "grad_norm"), _column(guarded, "lr")
    assert norms[1] == SKIPPED_GRAD_NORM
    assert min(norms[0], norms[2]) > 0
    assert math.isinf(guarded[1]["clip"]["norm"])  # the scaler's own, for that step
    assert lr[1] == lr[0] < lr[2]  # held at the skipped step
    for rank in (0, 1):
        first, stopped = records["raw_norm"][rank]
        assert (first["step"], first["skipped"]) == (1, False)
        assert stopped["stopped"] == (
            "Loss or gradient norm is not finite on at least one rank at step 2. Stopping "
            "training before the optimizer update."
        )


def test_checkpoint_holds_the_scaler_resume_continues_it_pre_fp16_checkpoint_loads(
    assets: Path, tmp_path: Path
) -> None:
    """One job saves at step 2 (bf16; fp16 with an inf at step 2, so the saved scale has moved),
    a second job resumes from each."""
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    runs = [
        _run("bf16", saved, 2, *LR, *CHECKPOINTS, precision="bf16"),
        _run("fp16", saved, 4, *LR, *CHECKPOINTS, inject_at=2),
    ]
    records, _ = _train(assets, saved, runs)
    step_2 = Path("checkpoint", "step-2")
    fp16_keys = FileSystemReader(str(saved / "fp16" / step_2)).read_metadata().state_dict_metadata
    scaler_keys = {key for key in fp16_keys if key.startswith(SCALER_KEY + ".")}
    assert {f"{SCALER_KEY}.{k}" for k in ("scale", "steps", "skipped_steps")} <= scaler_keys
    bf16_keys = FileSystemReader(str(saved / "bf16" / step_2)).read_metadata().state_dict_metadata
    assert not any(key.startswith(SCALER_KEY) for key in bf16_keys)

    for run, source in (("resumed", "fp16"), ("from_bf16", "bf16")):
        shutil.copytree(saved / source / step_2, resumed / run / step_2)
    runs = [
        _run("resumed", resumed, 4, *LR, *CHECKPOINTS),
        _run("from_bf16", resumed, 3, *LR, *CHECKPOINTS),
    ]
    again, output = _train(assets, resumed, runs)

    uninterrupted = _agree(records["fp16"], "scale", "skipped")[2:]
    after = _agree(again["resumed"], "scale", "loss")
    assert [record["step"] for record in after] == [3, 4]
    for key in ("scale", "skipped", "scaler_steps", "skipped_steps", "lr", "optimizer_steps"):
        assert _column(after, key) == _column(uninterrupted, key), key
    assert _column(after, "scale") == [32768.0, 32768.0]  # the scale saved after the skip
    assert _column(after, "skipped_steps") == [1, 1]
    # Numerics agree to rounding, not bit for bit: CPU kernels in another process may sum in
    # another order (their vector paths follow memory alignment).
    for ours, reference in zip(after, uninterrupted, strict=True):
        assert _close(ours["loss"], reference["loss"], 1e-4)
        assert _close(ours["grad_norm"], reference["grad_norm"], 1e-4)

    (step,) = _agree(again["from_bf16"], "scale", "scaler_steps", "loss")
    assert (step["step"], step["scale"], step["scaler_steps"], step["skipped"]) == (
        3,
        65536.0,
        1,
        False,
    )
    assert step["optimizer_steps"] == [3]  # the bf16 run's optimizer state came along
    assert "holds no shardscale_scaler (saved before fp16?): the loss scaler starts fresh" in (
        output
    )


def test_plain_loss_and_gradient_accumulation_scaled_grad_norm_matches_bf16(
    assets: Path, tmp_path: Path
) -> None:
    """The plain cross-entropy loss (torchtitan's llama3_debugmodel_ce_loss), and the chunked
    loss over 2 micro-batches a step; rank 0 checks fp16()'s refusals first."""
    accumulate = ["--training.global_batch_size", "4"]  # 1 per rank, 2 ranks, 2 micro-batches
    runs = [
        _run("bf16_ce", tmp_path, 2, precision="bf16", config="llama3_cpu_ce"),
        _run("fp16_ce", tmp_path, 2, config="llama3_cpu_ce"),
        _run("bf16_accumulated", tmp_path, 2, *accumulate, precision="bf16"),
        _run("fp16_accumulated", tmp_path, 2, *accumulate),
    ]
    records, _ = _train(assets, tmp_path, runs, "--checks")
    plain = _agree(records["fp16_ce"], "grad_norm", "scale_calls")
    assert _column(plain, "scale_calls") == [1, 2]  # one loss per micro-batch, scaled once
    for ours, reference in zip(plain, records["bf16_ce"][0], strict=True):
        assert _close(ours["grad_norm"], reference["grad_norm"], 0.03)

    accumulated = _agree(records["fp16_accumulated"], "grad_norm", "scaler_steps", "scale_calls")
    assert _column(accumulated, "scale_calls") == [16, 32]  # 2 micro-batches x 8 chunks a step
    assert _column(accumulated, "scaler_steps") == [1, 2]  # one update a step
    assert _column(accumulated, "scale") == [65536.0, 65536.0]
    for ours, reference in zip(accumulated, records["bf16_accumulated"][0], strict=True):
        assert _close(ours["grad_norm"], reference["grad_norm"], 0.03)

    checks = {check["case"]: check for check in _lines(tmp_path / "checks-0.jsonl")}
    expected = {
        "older_torch": ("RuntimeError", "set_timeout after the first step, which torch 2."),
        "own_loss": ("ValueError", "OwnLoss.Config. A loss that runs backward inside its call"),
        "chunked_own_loss": ("ValueError", "got the loss ChunkedLossWrapper.Config(_config_"),
        "bf16_parameters": ("ValueError", "training.dtype must be 'float32', got 'bfloat16'"),
        "twice": ("ValueError", "fp16() was applied to it"),
        "process_group": ("ValueError", "the trainer sets the scaler's process_group itself"),
        "growth_factor": ("ValueError", "growth_factor"),
        "unknown_option": ("TypeError", "growth"),
        "not_a_config": ("TypeError", "got TrainingConfig"),
        "without_clip": ("RuntimeError", "torchtitan 0.3.0 has no torchtitan.distributed.utils"),
    }
    for case, (error, message) in expected.items():
        assert checks[case]["error"] == error, checks[case]
        assert message in checks[case]["message"], checks[case]
    converted = checks["converted"]
    assert converted["original"] == ["bfloat16", "Config"]  # the config given is unchanged
    assert (converted["param_dtype"], converted["reduce_dtype"]) == ("float16", "float32")
    assert (converted["loss"], converted["chunk_loss"]) == (
        "ChunkedLossWrapper.Config",
        "_ScaledLoss.Config",
    )
    assert converted["options"] == {"init_scale": 1024.0, "growth_interval": 3}
    assert converted["trainer"] == "FP16Trainer.Config"


def test_tensor_parallel_ddp_and_full_dtensor_skip_together_clip_as_torchtitan(
    assets: Path, tmp_path: Path
) -> None:
    """TP x2 (gloo runs it), DDP x2 (torchtitan's replicate: every parameter on both ranks) and
    FSDP2 x2 on torchtitan's full-DTensor backend, each with an inf in rank 1's gradients at
    step 2. Under DDP the inf is in one replica only: torchtitan alone would step both, and
    rank 1's weights would turn NaN while rank 0's stay finite."""
    runs = [
        _run("tp", tmp_path, 3, *TENSOR_PARALLEL, inject_at=2, check_clip=True),
        _run("ddp", tmp_path, 3, *DDP, inject_at=2, check_clip=True),
        _run("full_dtensor", tmp_path, 3, *FULL_DTENSOR, inject_at=2, check_clip=True),
    ]
    records, _ = _train(assets, tmp_path, runs)
    for name in ("tp", "ddp", "full_dtensor"):
        run = _agree(records[name], "skipped", "scale", "grad_norm", "optimizer_steps")
        assert _column(run, "skipped") == [False, True, False], name
        assert _column(run, "scale") == [65536.0, 32768.0, 32768.0], name
        assert _column(run, "optimizer_steps") == [[1], [1], [2]], name
        for rank in (0, 1):
            collectives = _column(records[name][rank], "scaler_collectives")
            assert collectives == [2] + [1] * (len(collectives) - 1), name
            for record in records[name][rank]:
                if not record["skipped"]:  # replicas counted once, shards summed
                    assert _close(record["clip"]["norm"], record["clip"]["titan_norm"], 1e-5)
                    assert record["clip"]["max_grad_difference"] < 1e-6, name
    # torchtitan's own clip saw the inf on rank 1 only: its norms disagree across the ranks
    assert math.isfinite(records["ddp"][0][1]["clip"]["titan_norm"])
    assert math.isinf(records["ddp"][1][1]["clip"]["titan_norm"])


def test_pipeline_parallel_through_the_module_entry_inf_in_stage_0_every_rank_skips(
    assets: Path, tmp_path: Path
) -> None:
    """`python -m shardscale.integrations.torchtitan`'s main() with torchtitan's own flags;
    PP x2: the scale enters through the loss the schedule runs on the last stage (rank 1), rank 0
    never calls scale(), and an inf in stage 0 makes both ranks skip."""
    pipeline = [
        "--training.local_batch_size",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]
    run = _run("pp", tmp_path, 3, *pipeline, inject_at=2, inject_rank=0, check_clip=True)
    records, output = _train(assets, tmp_path, [run], "--cli")
    pp = _agree(records["pp"], "skipped", "scale", "scaler_steps", "grad_norm")
    assert _column(pp, "skipped") == [False, True, False]
    assert _column(pp, "scale") == [65536.0, 32768.0, 32768.0]
    assert _column(records["pp"][0], "scale_calls") == [0, 0, 0]  # stage 0 computes no loss
    assert all(r["scale_calls"] > 0 for r in records["pp"][1])
    for rank in (0, 1):
        # each stage's optimizer's first step after the clip agrees at a collective of its own
        # (the clip could not know its parameters); then the clip's one
        assert _column(records["pp"][rank], "scaler_collectives") == [2, 1, 1]
        for record in records["pp"][rank]:
            if not record["skipped"]:  # stages summed, as torchtitan's clip with its pp_mesh
                assert _close(record["clip"]["norm"], record["clip"]["titan_norm"], 1e-5)
    assert "in fp16 with shardscale" in output


def test_fp16_loss_within_one_percent_of_fp32_over_20_steps(assets: Path, tmp_path: Path) -> None:
    short = ["--training.seq_len", "8"]  # one token per chunk of the chunked loss
    runs = [
        _run("fp32", tmp_path, 20, *short, precision="fp32"),
        _run("fp16", tmp_path, 20, *short),
    ]
    records, _ = _train(assets, tmp_path, runs)
    fp16 = _agree(records["fp16"], "loss", "skipped")
    fp32 = records["fp32"][0]
    assert len(fp16) == len(fp32) == 20
    assert not any(_column(fp16, "skipped"))
    for ours, reference in zip(fp16, fp32, strict=True):
        assert _close(ours["loss"], reference["loss"], 0.01), (ours["step"], ours["loss"])
    assert fp16[-1]["loss"] < fp16[0]["loss"] - 0.5  # it trained
