"""Failure is loud and bounded: a missing rank raises in time, disagreeing ranks are caught."""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardscale import ShardedGradScaler, ShardScaleDistributedError
from tests.harness import run_ranks
from tests.setups import build, mlp, plant


def _rank_one_rank_never_arrives(
    rank: int, world_size: int, device: str = "cpu", seconds: float = 2.0
) -> dict[str, Any]:
    """Rank 1 takes another code path and never calls step(); rank 0 must not hang."""
    model = mlp().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(sync_timeout=timedelta(seconds=seconds))
    scaler.scale(model(torch.ones(2, 16, device=device)).sum()).backward()
    if rank == 1:
        time.sleep(4 * seconds)  # then returns without ever joining
        return {"error": None}
    start = time.monotonic()
    try:
        scaler.step(optimizer)
    except ShardScaleDistributedError as error:
        return {"error": str(error), "waited": time.monotonic() - start}
    return {"error": "step() returned"}


def test_sync_timeout_missing_rank_raises_naming_step_and_group() -> None:
    waiting, _ = run_ranks(_rank_one_rank_never_arrives, 2, timeout_s=60)
    assert waiting["error"].startswith("step 1: waited 2 s for all 2 ranks of the process group")
    assert "the overflow flag" in waiting["error"]
    assert 1.9 < waiting["waited"] < 6.0


def _rank_agreeing_training_with_verification(rank: int, world_size: int) -> list[int]:
    setup = build("fsdp2", "fused", world_size)
    scaler = ShardedGradScaler(init_scale=8.0, verify_every=2, sync_timeout=30)
    for step in range(5):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, rank)).backward()
        if step == 1 and rank == 1:
            plant(setup.optimizer, math.nan)
        scaler.step(setup.optimizer)
        scaler.update()
    scaler.verify_agreement()
    state = scaler.state_dict()
    return [state["steps"], state["skipped_steps"]]


def test_verify_agreement_passes_when_ranks_agree() -> None:
    assert run_ranks(_rank_agreeing_training_with_verification, 2) == [[5, 1], [5, 1]]


def _rank_divergent_state(rank: int, world_size: int) -> str:
    """Rank 1 alone loads another state: the kind of mistake verify_agreement exists for."""
    scaler = ShardedGradScaler(init_scale=1024.0)
    scaler.scale(torch.tensor(1.0))
    if rank == 1:
        scaler.load_state_dict({**scaler.state_dict(), "scale": 2048.0, "_growth_tracker": 3})
    with pytest.raises(ShardScaleDistributedError) as error:
        scaler.verify_agreement()
    return str(error.value)


def test_verify_agreement_divergent_ranks_raise_with_every_ranks_values() -> None:
    for message in run_ranks(_rank_divergent_state, 2):
        assert "the scaler states of the 2 ranks differ" in message
        assert "scale: rank 0 = 1024, rank 1 = 2048" in message
        assert "_growth_tracker: rank 0 = 0, rank 1 = 3" in message
        assert "growth_factor" not in message  # only the fields that differ


@pytest.mark.usefixtures("world_of_one")
def test_verify_agreement_world_size_one_is_a_no_op() -> None:
    scaler = ShardedGradScaler(verify_every=1)
    scaler.scale(torch.tensor(1.0))
    scaler.verify_agreement()
    assert not dist.get_world_size() > 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sync_timeout": "5"}, TypeError, r"sync_timeout must be a datetime.timedelta, a number"),
        ({"sync_timeout": 0}, ValueError, r"sync_timeout must be a finite time > 0, got 0.0 s"),
        ({"sync_timeout": timedelta(seconds=-1)}, ValueError, r"got -1.0 s"),
        ({"sync_timeout": math.inf}, ValueError, r"got inf s"),
        ({"verify_every": -1}, ValueError, r"verify_every must be >= 0 \(0: never\), got -1"),
        ({"verify_every": 2.0}, TypeError, r"verify_every must be an int, got float"),
    ],
)
def test_reliability_arguments_are_validated(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ShardedGradScaler(**kwargs)


def _rank_locate_with_a_rank_missing(rank: int, world_size: int) -> str:
    """find_nonfinite_grads gathers through the agreement: bounded by its timeout too."""
    from shardscale import find_nonfinite_grads

    model = mlp()
    model(torch.ones(1, 16)).sum().backward()
    if rank == 1:
        time.sleep(15)  # never arrives in time
        return "slept"
    started = time.monotonic()
    try:
        find_nonfinite_grads(model, timeout=1.0)
    except ShardScaleDistributedError as error:
        return f"{time.monotonic() - started:.1f} s: {error}"
    return "no error"


def test_locate_overflow_gather_is_bounded_by_the_timeout() -> None:
    rank0, rank1 = run_ranks(_rank_locate_with_a_rank_missing, 2, timeout_s=60)
    assert rank1 == "slept"
    seconds, message = rank0.split(" s: ", 1)
    assert float(seconds) < 10
    assert "non-finite gradient records" in message
    assert "never arrived" in message
