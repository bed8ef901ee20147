"""Several optimizers, one collective: a list, a torchtitan-style container, a Megatron chain."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler, count_collectives
from tests.harness import run_ranks

SCALE = 8.0


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's shape: an Optimizer whose ``optimizers`` are one per model part."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.steps = 0
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.steps += 1
        for optimizer in self.optimizers:
            optimizer.step()


class ChainedOptimizer:
    """Megatron's shape: not a torch Optimizer; ``chained_optimizers`` and a ``step()``."""

    def __init__(self, chained_optimizers: list[Any]) -> None:
        self.chained_optimizers = chained_optimizers
        self.steps = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.chained_optimizers for g in o.param_groups]

    def step(self) -> str:
        self.steps += 1
        for optimizer in self.chained_optimizers:
            optimizer.step()
        return "chained"


def _parts(count: int) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """A model of ``count`` parts, one optimizer each: fused, for-loop, foreach in turn."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(count)])
    flavours = [{"fused": True}, {"foreach": False}, {"foreach": True}]
    optimizers = [
        torch.optim.AdamW(part.parameters(), lr=0.1, **flavours[i % 3])
        for i, part in enumerate(model)
    ]
    return model, optimizers


def _wrap(shape: str, optimizers: list[torch.optim.Optimizer]) -> Any:
    if shape == "list":
        return optimizers
    if shape == "container":
        return OptimizersContainer(optimizers)
    if shape == "chain":
        return ChainedOptimizer(optimizers)
    raise ValueError(shape)


def _rank_several(
    rank: int, world_size: int, shape: str, count: int, plant_part: int | None, clip: bool
) -> dict[str, Any]:
    model, optimizers = _parts(count)
    target = _wrap(shape, optimizers)
    scaler = ShardedGradScaler(init_scale=SCALE)
    if clip:  # an optimizer's first step after a clip agrees again: count the next one
        scaler.scale(model(torch.ones(2, 8)).pow(2).mean()).backward()
        scaler.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(target)
        scaler.update()
        for optimizer in optimizers:
            optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 8)).pow(2).mean()).backward()
    if plant_part is not None and rank == 1:
        model[plant_part].weight.grad[0, 0] = math.inf  # type: ignore[index]
    before = [p.detach().clone() for p in model.parameters()]
    with count_collectives() as counts:
        if clip:
            scaler.clip_grad_norm_(model.parameters(), 1.0)
        result = scaler.step(target)
        scaler.update()
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
    return {
        "collectives": sum(counts.values()),
        "skipped": scaler.last_step_skipped,
        "scale": scaler.get_scale(),
        "moved": moved,
        "steps": scaler.stats.steps,
        "container_steps": getattr(target, "steps", None),
        "result": result if isinstance(result, str) else None,
    }


@pytest.mark.parametrize("shape", ["list", "container", "chain"])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_several_optimizers_agree_in_one_collective_and_update_once(shape: str, count: int) -> None:
    for result in run_ranks(_rank_several, 2, shape, count, count - 1, False):
        assert result["collectives"] == 1
        assert result["skipped"]
        assert not any(result["moved"])  # every part skipped, the fused ones on the device
        assert result["scale"] == SCALE / 2  # backed off once, not once per optimizer
        assert result["steps"] == 1
        if shape != "list":
            # all-fused parts are handed the flag and skip on the device; with any other part
            # the host reads the decision and the container's step() is not called
            assert result["container_steps"] == (1 if count == 1 else 0)


@pytest.mark.parametrize("shape", ["container", "chain"])
def test_container_clean_step_steps_every_part_once(shape: str) -> None:
    for result in run_ranks(_rank_several, 2, shape, 3, None, True):
        assert result["collectives"] == 1  # clip, step and update share it
        assert not result["skipped"]
        assert all(result["moved"])
        assert result["container_steps"] == 2  # once per iteration: the warm-up's, this one's
        if shape == "chain":
            assert result["result"] == "chained"  # what the container's step() returned


def _rank_one_by_one(rank: int, world_size: int, count: int) -> dict[str, Any]:
    model, optimizers = _parts(count)
    scaler = ShardedGradScaler(init_scale=SCALE)
    scaler.scale(model(torch.ones(2, 8)).pow(2).mean()).backward()
    with count_collectives() as counts:
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    return {"collectives": sum(counts.values()), "scale": scaler.get_scale()}


def test_stepping_optimizers_one_by_one_costs_one_collective_each() -> None:
    for result in run_ranks(_rank_one_by_one, 2, 3):
        assert result == {"collectives": 3, "scale": SCALE}


def test_list_step_returns_each_result_and_keeps_call_order_rules() -> None:
    model, optimizers = _parts(2)
    scaler = ShardedGradScaler(init_scale=SCALE)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    scaler.unscale_(optimizers)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(optimizers[1])
    assert scaler.step(optimizers) == [None, None]
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(optimizers[0])
    scaler.update()
    assert scaler.stats.steps == 1


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ([], ValueError, r"the list of optimizers must not be empty, got \[\]"),
        ("adam", TypeError, r"expected a torch.optim.Optimizer .* got str"),
    ],
)
def test_step_bad_target_raises_rule_and_value(
    target: Any, error: type[Exception], match: str
) -> None:
    model, _ = _parts(1)
    scaler = ShardedGradScaler()
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    with pytest.raises(error, match=match):
        scaler.step(target)


def test_step_same_optimizer_twice_in_a_list_raises() -> None:
    model, optimizers = _parts(1)
    scaler = ShardedGradScaler()
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    with pytest.raises(ValueError, match=r"appears twice in the optimizers given"):
        scaler.step([optimizers[0], OptimizersContainer(optimizers)])
