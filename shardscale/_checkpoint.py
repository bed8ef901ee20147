"""The scaler's checkpoint format: building, validating and reading `state_dict`\\ s.

Invariant: a state dict is either loaded whole or not at all. `parse_state_dict` validates
every key and value, and the relations between them, before the scaler changes anything.

Compatibility, both ways: our state dict carries torch's five keys with torch's meanings
(`scale`, `growth_factor`, `backoff_factor`, `growth_interval`, `_growth_tracker`),
which is all `torch.amp.GradScaler.load_state_dict` reads; ours adds the hysteresis settings,
the floor and ceiling, `dynamic`, the step counters and `format_version`. A torch state dict
has none of our keys and loads with our current settings, a full hysteresis allowance and zeroed
counters.

Versions: each format version has its own set of our keys, all required (a dict with only some of
them is damaged). Version 1 added `format_version` itself; a dict without it is version 0
(shardscale 0.1's), and still loads. A later version that adds a key keeps every older one
loading, with that key's default; a dict from a newer shardscale than this one is refused.

All values are Python numbers, identical on every rank, so `torch.distributed.checkpoint`
stores one copy and loads it at any world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from shardscale._policy import ScalePolicy, ScaleState

__all__ = ["FORMAT_VERSION", "Counters", "ScalerState", "parse_state_dict", "to_state_dict"]

FORMAT_VERSION = 1
"""The version `state_dict()` writes."""

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_V0_KEYS = (
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
OUR_KEYS_BY_VERSION: dict[int, tuple[str, ...]] = {0: _V0_KEYS, 1: (*_V0_KEYS, "format_version")}
"""Our keys in each format version: all of them, or none (a torch state dict)."""


@dataclass(frozen=True, slots=True)
class Counters:
    """How many steps the scaler has seen and skipped."""

    steps: int = 0
    """`update()` calls that consumed a step's overflow check."""
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
        "format_version": FORMAT_VERSION,
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
    """Validate `state_dict` whole and return the state it describes.

    Args:
        state_dict: from `state_dict()` of this class or of a torch scaler.
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
    version = _version(state_dict)
    our_keys = OUR_KEYS_BY_VERSION[version]
    known = {*TORCH_KEYS, *our_keys}
    unknown = sorted(str(k) for k in keys - known)
    if unknown:
        raise ValueError(
            f"state_dict has unknown key(s) {unknown} for format version {version}; expected "
            f"{sorted(known)}"
        )
    missing = [k for k in TORCH_KEYS if k not in keys]
    if missing:
        raise ValueError(f"state_dict is missing required key(s) {missing}")
    ours_present = [k for k in our_keys if k in keys]
    if ours_present and len(ours_present) != len(our_keys):
        absent = [k for k in our_keys if k not in keys]
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
    policy = replace(current, **policy_changes)  # ScalePolicy validates the settings
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
    return ScalerState(policy=policy, scale=scale_state, counters=counters)


def _version(state_dict: Mapping[str, Any]) -> int:
    """The format version of `state_dict`: its `format_version`, 0 without one."""
    if "format_version" not in state_dict:
        return 0
    version: int = _number("format_version", state_dict["format_version"], int)
    if version not in OUR_KEYS_BY_VERSION:
        raise ValueError(
            f"state_dict['format_version'] must be one of {sorted(OUR_KEYS_BY_VERSION)}, got "
            f"{version}: a newer shardscale saved it"
        )
    return version
