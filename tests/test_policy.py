"""The scale policy: validation, and the device maths against the plain-Python definition."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shardscale import ScalePolicy, ScaleState
from shardscale._bins import fit_
from shardscale._policy import FIT_MAX_STREAK, FIT_WINDOW, MIN_SCALE
from shardscale._state import move_scale_


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
        (
            {"max_scale": 1e-9},
            ValueError,
            r"max_scale must be >= min_scale \(5.96046\d*e-08\) or inf, got 1e-09",
        ),
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
        ({}, 1e-9, ValueError, r"init_scale must be in \[min_scale, max_scale\]"),
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


def _on_device(state: ScaleState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The interval rule's device tensors for `state`: scale, growth and hysteresis trackers."""
    scale = torch.tensor(state.scale)
    growth = torch.tensor(state.growth_tracker, dtype=torch.int32)
    return scale, growth, torch.tensor(state.hysteresis_tracker, dtype=torch.int32)


def _read(scale: torch.Tensor, growth: torch.Tensor, hysteresis: torch.Tensor) -> ScaleState:
    return ScaleState(scale.item(), int(growth.item()), int(hysteresis.item()))


def test_policy_update_matches_reference_bit_for_bit() -> None:
    """Both device paths (hysteresis 1: torch's kernel; else tensor maths) equal ``next``."""
    for trial in range(300):
        rng = random.Random(trial)
        init_scale, policy = _random_policy(rng)
        state = policy.initial_state(init_scale)
        scale, growth, hysteresis = _on_device(state)
        for step in range(40):
            found_inf = rng.random() < 0.35
            state = policy.next(state, found_inf)
            move_scale_(policy, scale, growth, hysteresis, torch.tensor(float(found_inf)))
            assert _read(scale, growth, hysteresis) == state, f"trial {trial} step {step}: {policy}"


def test_policy_forward_overflow_holds_everything_under_hysteresis_bit_for_bit() -> None:
    """A forward overflow (the loss itself non-finite) moves nothing, with a hysteresis
    allowance to keep and a growth tracker torch's kernel would count: the device maths (the
    gradient-overflow flag without it, the forward flag beside) against `next`."""
    for trial in range(200):
        rng = random.Random(1000 + trial)
        init_scale, policy = _random_policy(rng)
        state = policy.initial_state(init_scale)
        scale, growth, hysteresis = _on_device(state)
        for step in range(40):
            found_inf = rng.random() < 0.35
            forward = found_inf and rng.random() < 0.4
            state = policy.next(state, found_inf, forward)
            gradients = torch.tensor(float(found_inf and not forward))
            move_scale_(policy, scale, growth, hysteresis, gradients, torch.tensor(float(forward)))
            assert _read(scale, growth, hysteresis) == state, f"trial {trial} step {step}: {policy}"


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


def test_policy_default_floor_is_fp16s_smallest_subnormal_and_holds() -> None:
    """Below 1 where the gradients need it, as torch's scale goes; never to 0, as torch's does
    under a persistent NaN (it halves to 0.0 in ~166 steps)."""
    policy = ScalePolicy()
    assert policy.min_scale == MIN_SCALE == 2.0**-24
    state = policy.initial_state(2.0**16)
    scales = []
    for _ in range(60):
        state = policy.next(state, True)
        scales.append(state.scale)
    assert scales[25] == 2.0**-10  # one halving per overflow, as torch's
    assert scales[39:] == [2.0**-24] * 21  # the floor, reached after 40, holds


def test_policy_interval_rule_keeps_the_fits_state() -> None:
    """`next()` under the interval rule moves only what that rule moves."""
    state = ScaleState(1024.0, 0, 1, margin=3, window=(2.0**-5,) * FIT_WINDOW, streak=2)
    after = ScalePolicy().next(state, False)
    assert (after.margin, after.window, after.streak) == (3, state.window, 2)


def _fit_case(rng: random.Random) -> tuple[float, ScalePolicy]:
    max_scale = rng.choice([math.inf, 2.0**20])
    init_scale = min(max_scale, rng.choice([1.0, 2.0**16, 2.0**32]))
    return init_scale, ScalePolicy(
        backoff_factor=rng.choice([0.5, 0.7, 0.25]),
        hysteresis=rng.choice([1, 1, 2]),
        min_scale=rng.choice([MIN_SCALE, 1.0, 2.0**-4]),
        max_scale=max_scale,
        fit=True,
    )


def test_policy_fit_update_matches_reference_bit_for_bit() -> None:
    """The fit's device maths (`fit_`) equals its definition (`next`), forward overflows,
    hysteresis, the floor and the ceiling included; an overflow step's `seen` is anything (inf
    where the fit read one, or a NaN, which counts as one)."""
    for trial in range(200):
        rng = random.Random(trial)
        init_scale, policy = _fit_case(rng)
        state = policy.initial_state(init_scale)
        scale = torch.tensor(state.scale)
        hysteresis = torch.tensor(state.hysteresis_tracker, dtype=torch.int32)
        fit = torch.tensor([float(state.margin), 0.0, *state.window])
        for step in range(40):
            found_inf = rng.random() < 0.4
            forward = found_inf and rng.random() < 0.2
            seen = 0.0 if rng.random() < 0.1 else 2.0 ** rng.randint(-30, 10)
            seen = math.inf if found_inf and rng.random() < 0.3 else seen
            state = policy.next(state, found_inf, forward, 0.0 if found_inf else seen)
            flags = torch.tensor([float(found_inf), float(forward)])
            fit_(policy, scale, hysteresis, fit, flags, torch.tensor(seen))
            margin, streak, *window = fit.tolist()
            device = ScaleState(
                scale.item(), 0, int(hysteresis.item()), int(margin), tuple(window), int(streak)
            )
            assert device == state, f"trial {trial} step {step}: {policy}"


def test_policy_fit_backs_off_faster_while_overflows_last() -> None:
    """1, 2, 4, 8, then 16 halvings at a time; a clean step fits the scale and ends the streak."""
    policy = ScalePolicy(fit=True)
    state = policy.initial_state(2.0**32)
    exponents = []
    for _ in range(6):
        state = policy.next(state, True)
        exponents.append(math.log2(state.scale))
    assert exponents == [31, 29, 25, 17, 1, -15]
    assert state.streak == FIT_MAX_STREAK
    state = policy.next(state, False, seen=2.0**-2)
    assert (state.scale, state.streak) == (2.0**17, 0)  # 2**(16 - 1) / the bound, in one step
