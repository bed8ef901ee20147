"""The scaler's checkpoint format: its state dict and its versions, loaded whole or not at all.

Invariant: a state dict is loaded whole or not at all (`parse_state_dict` validates every key,
value and relation before anything changes).

Checkpoints load both ways with torch's scalers: our state dict carries torch's five keys with
torch's meanings (`scale`, `growth_factor`, `backoff_factor`, `growth_interval`,
`_growth_tracker`), which is all `torch.amp.GradScaler.load_state_dict` reads; ours adds the
hysteresis settings, the floor and ceiling, `dynamic`, the step counters and the streaks the
alarms count (`floor_streak`, `loss_streak`), `format_version` and the scale policy with its
learned state (`scale_policy`, `_fit_margin`, `_fit_window`, `_fit_streak`). Every count that
decides an error or an alarm is here, so a run resumed mid-streak raises at the step the
uninterrupted one would. A torch state dict has none of our keys and loads with our current
settings, a full hysteresis allowance and zeroed counters. Each format version has its own set
of our keys, all required (a dict with only some of them is damaged): version 0 (no
`format_version`) and 1 lack the forward-overflow and retry counters of version 2, which then
start at 0; versions 0 to 2 lack the policy's keys of version 3 (the loading scaler keeps its
own policy, and the fit's margin and window start afresh); version 3 lacks the fit's overflow
streak of version 4 (it starts at 0); versions 0 to 4 lack the alarms' streaks of version 5
(they start at 0: a streak under way counts again from the load); a dict from a newer
shardscale is refused. All values are Python numbers (the policy's name a string, the window a
list of them), identical on every rank, so `torch.distributed.checkpoint` stores one copy and
loads it at any world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import torch

from shardscale._policy import (
    SCALE_POLICIES,
    ScalePolicy,
    ScaleState,
    check_bool,
    check_choice,
    check_int,
    check_real,
)
from shardscale._state import Counters, ScalerState

# The version `state_dict()` writes.
FORMAT_VERSION = 5

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_POLICY_KEYS = ("hysteresis", "_hysteresis_tracker", "min_scale", "max_scale", "dynamic")
_V0_KEYS = (*_POLICY_KEYS, "steps", "skipped_steps", "consecutive_skips", "last_overflow_step")
_V1_KEYS = (*_V0_KEYS, "format_version")
_V2_KEYS = (*_V1_KEYS, "forward_overflows", "retries")
_V3_KEYS = (*_V2_KEYS, "scale_policy", "_fit_margin", "_fit_window")
_V4_KEYS = (*_V3_KEYS, "_fit_streak")
_V5_KEYS = (*_V4_KEYS, "floor_streak", "loss_streak")
# Our keys in each format version: all of them, or none (a torch state dict).
OUR_KEYS_BY_VERSION = dict(enumerate((_V0_KEYS, _V1_KEYS, _V2_KEYS, _V3_KEYS, _V4_KEYS, _V5_KEYS)))


def to_state_dict(state: ScalerState) -> dict[str, Any]:
    """The state as a flat dict of Python numbers, torch's keys first."""
    policy = state.policy
    return {
        "scale": state.scale.scale,
        **{k: getattr(policy, k) for k in ("growth_factor", "backoff_factor", "growth_interval")},
        "_growth_tracker": state.scale.growth_tracker,
        "hysteresis": policy.hysteresis,
        "_hysteresis_tracker": state.scale.hysteresis_tracker,
        **{k: getattr(policy, k) for k in ("min_scale", "max_scale", "dynamic")},
        **{f.name: getattr(state.counters, f.name) for f in fields(Counters)},
        "format_version": FORMAT_VERSION,
        "scale_policy": SCALE_POLICIES[policy.fit],
        "_fit_margin": state.scale.margin,
        "_fit_window": list(state.scale.window),
        "_fit_streak": state.scale.streak,
    }


def state_numbers(state: ScalerState) -> dict[str, float]:
    """The state dict as one number per name, to compare across ranks (`verify_agreement`):
    the fit's window entry by entry, the policy's name as 1.0 for the fit."""
    fields = to_state_dict(state)
    window = {f"_fit_window[{i}]": v for i, v in enumerate(fields.pop("_fit_window"))}
    fields["scale_policy"] = fields["scale_policy"] == "fit"
    return {name: float(value) for name, value in (fields | window).items()}


def _number(state_dict: Mapping[str, Any], key: str, kind: type[int] | type[float]) -> Any:
    """`state_dict[key]` as an int or a float (a one-element tensor, an integral float taken)."""
    value = state_dict[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    return (check_int if kind is int else check_real)(f"state_dict[{key!r}]", value)


def parse_state_dict(
    state_dict: Mapping[str, Any], current: ScalePolicy, passed: frozenset[str] = frozenset()
) -> tuple[ScalerState, str | None]:
    """Validate `state_dict` whole and return the state it describes, under the settings that
    win, with a line for each setting the checkpoint and the loading scaler disagree on.

    Which wins: torch's settings (`growth_factor`, `backoff_factor`, `growth_interval`) are
    the checkpoint's, as torch's scalers load them: code written for them builds a scaler with
    placeholder settings and counts on the load to overwrite them (torch's own
    `test_grad_scaling_state_dict`, run against ours in `tests/test_torch_suite.py`). Of
    shardscale's (`hysteresis`, `min_scale`, `max_scale`, `dynamic`, `scale_policy`), one passed
    to the loading scaler's constructor (`passed`, its default's value included) stays its own,
    so that a run resumed to change a setting, or to go back to a default, gets what it asked
    for; one not passed is the checkpoint's, so that a scaler built with defaults (as Lightning
    and the HF Trainer build theirs) resumes as it was saved. The state (the scale, the
    trackers, the counters, the fit's learned state) is the checkpoint's, brought within the
    settings that won ([`_within`][_within]).

    Args:
        state_dict: from `state_dict()` of this class or of a torch scaler.
        current: the loading scaler's policy.
        passed: the policy attributes of the settings its constructor was given
            (`ScalerConfig.passed_policy`); torch's among them are not kept.

    Returns:
        The state, and a warning's message naming each setting that differed, both values and
        which won (None: none did).

    Raises:
        RuntimeError: the dict is empty (saved by a disabled scaler), as torch words it.
        ValueError: keys are missing or unknown, or a value breaks a rule (named with the value):
            the checkpoint is checked whole, under its own settings; or the settings that win
            break a rule together (named with where each came from).
        TypeError: a value has the wrong type.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )
    version = _version(state_dict)
    state_dict = _as_saved(state_dict, version)
    ours = _check_keys(state_dict, version)
    policy_changes, fit_state, hysteresis_tracker = _settings(state_dict, version, ours)
    scale = _number(state_dict, "scale", float)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"state_dict['scale'] must be finite and > 0, got {scale}")
    saved = replace(current, **policy_changes)  # ScalePolicy validates the settings
    tracker = saved.hysteresis if hysteresis_tracker is None else hysteresis_tracker
    growth_tracker = _number(state_dict, "_growth_tracker", int)
    scale_state = ScaleState(scale, growth_tracker, tracker, **fit_state)
    saved.check_state(scale_state)  # whole, as it was saved
    passed = passed - set(_TORCH_SETTINGS)  # torch's: the checkpoint's, as torch loads them
    kept, forced = _winners(current, saved, passed)
    state = _within(ScalerState(kept, scale_state, _counters(state_dict)))
    message = _differences(current, saved, kept, passed, forced)
    if message is not None and state.scale.scale != scale:
        message += f" The checkpoint's scale {scale:g} becomes {state.scale.scale:g}, within them."
    return state, message


# The settings a checkpoint may disagree with the loading scaler on, by the policy's attribute
# and the state-dict key: torch's (the checkpoint's win), then shardscale's.
_TORCH_SETTINGS = ("growth_factor", "backoff_factor", "growth_interval")
_SETTINGS = {k: k for k in (*_TORCH_SETTINGS, "hysteresis", "min_scale", "max_scale", "dynamic")}
_SETTINGS["fit"] = "scale_policy"


def _winners(
    current: ScalePolicy, saved: ScalePolicy, passed: frozenset[str]
) -> tuple[ScalePolicy, dict[str, str]]:
    """The settings that win: each one kept (`passed`), the loading scaler's; each other, the
    checkpoint's; and why a setting was decided by another one passed.

    The fit needs a moving scale. Where one of `dynamic` and `scale_policy` was passed and the
    checkpoint's other would pair the fit with a fixed scale, the one passed decides: a scale
    the user fixed (`dynamic=False`) is not fitted, and a fit the user asked for moves the
    scale. (Both passed cannot pair them: the constructor refuses that.)

    Raises:
        ValueError: `max_scale` is below `min_scale`, one passed and the other the checkpoint's.
    """
    won = {f.name: getattr(current if f.name in passed else saved, f.name) for f in fields(current)}
    forced = {}
    if won["fit"] and not won["dynamic"]:
        if "dynamic" in passed:
            won["fit"] = False
            forced["fit"] = "dynamic=False was passed, and the fit moves the scale"
        else:
            won["dynamic"] = True
            forced["dynamic"] = "scale_policy='fit' was passed, and it moves the scale"
    if won["max_scale"] < won["min_scale"]:
        origin = {n: "passed" if n in passed else "the checkpoint's" for n in _SETTINGS}
        raise ValueError(
            f"max_scale must be >= min_scale, got max_scale={won['max_scale']} "
            f"({origin['max_scale']}) and min_scale={won['min_scale']} ({origin['min_scale']}): "
            "load_state_dict() keeps a setting passed to this scaler and takes the checkpoint's "
            "for one not passed; pass both"
        )
    return replace(current, **won), forced


def _within(state: ScalerState) -> ScalerState:
    """`state` brought within its policy's settings: the scale clamped to `[min_scale,
    max_scale]`, the hysteresis allowance to `hysteresis`; where the policy does not fit, the
    fit's state afresh: it reads the gradients of the steps before the checkpoint, which a fit
    switched back on later would take for today's; and where the scale is left above a dynamic
    policy's floor (a lower `min_scale` passed, a fixed scale made dynamic), no floor streak:
    it counted overflows at a floor the scale has left, as the device's update would end it."""
    policy, scale = state.policy, state.scale
    if not policy.fit:  # the fit's fields at ScaleState's own start
        scale = ScaleState(scale.scale, scale.growth_tracker, scale.hysteresis_tracker)
    scale = replace(
        scale,
        scale=min(max(scale.scale, policy.min_scale), policy.max_scale),
        hysteresis_tracker=min(scale.hysteresis_tracker, policy.hysteresis),
    )
    counters = state.counters
    # compared as the device compares them: its float32 scale with the floor
    if policy.dynamic and bool(torch.tensor(scale.scale, dtype=torch.float32) > policy.min_scale):
        counters = replace(counters, floor_streak=0)
    return ScalerState(policy, scale, counters)


def _differences(
    current: ScalePolicy,
    saved: ScalePolicy,
    kept: ScalePolicy,
    passed: frozenset[str],
    forced: dict[str, str],
) -> str | None:
    """`load_state_dict`'s warning, where the loading scaler's settings and the checkpoint's
    disagree: each setting, both values, which won and why (None: they agree)."""
    lines = []
    for name, key in _SETTINGS.items():
        mine, theirs, won = (getattr(policy, name) for policy in (current, saved, kept))
        if name == "fit":
            mine, theirs, won = SCALE_POLICIES[mine], SCALE_POLICIES[theirs], SCALE_POLICIES[won]
        if mine == theirs:
            continue
        if name in forced:
            line = f"{key}={won!r} over the checkpoint's {theirs!r}: {forced[name]}"
        elif name in passed:
            line = f"this scaler's {key}={mine!r} (passed) is kept over the checkpoint's {theirs!r}"
        else:
            why = "torch's setting" if name in _TORCH_SETTINGS else "not passed"
            line = f"the checkpoint's {key}={theirs!r} replaces this scaler's {mine!r} ({why})"
        if name == "fit" and saved.fit and not kept.fit:
            line += " (the checkpoint's fit state, its margin and window, is dropped)"
        lines.append(line)
    if not lines:
        return None
    return (
        "load_state_dict(): the checkpoint's settings differ from this scaler's: "
        + "; ".join(lines)
        + ". torch's settings are the checkpoint's, as torch's scalers load them (set them "
        "after loading to change them); shardscale's passed to this scaler's constructor are "
        "kept, their default's value included, and those not passed are the checkpoint's "
        "(docs/checkpoints.md)."
    )


def _version(state_dict: Mapping[str, Any]) -> int:
    """The dict's format version: its `format_version`, 0 without one.

    Raises:
        ValueError: a version newer than this shardscale knows.
    """
    version = _number(state_dict, "format_version", int) if "format_version" in state_dict else 0
    if version not in OUR_KEYS_BY_VERSION:
        raise ValueError(
            f"state_dict['format_version'] must be one of {sorted(OUR_KEYS_BY_VERSION)}, got "
            f"{version}: a newer shardscale saved it"
        )
    return int(version)


def _as_saved(state_dict: Mapping[str, Any], version: int) -> Mapping[str, Any]:
    """The dict without the keys that formats after its own added, where it names its format:
    `torch.distributed.checkpoint` with `allow_partial_load=True` fills them in, for an older
    checkpoint, with the loading scaler's own values, which say nothing of the run that saved
    it. They start as that format's load starts them. (Without a `format_version`, a later
    format's keys are refused: `_check_keys`.)"""
    if version == 0:
        return state_dict
    later = set(OUR_KEYS_BY_VERSION[FORMAT_VERSION]) - set(OUR_KEYS_BY_VERSION[version])
    return {key: value for key, value in state_dict.items() if key not in later}


def _check_keys(state_dict: Mapping[str, Any], version: int) -> bool:
    """Whether the dict holds our keys (else it is a torch scaler's): all of its version's.

    Raises:
        ValueError: an unknown key (a newer format's, without its version, said so), a missing
            torch key, or some but not all of our keys.
    """
    keys, our_keys = set(state_dict), OUR_KEYS_BY_VERSION[version]
    known = {*TORCH_KEYS, *our_keys}
    unknown = sorted(str(k) for k in keys - known)
    newer = [v for v, ks in OUR_KEYS_BY_VERSION.items() if v and not set(unknown) - set(ks)]
    if unknown and version == 0 and newer:  # a newer format's keys, without its version
        raise ValueError(
            f"state_dict has format version {min(newer)}'s key(s) {unknown} but no "
            "'format_version': add the version it was saved with, or remove those keys"
        )
    if unknown:
        raise ValueError(
            f"state_dict has unknown key(s) {unknown} for format version {version}; expected "
            f"{sorted(known)}"
        )
    missing = [k for k in TORCH_KEYS if k not in keys]
    if missing:
        raise ValueError(f"state_dict is missing required key(s) {missing}")
    absent = [k for k in our_keys if k not in keys]
    if absent and len(absent) < len(our_keys):
        raise ValueError(
            f"state_dict has some of shardscale's keys but not {absent}: it is damaged "
            "(a torch scaler's state dict has none of them, ours has all)"
        )
    return not absent


def _settings(
    state_dict: Mapping[str, Any], version: int, ours: bool
) -> tuple[dict[str, Any], dict[str, Any], int | None]:
    """The policy's settings the dict changes, the fit's state it holds (an older format's:
    none, they start afresh), and its hysteresis tracker (None: a torch state dict, whose
    allowance starts full)."""
    kinds = {"growth_factor": float, "backoff_factor": float, "growth_interval": int}
    policy_changes: dict[str, Any] = {k: _number(state_dict, k, kind) for k, kind in kinds.items()}
    fit_state: dict[str, Any] = {}
    if not ours:
        return policy_changes, fit_state, None
    kinds = {"hysteresis": int, "min_scale": float, "max_scale": float}
    policy_changes.update({k: _number(state_dict, k, kind) for k, kind in kinds.items()})
    policy_changes["dynamic"] = check_bool("state_dict['dynamic']", state_dict["dynamic"])
    if version >= 3:
        name = check_choice("state_dict['scale_policy']", state_dict["scale_policy"])
        policy_changes["fit"] = name == "fit"
        window = state_dict["_fit_window"]
        if not isinstance(window, (list, tuple)):
            raise TypeError(f"state_dict['_fit_window'] must be a list, got {window!r}")
        fit_state["margin"] = _number(state_dict, "_fit_margin", int)
        fit_state["window"] = tuple(check_real("state_dict['_fit_window']", v) for v in window)
    if version >= 4:
        fit_state["streak"] = _number(state_dict, "_fit_streak", int)
    return policy_changes, fit_state, _number(state_dict, "_hysteresis_tracker", int)


def _counters(state_dict: Mapping[str, Any]) -> Counters:
    """The counters the dict holds (those an older format, or a torch state dict, lacks: 0).

    Raises:
        ValueError: they are not counts of one run: each is named, with its value.
    """
    names = [f.name for f in fields(Counters) if f.name in state_dict]
    counters = Counters(**{name: _number(state_dict, name, int) for name in names})
    if not 0 <= counters.consecutive_skips <= counters.skipped_steps <= counters.steps:
        raise ValueError(
            "state_dict counters must satisfy 0 <= consecutive_skips <= skipped_steps <= steps, "
            f"got consecutive_skips={counters.consecutive_skips}, "
            f"skipped_steps={counters.skipped_steps}, steps={counters.steps}"
        )
    # skipped_steps >= 0 here: the last overflow's step is 0 with no skip, else in [1, steps]
    low, high = (0, 0) if counters.skipped_steps == 0 else (1, counters.steps)
    if not low <= counters.last_overflow_step <= high:
        raise ValueError(
            "state_dict['last_overflow_step'] must be 0 when no step was skipped, else in "
            f"[1, steps]; got last_overflow_step={counters.last_overflow_step}, "
            f"skipped_steps={counters.skipped_steps}, steps={counters.steps}"
        )
    if not 0 <= counters.forward_overflows <= counters.skipped_steps or counters.retries < 0:
        raise ValueError(
            "state_dict counters must satisfy 0 <= forward_overflows <= skipped_steps and "
            f"retries >= 0, got forward_overflows={counters.forward_overflows}, "
            f"skipped_steps={counters.skipped_steps}, retries={counters.retries}"
        )
    floor, losses, skips = counters.floor_streak, counters.loss_streak, counters.consecutive_skips
    # each streak counts skipped steps in a row, of other kinds: gradient and forward overflows
    if floor < 0 or not 0 <= losses <= counters.forward_overflows or floor + losses > skips:
        raise ValueError(
            "state_dict counters must satisfy floor_streak >= 0, 0 <= loss_streak <= "
            "forward_overflows and floor_streak + loss_streak <= consecutive_skips (each streak "
            f"counts skipped steps in a row, of other kinds), got floor_streak={floor}, "
            f"loss_streak={losses}, forward_overflows={counters.forward_overflows}, "
            f"consecutive_skips={skips}"
        )
    return counters
