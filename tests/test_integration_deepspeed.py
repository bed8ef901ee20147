"""DeepSpeed's own engine on its torch-autocast fp16 path with shardscale, 2 gloo ranks."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import cpp_extension

from tests.harness import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (shardscale[deepspeed])")

# The timeout covers a first run's one-off build of DeepSpeed's CPU op (below) besides the ranks.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

_ENV = {"DS_ACCELERATOR": "cpu"}

_BUILD_SHM_OP = """
from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)
"""
_BUILD_TIMEOUT_S = 800


def _remove_stale_build_locks() -> None:
    """Remove a build lock older than a build is ever let run: a killed build left it.

    torch's extension build holds ``<extensions root>/<python>_<device>/<name>/lock`` while it
    compiles and waits, without end, for any such lock it finds; a process killed mid-build
    (a rank timed out, a job stopped) leaves its lock for every later build on that machine.
    """
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    for lock in root.glob("*/deepspeed_shm_comm/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
            if age <= _BUILD_TIMEOUT_S:
                continue  # a build under way: torch's build waits for it
            lock.unlink()
        except FileNotFoundError:  # released, or removed by the other worker
            continue
        warnings.warn(f"removed {lock}: {age:.0f} s old, left by a killed build", stacklevel=1)


@pytest.fixture(scope="module", autouse=True)
def deepspeed_cpu_op_built() -> None:
    """Build DeepSpeed's shared-memory collective once, before any rank runs.

    With ``DS_ACCELERATOR=cpu``, every process that makes DeepSpeed's process group loads
    ``deepspeed_shm_comm``, compiling it (C++, ninja) into torch's extension cache the first time:
    ~65 s on 2 idle cores, several minutes beside other tests. Inside the ranks that build ate
    their 240 s on a fresh machine, and a rank killed mid-build leaves torch's build lock behind,
    on which every later process waits. Built here, in a process of its own that is never killed,
    the ranks only load it; a build that fails or never ends is reported as such.
    """
    _remove_stale_build_locks()
    try:
        built = subprocess.run(
            [sys.executable, "-c", _BUILD_SHM_OP],
            env={**os.environ, **_ENV},
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"DeepSpeed's CPU op deepspeed_shm_comm did not build within {_BUILD_TIMEOUT_S} s "
            "(torch's extension cache: TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)"
        )
    if built.returncode != 0:
        pytest.fail(
            "DeepSpeed's CPU op deepspeed_shm_comm did not build (it needs a C++ compiler and "
            f"ninja):\n{built.stderr[-3000:]}"
        )


def _engine(
    stage: int, clip: float, two_groups: bool, norm: bool = True, **scaler_kwargs: Any
) -> tuple[Any, ...]:
    import deepspeed

    from shardscale.integrations.deepspeed import use_shardscale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    groups: Any = model.parameters()
    if two_groups:
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **({} if norm else {"compute_grad_norm": False})},
        "gradient_clipping": clip,
        "torch_autocast": {"enabled": True, "dtype": "torch.float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    return engine, use_shardscale(engine, **scaler_kwargs), reference


def _batch(rank: int, step: int, size: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return size * torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)


def _true_norm(reference: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The data-parallel mean gradient's norm, in fp32 without a scale."""
    reference.zero_grad()
    nn.functional.mse_loss(reference(x), y).backward()
    grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    dist.all_reduce(grads)
    return float((grads / dist.get_world_size()).norm())


def _params(engine: Any) -> list[float]:
    import deepspeed

    values = []
    for param in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            values.extend(param.detach().flatten().tolist())
    return values


def _train(engine: Any, scaler: Any, rank: int, steps: int, plant: int | None, size: float) -> Any:
    rows = []
    for step in range(steps):
        x, y = _batch(rank, step, size)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if step == plant and rank == 0:  # an inf in rank 0's partition only
            grads = [g for g in engine.optimizer.averaged_gradients[0] if g is not None]
            grads[0].view(-1)[0] = float("inf")
        engine.step()
        norm = engine.get_global_grad_norm()  # a tensor or None: sent back as a float
        rows.append(
            {
                "applied": engine.was_step_applied(),
                "skipped_steps": engine.skipped_steps,
                "scale": scaler.get_scale(),
                "lr": engine.get_lr()[0],
                "norm": None if norm is None else float(norm),
            }
        )
    return rows


def _rank_cases(rank: int, world_size: int, stage: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # planted inf, two parameter groups, clipping at 1.0
    engine, scaler, reference = _engine(stage, 1.0, True, init_scale=2.0**16)
    x, y = _batch(rank, 0)
    out["true_norm"] = _true_norm(reference, x, y)
    out["planted"] = _train(engine, scaler, rank, 4, plant=1, size=1.0)
    out["planted_params"] = _params(engine)
    out["stats"] = [scaler.stats.steps, scaler.stats.skipped_steps]
    engine.save_checkpoint(folder, tag="t")
    saved_scale = scaler.get_scale()
    # a real fp16 overflow: inputs whose scaled gradients leave fp16's range
    engine2, scaler2, _ = _engine(stage, 0.0, False, init_scale=2.0**24)
    out["real"] = _train(engine2, scaler2, rank, 16, plant=None, size=30.0)
    out["real_params"] = _params(engine2)
    # resume: the scale comes back from DeepSpeed's checkpoint
    engine3, scaler3, _ = _engine(stage, 1.0, True, init_scale=4.0)
    engine3.load_checkpoint(folder, tag="t")
    out["resumed"] = [saved_scale, scaler3.get_scale()]
    out["resumed_params"] = _params(engine3) == out["planted_params"]
    if stage < 3:  # DeepSpeed's own all-reduced norm off: the agreement is shardscale's alone
        engine4, scaler4, _ = _engine(stage, 0.0, True, norm=False, init_scale=2.0**16)
        out["no_norm"] = _train(engine4, scaler4, rank, 3, plant=1, size=1.0)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_stage_agrees_skips_backs_off_clips_and_resumes(
    stage: int, tmp_path: Path
) -> None:
    ranks = run_ranks(_rank_cases, 2, stage, str(tmp_path), timeout_s=240, env=_ENV)
    first, second = ranks
    for key in ("planted", "planted_params", "real", "real_params", "stats", "resumed"):
        assert first[key] == second[key], key
    planted = first["planted"]
    assert [row["applied"] for row in planted] == [True, False, True, True]
    assert [row["skipped_steps"] for row in planted] == [0, 1, 1, 1]
    assert [row["scale"] for row in planted] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
    lrs = [row["lr"] for row in planted]
    assert lrs[1] == lrs[0]  # the skipped step held the schedule
    assert lrs[2] < lrs[1]
    # the norm DeepSpeed reports is the true one, not the scaled one
    assert planted[0]["norm"] == pytest.approx(first["true_norm"], rel=1e-2)
    assert first["stats"] == [4, 1]
    real = first["real"]
    skipped = [not row["applied"] for row in real]
    # it backs off until the step fits, then steps
    assert skipped[0], [row["scale"] for row in real]
    assert not skipped[-1], [row["scale"] for row in real]
    assert real[-1]["scale"] < 2.0**24
    assert first["resumed"] == [2.0**15, 2.0**15]
    assert first["resumed_params"]
    if stage < 3:
        assert first["no_norm"] == second["no_norm"]
        no_norm = first["no_norm"]
        assert [row["applied"] for row in no_norm] == [True, False, True]
        assert [row["scale"] for row in no_norm] == [2.0**16, 2.0**15, 2.0**15]


def test_deepspeed_refuses_an_engine_off_the_torch_autocast_path() -> None:
    run_ranks(_rank_refused, 2, timeout_s=120, env=_ENV)


def _rank_refused(rank: int, world_size: int) -> None:
    import deepspeed

    from shardscale.integrations.deepspeed import use_shardscale

    model = nn.Linear(4, 4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    with pytest.raises(ValueError, match="torch-autocast fp16 path"):
        use_shardscale(engine)
