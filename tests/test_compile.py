"""torch.compile: a compiled model trains with the scaler as the eager one does."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler
from tests.setups import mlp

STEPS = 5
PLANTED = 2


def _train(model: nn.Module, step_fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=2)

    def train_step(inputs: torch.Tensor, plant: bool) -> None:
        loss = model(inputs).pow(2).mean()
        scaler.scale(loss).backward()
        if plant:
            next(model.parameters()).grad[0, 0] = math.inf
        scaler.step(optimizer)
        scaler.update()

    step = step_fn(train_step) if step_fn is not None else train_step
    scales = []
    generator = torch.Generator().manual_seed(0)
    for index in range(STEPS):
        optimizer.zero_grad()
        step(torch.randn(4, 16, generator=generator), index == PLANTED)
        scales.append(scaler.get_scale())
    return {
        "scales": scales,
        "stats": scaler.stats,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _assert_same(ours: dict[str, Any], eager: dict[str, Any]) -> None:
    assert ours["scales"] == eager["scales"]
    assert ours["stats"] == eager["stats"]
    assert ours["stats"].last_overflow_step == PLANTED + 1
    for a, b in zip(ours["params"], eager["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_model_trains_with_the_scaler_like_eager() -> None:
    """The recommended use: compile the model (inductor); the scaler runs eagerly around it."""
    eager = _train(mlp())
    compiled = _train(torch.compile(mlp()))
    _assert_same(compiled, eager)


# The cached function makes constant tensors: traced afresh, it makes the same ones.
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_compiled_train_step_with_the_scaler_inside_graph_breaks_and_works() -> None:
    """Compiling a whole step with the scaler inside: dynamo breaks the graph at the scaler's
    host read and collective, and the result equals eager."""
    eager = _train(mlp())
    compiled = _train(mlp(), lambda fn: torch.compile(fn, backend="aot_eager"))
    _assert_same(compiled, eager)
