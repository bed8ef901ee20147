"""What one rank observes never changes what it communicates: the CUDA path, on 2 gloo ranks.

On CUDA the scaler reads its device state one update late (a non-blocking copy, read at the
next `update()`), and its alarms (the floor warning, the non-finite error, the skip limit, the
loss streak) gather where the non-finite values are: a collective. Here the scaler takes those
CUDA branches on CPU tensors, through the package's own seam, `shardscale.testing.cuda_path()`,
in real gloo processes. The ranks hold the same gradients (all-reduced by hand) and differ only
in what rank 0 observes, as training scripts that log on rank 0 alone do:

* `"hook and log"`: a stats hook and the `"shardscale"` logger at INFO;
* `"stats"`: `scaler.stats` read after each update;
* `"reads"`: `last_step_skipped` and `last_overflow` after each step, torch's private
  `_found_inf_per_device` / `_per_optimizer_states` between `unscale_()` and the call that
  agrees on it, and `get_scale()` after each update.

The gradients hold a NaN at the floor (the scale starts there), every other step or every step,
under both scale policies, with and without clipping, for a fused and a foreach optimizer.
Every collective each rank issues is recorded (what, shapes, dtypes, reduction) and compared;
the runs set `TORCH_DISTRIBUTED_DEBUG=DETAIL`, under which torch itself checks before each
collective that every rank issues the same one, so a mismatch fails at once, not after a
timeout. A persistent NaN must raise `ShardScaleNonFiniteError` on both ranks at the same step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import math
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardscale import AsyncShardedGradScaler, ShardedGradScaler, ShardScaleNonFiniteError
from shardscale.testing import cuda_path
from tests.harness import run_ranks

OBSERVERS = ("hook and log", "stats", "reads")
PATTERNS = ("every other step", "every step")
STEPS = 14  # past max_overflows_at_floor (8): a persistent NaN has raised by then
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier")
_COLLECTIVES += ("all_gather_object", "reduce_scatter_tensor", "all_to_all_single", "gather")


@contextmanager
def recorded_collectives(own_group_only: bool = False) -> Iterator[list[tuple[Any, ...]]]:
    """Every collective this process issues through `torch.distributed`, in order: its name,
    the shapes and dtypes of its tensors, its reduction; then it runs, unchanged.
    `own_group_only`: those on groups other than the default one only (an async scaler's)."""
    log: list[tuple[Any, ...]] = []
    lock = threading.Lock()

    def recording(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        def run(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
            shapes = tuple((tuple(t.shape), str(t.dtype)) for t in tensors)
            group = kwargs.get("group")
            if not own_group_only or group not in (None, dist.group.WORLD):
                with lock:
                    log.append((name, shapes, str(kwargs.get("op", ""))))
            return real(*args, **kwargs)

        return run

    with pytest.MonkeyPatch.context() as patch:
        for name in _COLLECTIVES:
            patch.setattr(dist, name, recording(name, getattr(dist, name)))
        yield log


def _flat(tree: Any) -> Iterator[Any]:
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _flat(item)
    else:
        yield tree


@contextmanager
def _observing(scaler: ShardedGradScaler, observer: str | None) -> Iterator[None]:
    """`observer` on this rank for the block (None: nobody observes)."""
    shardscale_log = logging.getLogger("shardscale")
    level = shardscale_log.level
    handle = None
    if observer == "hook and log":
        handle = scaler.register_stats_hook(lambda stats: None)
        shardscale_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        shardscale_log.setLevel(level)
        if handle is not None:
            handle.remove()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))


def _run_case(rank: int, case: tuple[str, str, bool, str, str]) -> dict[str, Any]:
    """One case on this rank: the collectives it issued, and the step its error came at."""
    pattern, policy, clip, flavour, observer = case
    model = _model()
    kind = {"fused": True} if flavour == "fused" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3, **kind)
    scaler = ShardedGradScaler(
        init_scale=2.0**-24, scale_policy=policy, sync_timeout=10.0, underflow_every=3
    )
    watching = observer if rank == 0 else None
    raised_at, message = None, None
    with recorded_collectives() as log, _observing(scaler, watching), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the floor's and the local flags' warnings
        for step in range(1, STEPS + 1):
            try:
                _step(model, optimizer, scaler, step, pattern, clip, watching)
            except ShardScaleNonFiniteError as error:
                raised_at, message = step, str(error)
                break
    return {"collectives": log, "raised_at": raised_at, "message": message}


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: ShardedGradScaler,
    step: int,
    pattern: str,
    clip: bool,
    observer: str | None,
) -> None:
    """One iteration: the same batch and gradients on every rank, a NaN where `pattern` says."""
    optimizer.zero_grad()
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(inputs).float().pow(2).mean()
    scaler.scale(loss).backward()
    for param in model.parameters():  # the same gradients on every rank, as DDP's
        dist.all_reduce(param.grad)  # type: ignore[arg-type]
    if pattern == "every step" or step % 2 == 0:
        model[2].weight.grad[0, 1] = math.nan  # type: ignore[index]
    if clip:
        scaler.unscale_(optimizer)
        if observer == "reads":
            scaler._found_inf_per_device(optimizer)
            scaler._per_optimizer_states[id(optimizer)]
        scaler.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    seen: list[object] = []  # what the observer reads, and throws away
    if observer == "reads":
        seen += [scaler.last_step_skipped, scaler.last_overflow]
    scaler.update()
    if observer == "stats":
        seen.append(scaler.stats)
    elif observer == "reads":
        seen.append(scaler.get_scale())


CASES = list(
    itertools.product(PATTERNS, ("interval", "fit"), (False, True), ("fused", "foreach"), OBSERVERS)
)


def _rank_cases(rank: int, world_size: int, cases: list[Any]) -> list[dict[str, Any]]:
    with cuda_path():
        return [_run_case(rank, case) for case in cases]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_rank_symmetry_rank_0_observing_issues_the_same_collectives(pattern: str) -> None:
    cases = [case for case in CASES if case[0] == pattern]
    rank0, rank1 = run_ranks(_rank_cases, 2, cases, timeout_s=240, env=DETAIL)
    for case, mine, theirs in zip(cases, rank0, rank1, strict=True):
        assert mine["collectives"] == theirs["collectives"], case
        assert len(mine["collectives"]) > STEPS, case  # the steps' and the hand all-reduces
        assert mine["raised_at"] == theirs["raised_at"], case
        assert mine["message"] == theirs["message"], case
        if pattern == "every step":  # at the floor from step 1: the 8th overflow there raises
            assert mine["raised_at"] == 8, case
            assert "rank 0: 2.weight (0 inf, 1 NaN)" in mine["message"], case
        else:
            assert mine["raised_at"] is None, case
        if case[1] == "interval":  # at the floor throughout: the floor warning named the
            gathers = [c for c in mine["collectives"] if c[0] == "all_gather"]
            assert gathers, case  # parameter, with a gather, on both ranks


def _rank_async(rank: int, world_size: int, pattern: str) -> dict[str, Any]:
    """The async scaler: the optimizer steps on a thread of its own, `update()` often comes
    first; rank 0 alone has a hook, the log at INFO and a thread reading `stats` throughout.
    Every collective on the scaler's own group is recorded; the error, on whichever thread."""
    model = _model()
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3, fused=True)
    scaler = AsyncShardedGradScaler(init_scale=2.0**-24, sync_timeout=10.0)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    stop, errors = threading.Event(), []
    watching = "hook and log" if rank == 0 else None

    def reader() -> None:
        while rank == 0 and not stop.is_set():
            scaler.stats  # noqa: B018 (a read, thrown away)
            time.sleep(0.0005)

    def optimizer_step(step: int) -> None:
        time.sleep(random.Random(step).random() * 0.002)  # let update() often come first
        try:
            scaler.step(optimizer)
        except ShardScaleNonFiniteError as error:
            errors.append((step, str(error)))

    watcher = threading.Thread(target=reader)
    recording = recorded_collectives(own_group_only=True)
    with cuda_path(), recording as log, _observing(scaler, watching), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watcher.start()
        try:
            for step in range(1, STEPS + 1):
                _async_iteration(model, scaler, step, pattern)
                stepped = pool.submit(optimizer_step, step)
                try:
                    scaler.update()  # often before the step has agreed: its update waits
                except ShardScaleNonFiniteError as error:
                    errors.append((step, str(error)))
                stepped.result(timeout=60)  # whichever thread applied the update, it is done
                if errors:
                    break
        finally:
            stop.set()
            watcher.join()
            pool.shutdown()
    return {"collectives": log, "errors": errors}


def _async_iteration(model: nn.Module, scaler: ShardedGradScaler, step: int, pattern: str) -> None:
    """Forward and backward, gradients made the same on every rank, a NaN where `pattern` says."""
    for param in model.parameters():
        param.grad = None
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    scaler.scale(model(inputs).pow(2).mean()).backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)  # type: ignore[arg-type]
    if pattern == "every step" or step % 2 == 0:
        model[2].weight.grad[0, 1] = math.nan  # type: ignore[index]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_rank_symmetry_async_scaler_rank_0_observing_issues_the_same_collectives(
    pattern: str,
) -> None:
    rank0, rank1 = run_ranks(_rank_async, 2, pattern, timeout_s=120, env=DETAIL)
    assert rank0["collectives"] == rank1["collectives"]
    assert len(rank0["collectives"]) >= 8  # a flag all-reduce a step, and the alarms' gathers
    assert [step for step, _ in rank0["errors"]] == [step for step, _ in rank1["errors"]]
    if pattern == "every step":
        assert rank0["errors"][0][0] == 8
        assert rank0["errors"] == rank1["errors"]
    else:
        assert rank0["errors"] == []
