"""Property tests: the device policy against its definition; state dicts across both scalers."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardscale import ScalePolicy, ScaleState, ShardedGradScaler
from shardscale._policy import FIT_MARGIN, FIT_WINDOW
from shardscale._state import move_scale_

_FACTORS = st.floats(min_value=1.01, max_value=8.0)
_BACKOFFS = st.floats(min_value=0.05, max_value=0.95)


@st.composite
def policies(draw: st.DrawFn) -> tuple[ScalePolicy, float]:
    """A policy, and an initial scale it accepts."""
    min_scale = draw(st.sampled_from([2.0**-10, 1.0, 3.0]))
    max_scale = draw(st.sampled_from([math.inf, 2.0**20, 3e38]))
    init_scale = draw(st.floats(min_value=min_scale, max_value=min(max_scale, 2.0**30)))
    return ScalePolicy(
        growth_factor=draw(_FACTORS),
        backoff_factor=draw(_BACKOFFS),
        growth_interval=draw(st.integers(1, 6)),
        hysteresis=draw(st.integers(1, 4)),
        min_scale=min_scale,
        max_scale=max_scale,
        dynamic=draw(st.booleans()),
    ), init_scale


@settings(max_examples=150, deadline=None)
@given(drawn=policies(), overflows=st.lists(st.booleans(), max_size=60))
def test_property_device_update_equals_reference(
    drawn: tuple[ScalePolicy, float], overflows: list[bool]
) -> None:
    policy, init_scale = drawn
    state = policy.initial_state(init_scale)
    scale = torch.tensor(state.scale)
    growth = torch.tensor(state.growth_tracker, dtype=torch.int32)
    hysteresis = torch.tensor(state.hysteresis_tracker, dtype=torch.int32)
    for found_inf in overflows:
        state = policy.next(state, found_inf)
        move_scale_(policy, scale, growth, hysteresis, torch.tensor(float(found_inf)))
        assert ScaleState(scale.item(), int(growth.item()), int(hysteresis.item())) == state
        assert policy.min_scale <= state.scale <= policy.max_scale


@settings(max_examples=150, deadline=None)
@given(drawn=policies(), overflows=st.lists(st.booleans(), max_size=30))
def test_property_reference_hysteresis_one_equals_torch(
    drawn: tuple[ScalePolicy, float], overflows: list[bool]
) -> None:
    """Where the floor and ceiling are not reached, hysteresis 1 is torch's policy exactly."""
    settings, init_scale = drawn
    policy = ScalePolicy(
        growth_factor=settings.growth_factor,
        backoff_factor=settings.backoff_factor,
        growth_interval=settings.growth_interval,
        min_scale=2.0**-100,
    )
    state = policy.initial_state(init_scale)
    scale, growth = torch.tensor(state.scale), torch.tensor(0, dtype=torch.int32)
    for found_inf in overflows:
        state = policy.next(state, found_inf)
        torch._amp_update_scale_(
            scale,
            growth,
            torch.tensor(float(found_inf)),
            policy.growth_factor,
            policy.backoff_factor,
            policy.growth_interval,
        )
        assert (scale.item(), int(growth.item())) == (state.scale, state.growth_tracker)


@st.composite
def scaler_states(draw: st.DrawFn) -> dict[str, Any]:
    growth_interval = draw(st.integers(1, 5000))
    hysteresis = draw(st.integers(1, 5))
    steps = draw(st.integers(0, 10**9))
    skipped = draw(st.integers(0, steps))
    return {
        "scale": draw(st.floats(min_value=1.0, max_value=2.0**40)),
        "growth_factor": draw(_FACTORS),
        "backoff_factor": draw(_BACKOFFS),
        "growth_interval": growth_interval,
        "_growth_tracker": draw(st.integers(0, growth_interval - 1)),
        "hysteresis": hysteresis,
        "_hysteresis_tracker": draw(st.integers(1, hysteresis)),
        "min_scale": 1.0,
        "max_scale": math.inf,
        "dynamic": draw(st.booleans()),
        "steps": steps,
        "skipped_steps": skipped,
        "consecutive_skips": draw(st.integers(0, skipped)),
        "last_overflow_step": draw(st.integers(1, steps)) if skipped else 0,
    }


@settings(max_examples=100, deadline=None)
@given(state=scaler_states(), materialized=st.booleans())
def test_property_state_dict_round_trips_ours_and_through_torch(
    state: dict[str, Any], materialized: bool
) -> None:
    ours = ShardedGradScaler()
    if materialized:
        ours.scale(torch.tensor(1.0))
    ours.load_state_dict(state)
    # float32 is what the scale tensor holds; everything else is exact
    # a dict without format_version is the first format's: it loads, and saves as the newest
    # (with the counters the first format lacks, at 0)
    expected = {
        **state,
        "scale": torch.tensor(state["scale"]).item() if materialized else state["scale"],
        "forward_overflows": 0,
        "retries": 0,
        "format_version": 5,
        "scale_policy": "interval",
        "_fit_margin": FIT_MARGIN,
        "_fit_window": [0.0] * FIT_WINDOW,
        "_fit_streak": 0,
        "floor_streak": 0,
        "loss_streak": 0,
    }
    assert ours.state_dict() == expected
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    back = ShardedGradScaler(hysteresis=state["hysteresis"])
    back.load_state_dict(theirs.state_dict())
    assert {k: back.state_dict()[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert back.state_dict()["_hysteresis_tracker"] == state["hysteresis"]  # a full allowance
