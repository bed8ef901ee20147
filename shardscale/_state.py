"""The scaler's checkpointable state: building, validating and reading ``state_dict``\\ s.

Invariant: a state dict is either loaded whole or not at all. ``parse_state_dict`` validates
every key and value, and the relations between them, before the scaler changes anything.

Compatibility, both ways: our state dict carries torch's five keys with torch's meanings
(``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``),
which is all ``torch.amp.GradScaler.load_state_dict`` reads; ours adds the hysteresis settings,
the floor and ceiling, ``dynamic`` and the step counters. A torch state dict has none of our keys
and loads with our current settings, a full hysteresis allowance and zeroed counters; a dict with
only some of our keys is rejected as damaged.

All values are Python numbers, identical on every rank, so ``torch.distributed.checkpoint``
stores one copy and loads it at any world size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from shardscale._policy import ScalePolicy, ScaleState

__all__ = [
    "Counters",
    "DeviceState",
    "ScalerState",
    "parse_state_dict",
    "to_state_dict",
    "unpack",
]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
OUR_KEYS = (
    "hysteresis",
    "_hysteresis_tracker",
    "min_scale",
    "max_scale",
    "dynamic",
    "steps",
    "skipped_steps",
    "consecutive_skips",
    "last_overflow_step",
)


@dataclass(frozen=True, slots=True)
class Counters:
    """How many steps the scaler has seen and skipped."""

    steps: int = 0
    """``update()`` calls that consumed a step's overflow check."""
    skipped_steps: int = 0
    """Of those, the steps skipped because some rank overflowed."""
    consecutive_skips: int = 0
    """Skipped steps since the last step taken."""
    last_overflow_step: int = 0
    """The number (1-based) of the last skipped step; 0 if none was skipped."""


@dataclass(frozen=True, slots=True)
class ScalerState:
    """Everything a state dict holds."""

    policy: ScalePolicy
    scale: ScaleState
    counters: Counters


@dataclass(frozen=True, slots=True)
class DeviceState:
    """The scale state as tensors on the loss's device, where the hot path updates it.

    Kept on the device so that ``update()`` needs no host synchronisation; read back to host
    values only for ``state_dict()`` and ``get_scale()``.
    """

    scale: torch.Tensor
    """float32 scalar."""
    growth_tracker: torch.Tensor
    """int32 scalar."""
    hysteresis_tracker: torch.Tensor
    """int32 scalar."""
    counters: torch.Tensor
    """float64 ``[steps, skipped_steps, consecutive_skips, steps_since_overflow]`` (exact to
    2**53 steps). The last slot, rather than the last overflow's step number, because it
    updates with the same multiply-add as the others."""

    @classmethod
    def create(cls, state: ScalerState, device: torch.device) -> DeviceState:
        """Tensors on ``device`` holding ``state``."""
        device_state = cls(
            scale=torch.empty((), dtype=torch.float32, device=device),
            growth_tracker=torch.empty((), dtype=torch.int32, device=device),
            hysteresis_tracker=torch.empty((), dtype=torch.int32, device=device),
            counters=torch.zeros(4, dtype=torch.float64, device=device),
        )
        device_state.write(state)
        return device_state

    def write(self, state: ScalerState) -> None:
        """Overwrite the tensors in place with ``state`` (keeping their identity)."""
        self.scale.fill_(state.scale.scale)
        self.growth_tracker.fill_(state.scale.growth_tracker)
        self.hysteresis_tracker.fill_(state.scale.hysteresis_tracker)
        counters = state.counters
        since = counters.steps - counters.last_overflow_step
        values = (counters.steps, counters.skipped_steps, counters.consecutive_skips, since)
        self.counters.copy_(torch.tensor(values, dtype=torch.float64))

    def count_step_(self, found_inf: torch.Tensor) -> None:
        """Count one step, skipped if ``found_inf`` (exactly 0.0 or 1.0), without a host sync.

        Counted on the device, not the host, so the counts stay right when step+update is
        replayed from a CUDA graph. In two kernels: with s = found_inf,
        ``rows = base + s * slope`` gives ``[[1, 1, s, 1 - s], [1, s, s, 1 - s]]``, then
        ``counters = counters * rows[0] + rows[1]``.
        """
        base, slope = _count_constants(self.counters.device)
        rows = torch.addcmul(base, found_inf, slope)
        torch.addcmul(rows[1], self.counters, rows[0], out=self.counters)

    def packed(self) -> torch.Tensor:
        """``[scale, growth_tracker, hysteresis_tracker, *counters]`` as one float64 tensor.

        One host read then gets everything (``read``, and the step reports).
        """
        return torch.cat(
            (
                self.scale.double().reshape(1),
                self.growth_tracker.double().reshape(1),
                self.hysteresis_tracker.double().reshape(1),
                self.counters,
            )
        )

    def read(self, policy: ScalePolicy) -> ScalerState:
        """The state as host values: one host read (a synchronisation on an accelerator)."""
        scale, counters = unpack(self.packed().tolist())
        return ScalerState(policy=policy, scale=scale, counters=counters)


def unpack(values: list[float]) -> tuple[ScaleState, Counters]:
    """The host values of ``DeviceState.packed()``."""
    scale, growth, hysteresis, steps, skipped, consecutive, since = values
    counters = Counters(
        steps=int(steps),
        skipped_steps=int(skipped),
        consecutive_skips=int(consecutive),
        last_overflow_step=int(steps - since) if skipped else 0,
    )
    scale_state = ScaleState(
        scale=scale, growth_tracker=int(growth), hysteresis_tracker=int(hysteresis)
    )
    return scale_state, counters


@functools.cache
def _count_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The constant rows of ``DeviceState.count_step_``, made once per device."""
    base = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1]], dtype=torch.float64, device=device)
    slope = torch.tensor([[0, 0, 1, -1], [0, 1, 1, -1]], dtype=torch.float64, device=device)
    return base, slope


def to_state_dict(state: ScalerState) -> dict[str, Any]:
    """The state as a flat dict of Python numbers, torch's keys first."""
    policy = state.policy
    return {
        "scale": state.scale.scale,
        "growth_factor": policy.growth_factor,
        "backoff_factor": policy.backoff_factor,
        "growth_interval": policy.growth_interval,
        "_growth_tracker": state.scale.growth_tracker,
        "hysteresis": policy.hysteresis,
        "_hysteresis_tracker": state.scale.hysteresis_tracker,
        "min_scale": policy.min_scale,
        "max_scale": policy.max_scale,
        "dynamic": policy.dynamic,
        "steps": state.counters.steps,
        "skipped_steps": state.counters.skipped_steps,
        "consecutive_skips": state.counters.consecutive_skips,
        "last_overflow_step": state.counters.last_overflow_step,
    }


def _number(key: str, value: object, kind: type[int] | type[float]) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"state_dict[{key!r}] must be {'an int' if kind is int else 'a float'}, "
            f"got {type(value).__name__}: {value!r}"
        )
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise TypeError(f"state_dict[{key!r}] must be an int, got {value!r}")
        return int(value)
    return float(value)


def parse_state_dict(state_dict: Mapping[str, Any], current: ScalePolicy) -> ScalerState:
    """Validate ``state_dict`` whole and return the state it describes.

    Args:
        state_dict: from ``state_dict()`` of this class or of a torch scaler.
        current: the loading scaler's policy, kept for settings a torch state dict lacks.

    Raises:
        RuntimeError: the dict is empty (saved by a disabled scaler), as torch words it.
        ValueError: keys are missing or unknown, or a value breaks a rule (named with the value).
        TypeError: a value has the wrong type.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )
    keys = set(state_dict)
    unknown = sorted(str(k) for k in keys - set(TORCH_KEYS) - set(OUR_KEYS))
    if unknown:
        raise ValueError(
            f"state_dict has unknown key(s) {unknown}; expected {list(TORCH_KEYS + OUR_KEYS)}"
        )
    missing = [k for k in TORCH_KEYS if k not in keys]
    if missing:
        raise ValueError(f"state_dict is missing required key(s) {missing}")
    ours_present = [k for k in OUR_KEYS if k in keys]
    if ours_present and len(ours_present) != len(OUR_KEYS):
        absent = [k for k in OUR_KEYS if k not in keys]
        raise ValueError(
            f"state_dict has some of shardscale's keys but not {absent}: it is damaged "
            "(a torch scaler's state dict has none of them, ours has all)"
        )

    policy_changes: dict[str, Any] = {
        key: _number(key, state_dict[key], kind)
        for key, kind in (
            ("growth_factor", float),
            ("backoff_factor", float),
            ("growth_interval", int),
        )
    }
    scale = _number("scale", state_dict["scale"], float)
    growth_tracker = _number("_growth_tracker", state_dict["_growth_tracker"], int)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"state_dict['scale'] must be finite and > 0, got {scale}")
    counters = Counters()
    hysteresis_tracker: int | None = None  # None: a torch state dict, the allowance starts full
    if ours_present:
        dynamic = state_dict["dynamic"]
        if not isinstance(dynamic, bool):
            raise TypeError(f"state_dict['dynamic'] must be a bool, got {dynamic!r}")
        policy_changes.update(
            hysteresis=_number("hysteresis", state_dict["hysteresis"], int),
            min_scale=_number("min_scale", state_dict["min_scale"], float),
            max_scale=_number("max_scale", state_dict["max_scale"], float),
            dynamic=dynamic,
        )
        hysteresis_tracker = _number("_hysteresis_tracker", state_dict["_hysteresis_tracker"], int)
        counters = Counters(
            **{
                key: _number(key, state_dict[key], int)
                for key in ("steps", "skipped_steps", "consecutive_skips", "last_overflow_step")
            }
        )
    # ScalePolicy validates the settings; the scale itself is checked by check_state below, so
    # until then init_scale holds a placeholder every valid policy accepts: its own floor.
    floor = policy_changes.get("min_scale", current.min_scale)
    policy = replace(current, init_scale=floor, **policy_changes)
    scale_state = ScaleState(
        scale=scale,
        growth_tracker=growth_tracker,
        hysteresis_tracker=policy.hysteresis if hysteresis_tracker is None else hysteresis_tracker,
    )
    policy.check_state(scale_state)
    if not 0 <= counters.consecutive_skips <= counters.skipped_steps <= counters.steps:
        raise ValueError(
            "state_dict counters must satisfy 0 <= consecutive_skips <= skipped_steps <= steps, "
            f"got consecutive_skips={counters.consecutive_skips}, "
            f"skipped_steps={counters.skipped_steps}, steps={counters.steps}"
        )
    if not (
        (counters.skipped_steps == 0 and counters.last_overflow_step == 0)
        or (counters.skipped_steps > 0 and 1 <= counters.last_overflow_step <= counters.steps)
    ):
        raise ValueError(
            "state_dict['last_overflow_step'] must be 0 when no step was skipped, else in "
            f"[1, steps]; got last_overflow_step={counters.last_overflow_step}, "
            f"skipped_steps={counters.skipped_steps}, steps={counters.steps}"
        )
    return ScalerState(
        policy=replace(policy, init_scale=scale), scale=scale_state, counters=counters
    )
