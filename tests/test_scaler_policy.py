"""The scale policy through the scaler, in one process: torch's scales and parameters bit for
bit, growth and back-off, hysteresis, the floor and the cap, a scale set by `update(new_scale)`."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardscale import ShardedGradScaler, ShardScaleWarning, count_collectives
from tests.setups import mlp, overflow_steps

INF_STEPS = (2, 3, 6)


def _train(
    scaler: Any, flavour: str, steps: int = 9, inf_steps: tuple[int, ...] = INF_STEPS
) -> tuple[list[float], list[torch.Tensor], list[int]]:
    """Train a small MLP with infs planted at ``inf_steps``; return scales, params, collectives."""
    model = mlp()
    options = {
        "for-loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options[flavour])
    scales, collectives = [], []
    for step in range(steps):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(inputs).pow(2).mean()).backward()
        if step in inf_steps:
            with torch.no_grad():
                model[2].weight.grad[0, 0] = math.inf
        with count_collectives() as counts:
            scaler.step(optimizer)
            scaler.update()
        scales.append(scaler.get_scale())
        collectives.append(sum(counts.values()))
    return scales, [p.detach().clone() for p in model.parameters()], collectives


def _assert_same_training(flavour: str) -> list[int]:
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "growth_interval": 2}
    torch_scales, torch_params, _ = _train(torch.amp.GradScaler("cpu", **kwargs), flavour)
    our_scales, our_params, collectives = _train(ShardedGradScaler(**kwargs), flavour)
    assert our_scales == torch_scales
    for ours, theirs in zip(our_params, torch_params, strict=True):
        assert torch.equal(ours, theirs)
    return collectives


@pytest.mark.parametrize("flavour", ["for-loop", "foreach", "fused"])
def test_scaler_without_process_group_matches_torch_bit_for_bit(flavour: str) -> None:
    assert not dist.is_initialized()
    assert _assert_same_training(flavour) == [0] * 9


@pytest.mark.parametrize("flavour", ["for-loop", "fused"])
@pytest.mark.usefixtures("world_of_one")
def test_scaler_world_size_one_matches_torch_and_issues_no_collective(flavour: str) -> None:
    assert _assert_same_training(flavour) == [0] * 9


def test_scaler_grows_after_interval_and_backs_off() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=2)
    assert overflow_steps(scaler, [False, False, True, False]) == [8.0, 16.0, 8.0, 8.0]


def test_scaler_hysteresis_tolerates_overflows() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=100, hysteresis=2)
    assert overflow_steps(scaler, [True, True, True]) == [8.0, 4.0, 2.0]


def test_scaler_at_floor_holds_keeps_skipping_and_warns_once() -> None:
    scaler = ShardedGradScaler(init_scale=4.0, min_scale=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales = overflow_steps(scaler, [True] * 5)
    assert scales == [2.0] * 5
    floor_warnings = [w for w in caught if issubclass(w.category, ShardScaleWarning)]
    assert len(floor_warnings) == 1
    assert "min_scale=2.0" in str(floor_warnings[0].message)
    state = scaler.state_dict()
    assert (state["skipped_steps"], state["consecutive_skips"]) == (5, 5)


def test_scaler_default_floor_stops_collapse_to_zero() -> None:
    """torch.amp.GradScaler halves to 0.0 after ~166 overflows; ours stops at min_scale=2**-24
    (skipping forever there: `max_overflows_at_floor=None`)."""
    scaler = ShardedGradScaler(init_scale=2.0**4, max_overflows_at_floor=None)
    with pytest.warns(ShardScaleWarning, match=r"backed off to min_scale=5.96046\d*e-08"):
        scales = overflow_steps(scaler, [True] * 40)
    assert scales[:4] == [8.0, 4.0, 2.0, 1.0]  # below 1 where it must, as torch's
    assert scales[27:] == [2.0**-24] * 13


def test_scaler_static_skips_nonfinite_but_never_moves() -> None:
    scaler = ShardedGradScaler(dynamic=False, growth_interval=1)
    assert scaler.get_scale() == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardScaleWarning)  # no floor warning: static by design
        assert overflow_steps(scaler, [True, False, False, True]) == [1.0] * 4
    assert scaler.state_dict()["skipped_steps"] == 2


def test_scaler_max_scale_caps_growth() -> None:
    scaler = ShardedGradScaler(init_scale=4.0, growth_interval=1, max_scale=16.0)
    assert overflow_steps(scaler, [False] * 4) == [8.0, 16.0, 16.0, 16.0]


def test_update_new_scale_sets_it() -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    overflow_steps(scaler, [False])
    scaler.update(32.0)
    assert scaler.get_scale() == 32.0
    scaler.update(torch.tensor([64.0]))
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize(
    ("new_scale", "error", "match"),
    [
        (
            1e-9,
            ValueError,
            r"new_scale must be in \[min_scale, max_scale\] = \[5.96046\d*e-08, inf\], got 1e-09",
        ),
        (math.nan, ValueError, r"new_scale must be finite, got nan"),
        (torch.ones(2), ValueError, r"one-element tensor .* got shape \(2,\)"),
        ("8", TypeError, r"new_scale must be a float or a tensor, got str"),
    ],
)
def test_update_bad_new_scale_raises_and_keeps_scale(
    new_scale: Any, error: type[Exception], match: str
) -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    overflow_steps(scaler, [False])
    with pytest.raises(error, match=match):
        scaler.update(new_scale)
    assert scaler.get_scale() == 8.0
