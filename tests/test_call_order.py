"""The per-iteration protocol in one process: torch's call-order errors, word for word, and
what each call returns and decides."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardscale import ShardedGradScaler
from tests.setups import mlp, scaled_backward


def _unscale_twice(scaler: Any, optimizer: Any) -> None:
    scaler.unscale_(optimizer)
    scaler.unscale_(optimizer)


def _unscale_after_step(scaler: Any, optimizer: Any) -> None:
    scaler.step(optimizer)
    scaler.unscale_(optimizer)


def _step_twice(scaler: Any, optimizer: Any) -> None:
    scaler.step(optimizer)
    scaler.step(optimizer)


@pytest.mark.parametrize("mistake", [_unscale_twice, _unscale_after_step, _step_twice])
def test_call_order_mistake_raises_torch_error(mistake: Any) -> None:
    torch_scaler = torch.amp.GradScaler("cpu")
    _, torch_optimizer = scaled_backward(torch_scaler)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError) as torch_error:
        mistake(torch_scaler, torch_optimizer)
    scaler = ShardedGradScaler()
    _, optimizer = scaled_backward(scaler)
    with pytest.raises(RuntimeError) as our_error:
        mistake(scaler, optimizer)
    assert str(our_error.value) == str(torch_error.value)


@pytest.mark.parametrize("mistake", [_unscale_twice, _unscale_after_step, _step_twice])
def test_call_order_mistake_leaves_scaler_usable(mistake: Any) -> None:
    """After the error, finishing the iteration and training on works, with unchanged state."""
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=2)
    model, optimizer = scaled_backward(scaler)
    before = {k: v for k, v in scaler.state_dict().items()}
    with pytest.raises(RuntimeError):
        mistake(scaler, optimizer)
    assert scaler.state_dict() == before
    scaler.update()
    for _ in range(2):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.state_dict()["steps"] == 3
    assert scaler.get_scale() == 16.0  # grew after two clean steps: the policy still runs


@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_call_before_scale_raises(method: str) -> None:
    scaler = ShardedGradScaler()
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    args = () if method == "update" else (optimizer,)
    with pytest.raises(RuntimeError, match=rf"Attempted {method} but _scale is None"):
        getattr(scaler, method)(*args)


def test_update_without_step_raises() -> None:
    scaler = ShardedGradScaler()
    scaled_backward(scaler)
    with pytest.raises(RuntimeError, match=r"No inf checks were recorded prior to update"):
        scaler.update()


def test_step_without_any_gradient_raises() -> None:
    scaler = ShardedGradScaler()
    scaler.scale(torch.tensor(1.0))
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(
        RuntimeError, match=r"none of its parameters has a gradient on any of the 1"
    ):
        scaler.step(optimizer)


def test_step_returns_what_the_optimizer_returns() -> None:
    class Reporting(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            super().step()
            return "stepped"

    scaler = ShardedGradScaler()
    model = mlp()
    optimizer = Reporting(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 16)).sum()).backward()
    assert scaler.step(optimizer) == "stepped"


def test_unscale_then_fused_step_hands_agreed_flag_of_shape_scalar() -> None:
    """torch's ShardedGradScaler passes a (1,)-shaped found_inf here and the fused kernel fails."""
    scaler = ShardedGradScaler(init_scale=4.0)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for planted in (None, math.inf):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).sum()).backward()
        if planted is not None:
            model[0].bias.grad[0] = planted
        scaler.unscale_(optimizer)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        changed = any(
            not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)
        )
        assert changed is (planted is None)
        assert scaler.last_step_skipped is (planted is not None)
    assert scaler.get_scale() == 2.0


def test_two_optimizers_each_decide_and_update_backs_off_once() -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    model = mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    model[2].weight.grad[0, 0] = math.nan
    before_first = model[0].weight.detach().clone()
    before_second = model[2].weight.detach().clone()
    scaler.step(first)
    assert not scaler.last_step_skipped
    scaler.step(second)
    assert scaler.last_step_skipped
    scaler.update()
    assert not torch.equal(model[0].weight, before_first)
    assert torch.equal(model[2].weight, before_second)
    assert scaler.get_scale() == 4.0
    assert scaler.state_dict()["skipped_steps"] == 1
