"""AsyncShardedGradScaler with real threads: the scale a loss got is the one divided out."""

from __future__ import annotations

import concurrent.futures
import math
import pickle
import random
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardscale import AsyncShardedGradScaler, ScalePolicy, ShardedGradScaler
from tests.harness import run_ranks

ITERATIONS = 150
POLICY = {"growth_interval": 3, "min_scale": 2.0**-4}
INIT_SCALE = 2.0**10


def _inputs(iteration: int, rank: int) -> torch.Tensor:
    """Powers of two, so that scaling and unscaling are exact."""
    generator = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.pow(2.0, torch.randint(-4, 4, (32,), generator=generator).float())


def _overflows(iteration: int) -> list[int]:
    """Which ranks plant an inf at this iteration: the same draw on every rank."""
    draw = random.Random(iteration).random()
    return [0] if draw < 0.08 else [1] if draw < 0.16 else [0, 1] if draw < 0.2 else []


def _rank_async(rank: int, world_size: int, flavour: str) -> dict[str, Any]:
    """Main/compute thread: scale, backward, hand over, update. Optimizer thread: step."""
    weights = torch.ones(32, requires_grad=True)  # the compute copy: d(loss)/d(w) = x * S
    master = torch.zeros(32, requires_grad=True)  # the optimizer's copy
    optimizer = torch.optim.SGD([master], lr=1.0, **({"fused": True} if flavour == "fused" else {}))
    scaler = AsyncShardedGradScaler(init_scale=INIT_SCALE, **POLICY)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    rng = random.Random(rank)
    scales: list[float] = []
    unscaled_exact: list[bool] = []
    stepped: list[bool] = []
    stop = threading.Event()
    reads: list[int] = []

    def reader() -> None:  # a third thread reading while the others work
        while not stop.is_set():
            reads.append(scaler.stats.steps)
            time.sleep(0.001)

    def optimizer_step(iteration: int, grad: torch.Tensor, expected: torch.Tensor) -> None:
        time.sleep(rng.random() * 0.002)  # let update() often come first
        master.grad = grad
        if flavour == "for-loop":
            scaler.unscale_(optimizer)
            finite = bool(torch.isfinite(grad).all())
            unscaled_exact.append(not finite or torch.equal(grad, expected))
        before = master.detach().clone()
        scaler.step(optimizer)
        stepped.append(not torch.equal(before, master.detach()))

    watcher = threading.Thread(target=reader)
    watcher.start()
    futures = []
    try:
        for iteration in range(ITERATIONS):
            x = _inputs(iteration, rank)
            loss = (weights * x).sum()
            scaled = scaler.scale(loss)
            scales.append((scaled / loss).item())
            scaled.backward()
            grad, weights.grad = weights.grad, None
            assert grad is not None
            # The model's own collective on the default group (DDP's gradient all-reduce), from
            # this thread, while the optimizer thread agrees on the scaler's own group.
            dist.all_reduce(torch.ones(1))
            if rank in _overflows(iteration):
                grad[iteration % 32] = math.inf
            futures.append(pool.submit(optimizer_step, iteration, grad, x))
            scaler.update()
        for future in futures:
            future.result(timeout=60)
    finally:
        stop.set()
        watcher.join()
        pool.shutdown()
    return {
        "scales": scales,
        "unscaled_exact": all(unscaled_exact),
        "stepped": stepped,
        "master": master.detach().tolist(),
        "state": scaler.state_dict(),
        "reads_monotonic": reads == sorted(reads),
    }


def _synchronous_scales() -> tuple[list[float], list[bool]]:
    """The scales and skips synchronous training would have, from the policy's definition."""
    policy = ScalePolicy(**POLICY)
    state, scales, skips = policy.initial_state(INIT_SCALE), [], []
    for iteration in range(ITERATIONS):
        scales.append(state.scale)
        overflow = bool(_overflows(iteration))
        skips.append(overflow)
        state = policy.next(state, overflow)
    return scales, skips


@pytest.mark.parametrize("flavour", ["for-loop", "fused"])
def test_async_steps_on_a_thread_match_synchronous_training_on_2_ranks(flavour: str) -> None:
    results = run_ranks(_rank_async, 2, flavour, timeout_s=120)
    scales, skips = _synchronous_scales()
    assert 10 < sum(skips) < 50  # the draw planted enough infs, on one rank or both
    for rank, result in enumerate(results):
        assert result["scales"] == scales  # each loss got synchronous training's scale
        assert result["unscaled_exact"]  # ...and exactly that scale was divided out
        assert result["stepped"] == [not skip for skip in skips]  # both ranks, same decisions
        expected = -sum(_inputs(i, rank) for i in range(ITERATIONS) if not skips[i])
        assert result["master"] == expected.tolist()  # every taken step divided exactly
        assert result["reads_monotonic"]
    assert results[0]["state"] == results[1]["state"]
    assert results[0]["state"]["steps"] == ITERATIONS
    assert results[0]["state"]["skipped_steps"] == sum(skips)


def test_async_world_of_one_single_thread_behaves_like_the_sync_scaler() -> None:
    ours, theirs = AsyncShardedGradScaler(init_scale=8.0), ShardedGradScaler(init_scale=8.0)
    for scaler in (ours, theirs):
        weights = torch.ones(4, requires_grad=True)
        optimizer = torch.optim.SGD([weights], lr=0.1)
        for step in range(5):
            optimizer.zero_grad()
            scaler.scale(weights.sum()).backward()
            if step in (1, 2):
                weights.grad[0] = math.nan
            scaler.step(optimizer)
            scaler.update()
    assert ours.state_dict() == theirs.state_dict()
    assert ours.last_step_skipped is theirs.last_step_skipped is False


def _pair() -> tuple[AsyncShardedGradScaler, torch.Tensor, torch.optim.Optimizer]:
    weights = torch.ones(4, requires_grad=True)
    return AsyncShardedGradScaler(step_timeout=0.5), weights, torch.optim.SGD([weights], lr=0.1)


def test_async_scale_waits_for_the_previous_step_then_times_out_clearly() -> None:
    scaler, weights, _ = _pair()
    scaler.scale(weights.sum()).backward()
    scaler.update()  # iteration 1 ended, but its step never comes
    with pytest.raises(RuntimeError, match=r"waited 0.5 s for the step of iteration 1"):
        scaler.scale(weights.sum())


def test_async_failed_step_is_reraised_by_the_waiting_scale() -> None:
    scaler, weights, optimizer = _pair()
    scaler.scale(weights.sum()).backward()
    weights.grad = None  # the step finds no gradient to check: it raises before agreeing
    with pytest.raises(RuntimeError, match="none of its parameters has a gradient"):
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(RuntimeError, match="the optimizer step of iteration 1 failed") as error:
        scaler.scale(weights.sum())
    assert "none of its parameters has a gradient" in str(error.value.__cause__)


def test_async_errors_name_the_rule() -> None:
    scaler, weights, optimizer = _pair()
    with pytest.raises(RuntimeError, match="no scale\\(\\) since the last update"):
        scaler.update()
    scaler.scale(weights.sum()).backward()
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="no iteration is waiting for a step"):
        scaler.step(optimizer)
    other = torch.optim.SGD([torch.ones(1, requires_grad=True)], lr=0.1)
    with pytest.raises(ValueError, match="serves one optimizer, and got a second one"):
        scaler.step(other)
    with pytest.raises(RuntimeError, match="with 1 iteration\\(s\\) in flight"):
        scaler.load_state_dict(ShardedGradScaler().state_dict())
    with pytest.raises(ValueError, match="does not take verify_every"):
        AsyncShardedGradScaler(verify_every=5)
    with pytest.raises(ValueError, match="step_timeout must be a finite time > 0, got 0"):
        AsyncShardedGradScaler(step_timeout=0)
    with pytest.raises(ValueError, match="step_timeout must be a finite time > 0, got None"):
        AsyncShardedGradScaler(step_timeout=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(scaler)


def test_async_clip_on_the_optimizer_thread_clips_the_iteration_it_serves() -> None:
    scaler = AsyncShardedGradScaler(init_scale=8.0)
    weights = torch.ones(4, requires_grad=True)
    master = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.SGD([master], lr=1.0)
    scaler.scale((weights * 3.0).sum()).backward()  # unscaled gradient: 3 per element, norm 6
    grad, weights.grad = weights.grad, None

    def optimizer_step() -> torch.Tensor:
        master.grad = grad
        norm = scaler.clip_grad_norm_([master], 1.0)
        scaler.step(optimizer)
        return norm

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        norm = pool.submit(optimizer_step).result(timeout=60)
    scaler.update()
    assert norm.item() == 6.0
    torch.testing.assert_close(master.detach(), torch.full((4,), -0.5), rtol=1e-5, atol=0)
    assert scaler.stats.steps == 1


def test_async_scale_before_step_is_the_first_iterations_scale() -> None:
    scaler, weights, optimizer = _pair()
    scaled = scaler.scale(weights.sum())
    assert scaled.item() == 4 * 2.0**16
    scaled.backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**16
    assert scaler.stats.steps == 1


def _rank_async_on_a_subgroup(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks {0, 1} and {2, 3}, each pair with its own async scaler: the scaler's own group is
    made by the pair alone (no rank outside it joins), and each pair agrees within itself."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    scaler = AsyncShardedGradScaler(init_scale=8.0, process_group=group)
    weights = torch.ones(4, requires_grad=True)  # the compute copy
    master = torch.zeros(4, requires_grad=True)  # the optimizer thread's copy
    optimizer = torch.optim.SGD([master], lr=0.1)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    futures = []
    for iteration in range(4):
        scaler.scale(weights.sum()).backward()
        grad, weights.grad = weights.grad, None
        assert grad is not None
        if iteration == 1 and rank == 0:  # only the first pair overflows
            grad[0] = math.inf

        def step(grad: torch.Tensor = grad) -> None:
            master.grad = grad
            scaler.step(optimizer)

        futures.append(pool.submit(step))
        scaler.update()
    for future in futures:
        future.result(timeout=60)
    pool.shutdown()
    state = scaler.state_dict()
    return {"skipped": state["skipped_steps"], "scale": state["scale"]}


def test_async_scaler_on_a_subgroup_makes_its_group_with_the_subgroup_alone() -> None:
    results = run_ranks(_rank_async_on_a_subgroup, 4, timeout_s=120)
    assert results[:2] == [{"skipped": 1, "scale": 4.0}] * 2
    assert results[2:] == [{"skipped": 0, "scale": 8.0}] * 2
