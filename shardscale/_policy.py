"""The dynamic loss-scale policy: how the scale moves after each step.

The policy needs no process group: it maps (state, found_inf) to the next state. Here it is
defined, as plain Python ([`ScalePolicy.next()`][ScalePolicy.next], the reference the tests hold
the device maths to), with its settings and their rules; the scaler moves its device state by
it as tensor maths, no host sync, no collective: the interval rule where that state lives
(`shardscale._state.move_scale_`), the fit beside its reading (`shardscale._bins.fit_`). Because
every rank feeds it the same agreed flags, every rank computes the same next scale.

The interval rule, `scale_policy="interval"` (the default), per `update()`: Megatron-core's
`DynamicGradScaler` (plus torch's guard against growing to inf, and a ceiling), and torch's when
`hysteresis == 1` and the scale stays within `[min_scale, max_scale]`; DeepSpeed's up to 0.17.0
(from 0.17.1 it grows one clean step later):

```python
if forward_overflow:                              # the loss itself was inf/NaN on some rank:
    pass                                          # no scale fixes that, so nothing moves
elif found_inf:
    growth_tracker = 0
    if hysteresis_tracker > 1:                    # an overflow still tolerated
        hysteresis_tracker -= 1
    else:
        scale = max(scale * backoff_factor, min_scale)
else:
    growth_tracker += 1
    if growth_tracker == growth_interval:
        growth_tracker = 0
        hysteresis_tracker = hysteresis           # replenished on growth
        if isfinite(scale * growth_factor):       # torch's guard: never grow to inf
            scale = min(scale * growth_factor, max_scale)
```

The fit, `scale_policy="fit"`, in its place (a forward overflow moves nothing here either):

```python
# seen: the step's largest |scaled gradient| (every rank's, agreed) / scale, as the power of two
# above it; the window: the last 16 steps, newest first
window = [0 if found_inf else seen] + window[:-1]
if found_inf:
    if max(old window) > 0:                        # the window said this scale was safe:
        margin = min(margin + 1, FIT_MAX_MARGIN)   # learn: the backward needs more room
    if hysteresis_tracker > 1:
        hysteresis_tracker -= 1
    else:                                          # 1, 2, 4, 8, then 16 halvings at a time
        scale = max(scale * backoff_factor ** 2**streak, min_scale)
    streak = min(streak + 1, FIT_MAX_STREAK)       # FIT_MAX_STREAK = 4
else:
    streak, hysteresis_tracker = 0, hysteresis
    if max(window) > 0:
        scale = clamp(2**(16 - margin) / max(window), min_scale, max_scale)
```

The recent gradients, scaled, then stay below `2**(16 - margin)`; `2**16` is just above fp16's
largest value (65504). The margin starts at 1 (a bit below the largest scale the gradients it
reads allow) and is learned: the weights' gradients are the last tensors of the backward, and
the activations' gradients before them may overflow first. An overflow that reaches the
gradients as NaN (an inf in the backward, then inf - inf in the next matmul: what fp16 usually
shows) teaches as an inf does; a bug is told from an overflow by persistence, not by NaN: a
gradient still non-finite at the floor is the scaler's alarm (`max_overflows_at_floor`). The
margin never shrinks by itself: a probe would cost the skipped step the policy is there to avoid.
Consecutive overflows back off faster and faster (a start far too high is left in a few
skipped steps, not one per halving):
overshooting costs nothing, because the next clean step sets the scale from the gradients. The
jump is capped at 16 halvings, so that an overshoot leaves the largest gradients far above
fp16's smallest values, for the fit to read them.

The floor, `min_scale`, defaults to fp16's smallest subnormal, 2**-24: the scale goes below 1
where the gradients need it (a loss summed over tokens), as torch's does, but never collapses to
0, as torch's does under a persistent NaN. What happens to gradients that stay non-finite there
is the scaler's business, not the policy's (`max_overflows_at_floor`).

The scale is float32; each product is taken in float64 and rounded once, as torch's
`_amp_update_scale_` does, so both agree bit for bit. With `dynamic=False` nothing changes.

Examples:
    >>> policy = ScalePolicy(growth_interval=2)
    >>> state = policy.initial_state(8.0)
    >>> for found_inf in (False, False, True):
    ...     state = policy.next(state, found_inf)
    >>> state.scale
    8.0
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field, replace

import torch


def _f32(value: float) -> float:
    """Round a Python float to float32, as the device's scale tensor does."""
    return array("f", [value])[0]


def check_real(name: str, value: object) -> float:
    """`value` as a float; TypeError (the rule, then the value) unless it is a real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}: {value!r}")
    return float(value)


def check_int(
    name: str, value: object, minimum: int | None = None, *, note: str = "", optional: bool = False
) -> int:
    """`value` itself; TypeError unless it is an int (not a bool), ValueError below `minimum`
    (`note`: what a value at the edge means, for the message; `optional`: the setting may also
    be None, which the caller takes before asking)."""
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}: {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{f' ({note})' if note else ''}, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    """`value` itself; TypeError unless it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")
    return value


# The default floor: fp16's smallest subnormal. A scale below it would flush a loss of 1 to 0.
MIN_SCALE = 2.0**-24

# Steps whose gradients the fitted scale keeps in view.
FIT_WINDOW = 16
# Bits kept below fp16's range at first (`fit`); one more per overflow the window allowed.
FIT_MARGIN = 1
FIT_MAX_MARGIN = 8
# Consecutive overflows the fit's backoff counts: the next backs off `2**streak` times, 16 at most.
FIT_MAX_STREAK = 4
# A forward overflow holds the growth tracker this far below zero while torch's update kernel
# counts a clean step, where one more cannot reach the interval (a tracker is < 2**30).
HOLD = 2**30


# `scale_policy`'s values: torch's growth after an interval, or the scale that fits.
SCALE_POLICIES = ("interval", "fit")


def check_choice(name: str, value: object, choices: tuple[str, ...] = SCALE_POLICIES) -> str:
    """`value` itself; ValueError unless it is one of `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ScaleState:
    """The policy's state between two steps, as host values."""

    scale: float
    """The current loss scale S."""
    growth_tracker: int
    """Consecutive clean steps since the last growth or overflow."""
    hysteresis_tracker: int
    """Overflows still tolerated before the scale backs off."""
    margin: int = FIT_MARGIN
    """`fit`: the bits kept below fp16's largest value, learned from overflows."""
    window: tuple[float, ...] = (0.0,) * FIT_WINDOW
    """`fit`: the recent steps' largest unscaled gradient magnitudes (powers of two above
    them, the newest first; 0: no clean step seen there)."""
    streak: int = 0
    """`fit`: consecutive gradient overflows (at most `FIT_MAX_STREAK`); the next one backs off
    `2**streak` times at once."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalePolicy:
    """Validated settings of the dynamic loss scale.

    Raises:
        TypeError: a setting has the wrong type.
        ValueError: a setting is out of range; the message states the rule and the value.
    """

    growth_factor: float = 2.0
    """Multiplies the scale after `growth_interval` clean steps. Must be > 1."""
    backoff_factor: float = 0.5
    """Multiplies the scale when the tolerated overflows are used up. Must be in (0, 1)."""
    growth_interval: int = 2000
    """Consecutive clean steps before the scale grows. Must be >= 1."""
    hysteresis: int = 1
    """Overflows tolerated before backing off, replenished on growth (1: back off at once)."""
    min_scale: float = MIN_SCALE
    """The floor: the scale never backs off below it, so it can never reach 0. Must be > 0."""
    max_scale: float = field(default=math.inf)
    """The ceiling: growth stops here. `inf` means no ceiling."""
    dynamic: bool = True
    """False: the scale never changes (the bf16 guard); non-finite steps are still skipped."""
    fit: bool = False
    """True: a clean step's scale fits the recent gradients (module docstring), not the interval."""

    def __post_init__(self) -> None:
        growth_factor = check_real("growth_factor", self.growth_factor)
        backoff_factor = check_real("backoff_factor", self.backoff_factor)
        check_int("growth_interval", self.growth_interval, minimum=1)
        check_int("hysteresis", self.hysteresis, minimum=1)
        min_scale = check_real("min_scale", self.min_scale)
        max_scale = check_real("max_scale", self.max_scale)
        check_bool("dynamic", self.dynamic)
        if check_bool("fit", self.fit) and not self.dynamic:
            raise ValueError("scale_policy='fit' moves the scale: it needs dynamic=True")
        if not (math.isfinite(growth_factor) and growth_factor > 1.0):
            raise ValueError(f"growth_factor must be a finite number > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0.0, 1.0), got {backoff_factor}")
        if not (math.isfinite(min_scale) and _f32(min_scale) > 0.0):
            raise ValueError(
                f"min_scale must be a finite number > 0 (representable in float32), got {min_scale}"
            )
        if math.isnan(max_scale) or max_scale < min_scale:
            raise ValueError(
                f"max_scale must be >= min_scale ({min_scale}) or inf, got {max_scale}"
            )

    def check_scale(self, name: str, scale: float) -> None:
        """Raise ValueError unless `scale` is a value this policy can hold."""
        if not math.isfinite(scale):
            raise ValueError(f"{name} must be finite, got {scale}")
        if not self.min_scale <= scale <= self.max_scale:
            raise ValueError(
                f"{name} must be in [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}], "
                f"got {scale} (pass a lower min_scale or a higher max_scale to allow it)"
            )

    def new_scale_tensor(self, new_scale: float | torch.Tensor) -> torch.Tensor:
        """`update(new_scale=...)`'s value as a float32 scalar tensor, checked where it is free.

        A float must be a scale this policy can hold; a tensor is taken as given (checking its
        value would cost a host synchronisation), but must be one element without grad.

        Raises:
            ValueError, TypeError: the value breaks that rule; the message gives it.
        """
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError(
                    "new_scale must be a float or a one-element tensor with requires_grad=False, "
                    f"got shape {tuple(new_scale.shape)}, requires_grad={new_scale.requires_grad}"
                )
            return new_scale.detach().reshape(())
        if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
            raise TypeError(
                f"new_scale must be a float or a tensor, got {type(new_scale).__name__}"
            )
        self.check_scale("new_scale", float(new_scale))
        return torch.tensor(float(new_scale), dtype=torch.float32)

    def check_state(self, state: ScaleState) -> None:
        """Raise ValueError unless `state` is reachable under this policy."""
        self.check_scale("scale", state.scale)
        if not 0 <= state.growth_tracker < HOLD:  # at or past the interval: no growth, as torch
            raise ValueError(
                f"_growth_tracker must be in [0, 2**30), got {state.growth_tracker} (at or past "
                "growth_interval it counts on without growing until an overflow, as torch's)"
            )
        if not 1 <= state.hysteresis_tracker <= self.hysteresis:
            raise ValueError(
                f"_hysteresis_tracker must be in [1, hysteresis] = [1, {self.hysteresis}], "
                f"got {state.hysteresis_tracker}"
            )
        if not 0 <= state.margin <= FIT_MAX_MARGIN:
            raise ValueError(f"_fit_margin must be in [0, {FIT_MAX_MARGIN}], got {state.margin}")
        if not 0 <= state.streak <= FIT_MAX_STREAK:
            raise ValueError(f"_fit_streak must be in [0, {FIT_MAX_STREAK}], got {state.streak}")
        if len(state.window) != FIT_WINDOW or not all(0 <= v < math.inf for v in state.window):
            raise ValueError(
                f"_fit_window must be {FIT_WINDOW} finite numbers >= 0, got {list(state.window)}"
            )

    def initial_state(self, init_scale: float) -> ScaleState:
        """The state before the first step, at scale `init_scale` (as given: rounded to float32
        when a device holds it).

        Raises:
            TypeError, ValueError: `init_scale` is not a finite number in
                `[min_scale, max_scale]`.
        """
        scale = check_real("init_scale", init_scale)
        self.check_scale("init_scale", scale)
        # as given: torch's get_scale() and state_dict() answer it so until a device holds it
        return ScaleState(scale=scale, growth_tracker=0, hysteresis_tracker=self.hysteresis)

    def next(
        self,
        state: ScaleState,
        found_inf: bool,
        forward: bool = False,
        seen: float = 0.0,
    ) -> ScaleState:
        """Return the state after one step; the definition of both rules (see the module), the
        reference the device maths (`shardscale._state.move_scale_`,
        `shardscale._bins.fit_`) is tested against.

        Args:
            found_inf: the gradients overflowed on some rank.
            forward: the loss itself was non-finite on some rank (a forward overflow), so the
                step was skipped and nothing moves, whatever `found_inf` says.
            seen: the fit's bound of the step's largest unscaled gradient: the power of two just
                above it (0: no non-zero gradient). Ignored by the interval rule.
        """
        state = replace(state, scale=_f32(state.scale))  # as the device holds it
        if not self.dynamic or forward:
            return state
        if self.fit:
            return self._next_fit(state, found_inf, seen)
        scale, growth, hysteresis = state.scale, state.growth_tracker, state.hysteresis_tracker
        if found_inf:
            growth = 0
            if hysteresis > 1:
                hysteresis -= 1
            else:
                scale = max(_f32(scale * self.backoff_factor), _f32(self.min_scale))
        else:
            growth += 1
            if growth == self.growth_interval:
                growth = 0
                hysteresis = self.hysteresis
                grown = _f32(scale * self.growth_factor)
                if math.isfinite(grown):
                    scale = min(grown, _f32(self.max_scale))
        return replace(state, scale=scale, growth_tracker=growth, hysteresis_tracker=hysteresis)

    def _next_fit(self, state: ScaleState, found_inf: bool, seen: float) -> ScaleState:
        """`next()` under the fit (the module's second rule)."""
        window = (0.0 if found_inf else seen, *state.window[:-1])
        if not found_inf:
            widest, scale = max(window), state.scale
            if widest > 0:
                fitted = _f32(2.0 ** (16 - state.margin) / widest)
                scale = min(max(fitted, _f32(self.min_scale)), _f32(self.max_scale))
            return replace(
                state, scale=scale, hysteresis_tracker=self.hysteresis, window=window, streak=0
            )
        margin = min(state.margin + (max(state.window) > 0), FIT_MAX_MARGIN)
        scale, hysteresis = state.scale, state.hysteresis_tracker
        if hysteresis > 1:
            hysteresis -= 1
        else:
            backed = _f32(scale * self.backoff_factor**2**state.streak)
            scale = max(backed, _f32(self.min_scale))
        streak = min(state.streak + 1, FIT_MAX_STREAK)
        return replace(
            state,
            scale=scale,
            hysteresis_tracker=hysteresis,
            margin=margin,
            window=window,
            streak=streak,
        )
