"""The scale policy: validation, and the device maths against the plain-Python definition."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shardscale import ScalePolicy, ScaleState


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (
            {"growth_factor": 1.0},
            ValueError,
            r"growth_factor must be a finite number > 1.0, got 1.0",
        ),
        ({"growth_factor": math.inf}, ValueError, r"growth_factor .* got inf"),
        ({"growth_factor": "2"}, TypeError, r"growth_factor must be a float, got str"),
        ({"backoff_factor": 1.0}, ValueError, r"backoff_factor must be in \(0.0, 1.0\), got 1.0"),
        ({"backoff_factor": 0.0}, ValueError, r"backoff_factor must be in \(0.0, 1.0\), got 0.0"),
        ({"growth_interval": 0}, ValueError, r"growth_interval must be >= 1, got 0"),
        ({"growth_interval": 2.0}, TypeError, r"growth_interval must be an int, got float"),
        ({"growth_interval": True}, TypeError, r"growth_interval must be an int, got bool"),
        ({"hysteresis": 0}, ValueError, r"hysteresis must be >= 1, got 0"),
        ({"min_scale": 0.0}, ValueError, r"min_scale must be a finite number > 0"),
        ({"min_scale": 1e-50}, ValueError, r"min_scale .*float32.* got 1e-50"),
        ({"min_scale": -1.0}, ValueError, r"min_scale .* got -1.0"),
        ({"max_scale": 0.5}, ValueError, r"max_scale must be >= min_scale \(1.0\) or inf, got 0.5"),
        ({"max_scale": math.nan}, ValueError, r"max_scale .* got nan"),
        ({"dynamic": 1}, TypeError, r"dynamic must be a bool, got int"),
    ],
)
def test_policy_bad_setting_raises_rule_and_value(
    changes: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ScalePolicy(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "init_scale", "error", "match"),
    [
        ({}, math.inf, ValueError, r"init_scale must be finite, got inf"),
        ({}, 0.5, ValueError, r"init_scale must be in \[min_scale, max_scale\]"),
        ({"max_scale": 2.0**16}, 2.0**20, ValueError, r"init_scale must be in"),
        ({}, "8", TypeError, r"init_scale must be a float, got str"),
    ],
)
def test_policy_initial_state_bad_scale_raises_rule_and_value(
    settings: dict[str, object], init_scale: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ScalePolicy(**settings).initial_state(init_scale)  # type: ignore[arg-type]


def _random_policy(rng: random.Random) -> tuple[float, ScalePolicy]:
    max_scale = rng.choice([math.inf, 2.0**20, 3e38])
    init_scale = min(max_scale, rng.choice([1.0, 3.0, 2.0**16, 3e38]))
    return init_scale, ScalePolicy(
        growth_factor=rng.choice([2.0, 1.5, 1.1, 3.0]),
        backoff_factor=rng.choice([0.5, 0.7, 0.3, 0.25]),
        growth_interval=rng.randint(1, 4),
        hysteresis=rng.choice([1, 1, 2, 3]),
        min_scale=rng.choice([1.0, 0.01]),
        max_scale=max_scale,
        dynamic=rng.random() > 0.1,
    )


def test_policy_update_matches_reference_bit_for_bit() -> None:
    """Both device paths (hysteresis 1: torch's kernel; else tensor maths) equal ``next``."""
    for trial in range(300):
        rng = random.Random(trial)
        init_scale, policy = _random_policy(rng)
        state = policy.initial_state(init_scale)
        scale = torch.tensor(state.scale)
        growth = torch.tensor(0, dtype=torch.int32)
        hysteresis = torch.tensor(state.hysteresis_tracker, dtype=torch.int32)
        for step in range(40):
            found_inf = rng.random() < 0.35
            state = policy.next(state, found_inf)
            policy.update_(scale, growth, hysteresis, torch.tensor(float(found_inf)))
            device = ScaleState(scale.item(), int(growth.item()), int(hysteresis.item()))
            assert device == state, f"trial {trial} step {step}: {policy}"


def test_policy_hysteresis_tolerates_then_backs_off_and_replenishes_on_growth() -> None:
    policy = ScalePolicy(growth_interval=2, hysteresis=3)
    state = policy.initial_state(64.0)
    scales = []
    for found_inf in [True, True, True, True, False, False, True]:
        state = policy.next(state, found_inf)
        scales.append(state.scale)
    # two overflows tolerated, then every overflow backs off; growth refills the allowance
    assert scales == [64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0]
    assert state.hysteresis_tracker == 2


def test_policy_floor_and_ceiling_hold() -> None:
    policy = ScalePolicy(growth_interval=1, min_scale=2.0, max_scale=16.0)
    state = policy.initial_state(4.0)
    for _ in range(5):
        state = policy.next(state, True)
    assert state.scale == 2.0
    for _ in range(10):
        state = policy.next(state, False)
    assert state.scale == 16.0


def test_policy_never_grows_to_inf() -> None:
    policy = ScalePolicy(growth_interval=1)
    assert policy.next(policy.initial_state(3e38), False).scale == pytest.approx(3e38)


def test_policy_static_never_moves() -> None:
    policy = ScalePolicy(dynamic=False, growth_interval=1)
    state = policy.initial_state(1.0)
    for found_inf in [True, False, False, True]:
        assert policy.next(state, found_inf) == state
