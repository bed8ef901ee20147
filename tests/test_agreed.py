"""Agreed by construction, on 2 gloo ranks: what one rank loaded, lists or counts for itself
never shapes a collective, and where the ranks' calls or states really differ every rank raises
the same error, at the same collective, without TORCH_DISTRIBUTED_DEBUG.

The ballot has one shape for the scaler's life and carries an identity (the call, its place in
the iteration, the state's origin, the settings that decide when the scaler communicates):
without DETAIL a collective of another shape would abort gloo (SIGABRT) on one rank.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler, ShardScaleMismatchError, ShardScaleWarning
from shardscale._report import Alarm, StepReporter
from shardscale._state import COUNTERS, Count
from shardscale.testing import cuda_path
from tests.harness import run_ranks

OFF = {"TORCH_DISTRIBUTED_DEBUG": "OFF"}
ERRORS = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text()
_QUOTED = "ShardScaleMismatchError: the 2 ranks met"


def _model() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _iteration(
    scaler: ShardedGradScaler, model: nn.Module, optimizer: Any, clip: bool = False
) -> None:
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).pow(2).mean()).backward()
    if clip:
        scaler.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def _raised(run: Any) -> dict[str, Any]:
    try:
        run()
    except ShardScaleMismatchError as error:
        return {"raised": str(error)}
    return {"raised": None}


# ---------------------------------------------------------------- calls that differ


def _rank_clip_on_one_rank(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Rank 0 clips at the second step, rank 1 does not: rank 0's clip meets rank 1's step."""
    scaler, (model, optimizer) = ShardedGradScaler(sync_timeout=20.0), _model()
    calls: list[str] = []

    def steps() -> None:
        for step in (1, 2):
            calls.append(f"step {step}")
            _iteration(scaler, model, optimizer, clip=rank == 0 and step == 2)

    if path == "cuda":
        with cuda_path():
            result = _raised(steps)
    else:
        result = _raised(steps)
    return {**result, "calls": calls, "scale": scaler.get_scale()}


@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_ranks_whose_calls_differ_raise_the_same_error_at_the_same_collective(path: str) -> None:
    rank0, rank1 = run_ranks(_rank_clip_on_one_rank, 2, path, env=OFF)
    assert rank0["raised"] is not None
    assert rank0["raised"] == rank1["raised"]  # the same words on every rank
    assert rank0["calls"] == rank1["calls"] == ["step 1", "step 2"]
    assert "rank 0: clip_grad_norm_()" in rank0["raised"]
    assert "rank 1: step()" in rank0["raised"]
    assert rank0["scale"] == rank1["scale"]  # nothing of that step was applied
    # docs/errors.md quotes this very case
    quote = next(q for q in re.findall(r"`([^`]+)`", ERRORS) if q.startswith(_QUOTED))
    said, position = f"ShardScaleMismatchError: {rank0['raised']}", 0
    for piece in (p.strip() for p in quote.split("...")):
        position = said.index(piece, position) + len(piece)


def _rank_settings_differ(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks built with different settings of when the scaler communicates: locate_overflow
    on rank 0 alone would gather on overflow steps where rank 1 does not."""
    scaler = ShardedGradScaler(locate_overflow=rank == 0, sync_timeout=20.0)
    model, optimizer = _model()
    return _raised(lambda: _iteration(scaler, model, optimizer))


def test_ranks_built_with_different_settings_raise_at_the_first_collective() -> None:
    rank0, rank1 = run_ranks(_rank_settings_differ, 2, env=OFF)
    assert rank0 == rank1
    assert "different calls or different scaler states" in rank0["raised"]


# ---------------------------------------------------------------- loads that differ


def _rank_load(rank: int, world_size: int, load: list[str], path: str) -> dict[str, Any]:
    """Three iterations; before the third, each rank loads what `load[rank]` says: nothing, its
    current state, or a stale one (after the first iteration)."""
    scaler, (model, optimizer) = ShardedGradScaler(sync_timeout=20.0), _model()
    saved = []
    context = cuda_path() if path == "cuda" else warnings.catch_warnings()

    def steps() -> None:
        with context:
            for step in (1, 2, 3):
                if step == 3 and load[rank] != "none":
                    scaler.load_state_dict(saved[-1] if load[rank] == "current" else saved[0])
                _iteration(scaler, model, optimizer)
                saved.append(scaler.state_dict())

    result = _raised(steps)
    return {**result, "steps": scaler.stats.steps, "weight": model.weight.tolist()}


@pytest.mark.parametrize("path", ["cpu", "cuda"])
@pytest.mark.parametrize("load", [["stale", "none"], ["stale", "current"], ["none", "stale"]])
def test_a_rank_that_loaded_another_state_is_named_on_every_rank(
    load: list[str], path: str
) -> None:
    rank0, rank1 = run_ranks(_rank_load, 2, load, path, env=OFF)
    assert rank0["raised"] is not None
    assert rank0["raised"] == rank1["raised"]
    stale = load.index("stale")
    assert (
        f"rank {stale}: step() (collective 1 of step 2" in rank0["raised"]
    )  # its step, rolled back
    assert "loaded by load_state_dict() (scale 65536, 1 steps)" in rank0["raised"]
    assert rank0["weight"] == rank1["weight"]  # the third step applied nowhere


@pytest.mark.parametrize("load", [["current", "none"], ["current", "current"], ["stale", "stale"]])
def test_loads_that_leave_the_ranks_alike_go_on(load: list[str]) -> None:
    rank0, rank1 = run_ranks(_rank_load, 2, load, "cpu", env=OFF)
    assert rank0 == rank1
    assert rank0["raised"] is None


# ---------------------------------------------------------------- a listener's failure


def _rank_hook_fails_as_error(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0's stats hook raises at step 2, with warnings as errors: its update() raises once
    the iteration is closed, and it goes on, stepping with rank 1."""
    scaler, (model, optimizer) = ShardedGradScaler(sync_timeout=20.0), _model()
    if rank == 0:

        def hook(stats: Any) -> None:
            if stats.steps == 2:
                raise ConnectionError("the metrics backend is unreachable")

        scaler.register_stats_hook(hook)
    raised = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardScaleWarning)
        for _ in range(4):
            try:
                _iteration(scaler, model, optimizer)
            except ShardScaleWarning as warning:
                raised.append(str(warning)[:22])
    return {"raised": raised, "steps": scaler.stats.steps, "weight": model.weight.tolist()}


def test_a_listeners_failure_as_an_error_lets_every_rank_go_on() -> None:
    rank0, rank1 = run_ranks(_rank_hook_fails_as_error, 2, env=OFF)
    assert rank0["raised"] == ["step 2: the stats hook"]
    assert rank1["raised"] == []
    assert rank0["steps"] == rank1["steps"] == 4
    assert rank0["weight"] == rank1["weight"]


# ---------------------------------------------------------------- a load leaves nothing behind


def test_load_leaves_nothing_of_the_run_before() -> None:
    """The meter's reading, the last step's skip, the last overflow: a load starts afresh."""
    scaler = ShardedGradScaler(underflow_every=1, locate_overflow=True)
    model, optimizer = _model()
    fresh = scaler.state_dict()
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    model.weight.grad[0, 0] = math.inf  # type: ignore[index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler.step(optimizer)
        scaler.update()
    assert scaler.last_step_skipped
    assert scaler.last_overflow
    assert scaler.stats.underflow_step == 1
    scaler.load_state_dict(fresh)
    assert scaler.last_step_skipped is None
    assert scaler.last_overflow is None
    stats = scaler.stats
    assert (stats.steps, stats.underflow, stats.underflow_step) == (0, None, None)


# ---------------------------------------------------------------- the accelerator's late read


def test_a_mismatch_counted_on_the_device_is_the_alarms_error() -> None:
    """On an accelerator the identity is not read at the collective: a mismatch is counted on
    the device, every check held, and the alarms (which read the counters, late on CUDA) raise
    it at the update on every rank alike."""
    reporter = StepReporter(None, 8)
    counters = [0.0] * COUNTERS
    counters[Count.MISMATCH] = 1.0
    assert reporter._alarm(counters, ShardedGradScaler().policy, 5) is Alarm.MISMATCH
    with pytest.raises(ShardScaleMismatchError, match=r"step 5: at a collective of this step"):
        reporter.sound(Alarm.MISMATCH, [], 5, ShardedGradScaler().policy, 1.0)
