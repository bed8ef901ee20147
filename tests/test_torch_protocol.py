"""torch's own protocol, exactly: one verdict per optimizer, torch's step body wherever it runs,
and torch's values where ours once rounded or grew (the differential test's classes, pinned one
by one; tests/test_torch_differential.py searches for the rest)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler
from tests.harness import run_ranks


class TorchBodyScaler(ShardedGradScaler):
    """A framework's scaler written on torch.amp: its `step()` is torch's own body."""

    step = torch.amp.GradScaler.step  # type: ignore[assignment]


def _twins(flavour: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Two optimizers over two layers, twice: for torch's scaler and for ours."""
    sides = []
    for _ in range(2):
        torch.manual_seed(0)
        layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        optimizers = [
            torch.optim.SGD(layer.parameters(), lr=0.1, **(flavour or {})) for layer in layers
        ]
        sides.append((layers, optimizers))
    return sides[0], sides[1]


def _recipe(
    scaler: Any, layers: nn.ModuleList, optimizers: list[Any], inf_in: int | None
) -> list[Any]:
    """torch's multi-optimizer recipe: unscale_ each, step each, update once."""
    for optimizer in optimizers:
        optimizer.zero_grad()
    scaler.scale(sum(layer(torch.ones(2, 3)).sum() for layer in layers)).backward()
    if inf_in is not None:
        layers[inf_in].weight.grad[0, 0] = math.inf
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    results = [scaler.step(optimizer) for optimizer in optimizers]
    scaler.update()
    return results


@pytest.mark.parametrize("scaler_class", [ShardedGradScaler, TorchBodyScaler])
def test_each_optimizer_keeps_its_own_verdict_as_in_torchs_recipe(scaler_class: type) -> None:
    """An inf in `a`'s gradients alone: torch steps `b`, and so do we, on every iteration (the
    second one's unscale_ checks wait for the step's collective, each in its own slot)."""
    (theirs, their_opts), (ours, our_opts) = _twins()
    torch_scaler, scaler = torch.amp.GradScaler("cpu"), scaler_class()
    for inf_in in (None, 0, 0, None, 1):
        _recipe(torch_scaler, theirs, their_opts, inf_in)
        _recipe(scaler, ours, our_opts, inf_in)
        for a, b in zip(theirs.parameters(), ours.parameters(), strict=True):
            assert torch.equal(a, b)
        assert scaler.get_scale() == torch_scaler.get_scale()


def _rank_recipe(rank: int, world_size: int, body: str) -> dict[str, Any]:
    """The recipe on 2 ranks, rank 1 alone holding the inf in `a`'s gradients (step 2)."""
    (_, _), (layers, optimizers) = _twins()
    scaler = (TorchBodyScaler if body == "subclass" else ShardedGradScaler)(sync_timeout=20.0)
    moved = []
    for inf_in in (None, 0 if rank == 1 else None, None):
        before = [p.detach().clone() for p in layers.parameters()]
        _recipe(scaler, layers, optimizers, inf_in)
        moved.append(
            [not torch.equal(b, p) for b, p in zip(before, layers.parameters(), strict=True)]
        )
    return {"moved": moved, "scale": scaler.get_scale()}


@pytest.mark.parametrize("body", ["ours", "subclass"])
def test_each_optimizer_keeps_its_own_verdict_on_two_ranks(body: str) -> None:
    rank0, rank1 = run_ranks(_rank_recipe, 2, body)
    assert rank0 == rank1
    # step 2: a's weight and bias skipped on both ranks, b's stepped
    assert rank0["moved"][1] == [False, False, True, True]


def test_the_no_gradient_rule_is_each_optimizers_on_a_first_step() -> None:
    """A scaler's first step: `o0` holds gradients, `o1` none. torch steps `o0` and raises at
    `o1`'s step; the iteration ends with update() (o0's check counts)."""
    (_, _), (layers, (o0, o1)) = _twins()
    scaler = ShardedGradScaler()
    scaler.scale(layers[0](torch.ones(2, 3)).sum()).backward()
    before = layers[0].weight.detach().clone()
    scaler.unscale_(o0)
    scaler.unscale_(o1)  # no gradient: torch raises at the step, not here
    assert scaler.step(o0) is None
    assert not torch.equal(before, layers[0].weight)
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        scaler.step(o1)
    scaler.update()  # o0's check counts: no error
    scaler.scale(layers[0](torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(o0)
    scaler.unscale_(o1)  # a later step: both checks wait for step(o0)'s collective
    scaler.step(o0)
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        scaler.step(o1)  # later steps too: errors.md's rule


def test_torchs_step_body_run_on_ours_steps() -> None:
    """`torch.amp.GradScaler.step(scaler, optimizer)`: torch's body reads a live state (one
    read before `unscale_()` answers after), asserts a flag exists, and runs our step."""
    (theirs, their_opts), (ours, our_opts) = _twins()
    torch_scaler, scaler = torch.amp.GradScaler("cpu"), ShardedGradScaler()
    for inf in (False, True, False):
        for layers, optimizers, s, step in (
            (theirs, their_opts, torch_scaler, torch_scaler.step),
            (ours, our_opts, scaler, lambda o: torch.amp.GradScaler.step(scaler, o)),
        ):
            for optimizer in optimizers:
                optimizer.zero_grad()
            s.scale(
                layers[0](torch.ones(2, 3)).sum() + layers[1](torch.ones(2, 3)).sum()
            ).backward()
            if inf:
                layers[0].weight.grad[0, 0] = math.inf
            for optimizer in optimizers:
                step(optimizer)
            s.update()
    for a, b in zip(theirs.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b)
    assert scaler.get_scale() == torch_scaler.get_scale()


def _rank_torch_body_without_gradients(rank: int, world_size: int, fused: bool) -> dict[str, Any]:
    """torch's body on 2 ranks; `b` holds no gradient on rank 0 (its layer unused there: an
    expert no token reached), one on rank 1; `unscale_` first (the fused path too: torch's body
    steps it itself). Each optimizer's decision, after its step, per iteration."""
    (_, _), (layers, optimizers) = _twins({"fused": True} if fused else None)
    scaler = TorchBodyScaler(sync_timeout=20.0)
    skipped = []
    for step in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        used = layers if rank == 1 else layers[:1]
        scaler.scale(sum(layer(torch.ones(2, 3)).sum() for layer in used)).backward()
        if step == 1 and rank == 1:
            layers[1].weight.grad[0, 0] = math.inf  # type: ignore[index]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the local flag's warning, between unscale_ and step
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
            decisions = []
            for optimizer in optimizers:
                scaler.step(optimizer)
                decisions.append(scaler.last_step_skipped)
        scaler.update()
        skipped.append(decisions)
    return {"skipped": skipped, "scale": scaler.get_scale()}


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
def test_torchs_body_with_an_optimizer_without_gradients_on_one_rank_agrees(fused: bool) -> None:
    rank0, rank1 = run_ranks(_rank_torch_body_without_gradients, 2, fused)
    assert rank0 == rank1  # every rank steps and skips alike, at the same calls
    assert rank0["skipped"] == [[False, False], [False, True], [False, False]]


# ---------------------------------------------------------------- torch's values


def test_init_scale_is_torchs_until_a_device_holds_it() -> None:
    scaler, theirs = (
        ShardedGradScaler(init_scale=6553.6),
        torch.amp.GradScaler("cpu", init_scale=6553.6),
    )
    assert scaler.get_scale() == theirs.get_scale() == 6553.6
    assert scaler.state_dict()["scale"] == theirs.state_dict()["scale"] == 6553.6
    scaler.scale(torch.ones(()))
    theirs.scale(torch.ones(()))
    assert scaler.get_scale() == theirs.get_scale() == 6553.60009765625  # float32 on the device


def test_a_forward_overflow_holds_the_scale_where_the_tracker_reached_the_interval() -> None:
    """set_growth_interval() below the tracker: a clean step would not grow it (torch's kernel
    counts on), nor may a forward overflow (it holds everything)."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, fused=True)  # its outcome unread
    scaler = ShardedGradScaler(init_scale=1024.0, growth_interval=5)
    for loss in (1.0, 1.0, math.inf):
        if loss == math.inf:
            scaler.set_growth_interval(2)  # the tracker is 2 now: at the interval
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum() * loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() == 1024.0
    assert scaler._get_growth_tracker() == 2
    assert scaler.stats.forward_overflows == 1


def test_a_disabled_scalers_clip_is_torchs_a_non_finite_norm_included() -> None:
    for value in (math.inf, math.nan, 3.0):
        grads = [torch.tensor([value, 1.0]), torch.tensor([2.0, 2.0])]
        ours, theirs = (
            [nn.Parameter(torch.zeros(2)) for _ in grads],
            [nn.Parameter(torch.zeros(2)) for _ in grads],
        )
        for params in (ours, theirs):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
        norm = ShardedGradScaler(enabled=False).clip_grad_norm_(ours, 1.0)
        their_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        assert torch.equal(norm, their_norm) or (norm.isnan() and their_norm.isnan())
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.grad, b.grad, equal_nan=True, rtol=0, atol=0)
