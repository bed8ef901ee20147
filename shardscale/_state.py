"""The scaler's state: on the device where each step updates it, and in its checkpoint format.

Invariant: between two `update()` calls the device tensors hold exactly what a state dict would
read back (one host read, `DeviceState.packed`, gets all of it); a state dict is loaded whole or
not at all (`parse_state_dict` validates every key, value and relation before anything changes).

Checkpoints load both ways with torch's scalers: our state dict carries torch's five keys with
torch's meanings (`scale`, `growth_factor`, `backoff_factor`, `growth_interval`,
`_growth_tracker`), which is all `torch.amp.GradScaler.load_state_dict` reads; ours adds the
hysteresis settings, the floor and ceiling, `dynamic`, the step counters, `format_version` and
the scale policy with its learned state (`scale_policy`, `_fit_margin`, `_fit_window`,
`_fit_streak`).
A torch state dict has none of our keys and loads with our current settings, a full hysteresis
allowance and zeroed counters. Each format version has its own set of our keys, all required (a
dict with only some of them is damaged): version 0 (no `format_version`) and 1 lack the
forward-overflow and retry counters of version 2, which then start at 0; versions 0 to 2 lack
the policy's keys of version 3 (the loading scaler keeps its own policy, and the fit's margin and
window start afresh); version 3 lacks the fit's overflow streak of version 4 (it starts at 0); a
dict from a newer shardscale is refused. All values are Python numbers
(the policy's name a string, the window a list of them), identical on every rank, so
`torch.distributed.checkpoint` stores one copy and loads it at any world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import IntEnum
from typing import Any

import torch

from shardscale._errors import no_scale_message
from shardscale._exchange import BIN_LOW, UNDERFLOW_BELOW, UNDERFLOW_TARGET, Flag, Verdict
from shardscale._policy import (
    SCALE_POLICIES,
    ScalePolicy,
    ScaleState,
    check_bool,
    check_choice,
    check_int,
    check_real,
)

# The version `state_dict()` writes.
FORMAT_VERSION = 4

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_POLICY_KEYS = ("hysteresis", "_hysteresis_tracker", "min_scale", "max_scale", "dynamic")
_V0_KEYS = (*_POLICY_KEYS, "steps", "skipped_steps", "consecutive_skips", "last_overflow_step")
_V1_KEYS = (*_V0_KEYS, "format_version")
_V2_KEYS = (*_V1_KEYS, "forward_overflows", "retries")
_V3_KEYS = (*_V2_KEYS, "scale_policy", "_fit_margin", "_fit_window")
_V4_KEYS = (*_V3_KEYS, "_fit_streak")
# Our keys in each format version: all of them, or none (a torch state dict).
OUR_KEYS_BY_VERSION = {0: _V0_KEYS, 1: _V1_KEYS, 2: _V2_KEYS, 3: _V3_KEYS, 4: _V4_KEYS}


@dataclass(frozen=True, slots=True)
class Counters:
    """How many steps the scaler has seen, skipped and retried.

    Attributes:
        steps: `update()` calls that consumed a step's overflow check.
        skipped_steps: Of those, the steps skipped because some rank overflowed (gradients or loss).
        consecutive_skips: Skipped steps since the last step taken.
        last_overflow_step: The number (1-based) of the last skipped step; 0 if none was skipped.
        forward_overflows: Of the skipped steps, those whose loss was non-finite on some rank (the
            scale held).
        retries: Times `step(closure=...)` backed off and ran a batch again after a gradient
            overflow.
    """

    steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    last_overflow_step: int = 0
    forward_overflows: int = 0
    retries: int = 0


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


def _number(state_dict: Mapping[str, Any], key: str, kind: type[int] | type[float]) -> Any:
    """`state_dict[key]` as an int or a float (a one-element tensor, an integral float taken)."""
    value = state_dict[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    return (check_int if kind is int else check_real)(f"state_dict[{key!r}]", value)


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
    # the format version: its `format_version`, 0 without one
    version = _number(state_dict, "format_version", int) if "format_version" in state_dict else 0
    if version not in OUR_KEYS_BY_VERSION:
        raise ValueError(
            f"state_dict['format_version'] must be one of {sorted(OUR_KEYS_BY_VERSION)}, got "
            f"{version}: a newer shardscale saved it"
        )
    our_keys = OUR_KEYS_BY_VERSION[version]
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
    ours = len(absent) < len(our_keys)
    if ours and absent:
        raise ValueError(
            f"state_dict has some of shardscale's keys but not {absent}: it is damaged "
            "(a torch scaler's state dict has none of them, ours has all)"
        )
    kinds = {"growth_factor": float, "backoff_factor": float, "growth_interval": int}
    policy_changes: dict[str, Any] = {k: _number(state_dict, k, kind) for k, kind in kinds.items()}
    scale = _number(state_dict, "scale", float)
    growth_tracker = _number(state_dict, "_growth_tracker", int)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"state_dict['scale'] must be finite and > 0, got {scale}")
    fit_state = {}  # an older format's: the margin and window start afresh
    hysteresis_tracker: int | None = None  # None: a torch state dict, the allowance starts full
    if ours:
        kinds = {"hysteresis": int, "min_scale": float, "max_scale": float}
        policy_changes.update({k: _number(state_dict, k, kind) for k, kind in kinds.items()})
        policy_changes["dynamic"] = check_bool("state_dict['dynamic']", state_dict["dynamic"])
        hysteresis_tracker = _number(state_dict, "_hysteresis_tracker", int)
    # counters an older format (or a torch state dict: none) lacks start at 0
    names = [f.name for f in fields(Counters) if f.name in keys]
    counters = Counters(**{name: _number(state_dict, name, int) for name in names})
    if version >= 3:
        name = check_choice("state_dict['scale_policy']", state_dict["scale_policy"])
        policy_changes["fit"] = name == "fit"
        window = state_dict["_fit_window"]
        if not isinstance(window, (list, tuple)):
            raise TypeError(f"state_dict['_fit_window'] must be a list, got {window!r}")
        fit_state = {
            "margin": _number(state_dict, "_fit_margin", int),
            "window": tuple(check_real("state_dict['_fit_window']", v) for v in window),
        }
        if version >= 4:
            fit_state["streak"] = _number(state_dict, "_fit_streak", int)
    policy = replace(current, **policy_changes)  # ScalePolicy validates the settings
    tracker = policy.hysteresis if hysteresis_tracker is None else hysteresis_tracker
    scale_state = ScaleState(scale, growth_tracker, tracker, **fit_state)
    policy.check_state(scale_state)
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
    return ScalerState(policy=policy, scale=scale_state, counters=counters)


# The slots of `DeviceState.counters`: `Counters`' fields (SINCE_OVERFLOW: steps since the last
# overflow), then the streaks the scaler watches: FLOOR_STREAK, consecutive gradient overflows
# that left the scale at its floor (or, with `dynamic=False`, at its one value); LOSS_STREAK,
# consecutive forward overflows. One more slot of their update, BACKOFF: the gradient overflow the
# policy backs off for.
Count = IntEnum(
    "Count",
    "STEPS SKIPPED CONSECUTIVE SINCE_OVERFLOW FORWARD_OVERFLOWS RETRIES FLOOR_STREAK LOSS_STREAK "
    "BACKOFF",
    start=0,
)
COUNTERS = Count.BACKOFF  # how many are kept


# A step's update of the counters is `counters * keep + add`, `keep` and `add` linear in the
# agreed flags s (skipped) and f (of which a forward overflow): per slot, (keep, add), each as
# (constant, per s, per f). BACKOFF's `add` is s - f. FLOOR_STREAK's pair is then multiplied by
# whether the scale is at its floor after the step (a forward overflow keeps it, and the scale).
_UPDATE = {
    Count.STEPS: ((1, 0, 0), (1, 0, 0)),
    Count.SKIPPED: ((1, 0, 0), (0, 1, 0)),
    Count.CONSECUTIVE: ((0, 1, 0), (0, 1, 0)),
    Count.SINCE_OVERFLOW: ((1, -1, 0), (1, -1, 0)),
    Count.FORWARD_OVERFLOWS: ((1, 0, 0), (0, 0, 1)),
    Count.RETRIES: ((1, 0, 0), (0, 0, 0)),
    Count.FLOOR_STREAK: ((0, 1, 0), (0, 1, -1)),
    Count.LOSS_STREAK: ((0, 0, 1), (0, 0, 1)),
    Count.BACKOFF: ((0, 0, 0), (0, 1, -1)),
}
# as matrices: [keep..., add...] = base + [s, f] @ slopes
_COUNT_TERMS = [
    [row[part][term] for part in (0, 1) for row in _UPDATE.values()] for term in range(3)
]


@dataclass(frozen=True, slots=True)
class DeviceState:
    """The scale state as tensors on the loss's device, where the hot path updates it.

    Kept on the device so that `update()` needs no host synchronisation, and counted there, not
    on the host, so that the counts stay right when step+update is replayed from a CUDA graph;
    read back to host values only for `state_dict()`, `stats` and `get_scale()`.

    Attributes:
        scale: float32 scalar.
        growth_tracker: int32 scalar.
        hysteresis_tracker: int32 scalar.
        counters: float64, by `Count`: `[steps, skipped_steps, consecutive_skips, steps since the
            last overflow, forward_overflows, retries, floor streak, loss streak]` (exact to
            2**53). Steps since the last overflow rather than its step number, because it updates
            with the same multiply-add as the others.
        count_terms: `_COUNT_TERMS` on this device (float32, 3 x 18: the base, then the slopes).
        fit: float32 `[margin, streak, window...]` of the `fit` policy (`ScaleState`'s).
        meter: float64 `[step, fraction, scale]`: the meter's last reading (`_meter_`; zeros: none).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor
    counters: torch.Tensor
    count_terms: torch.Tensor
    fit: torch.Tensor
    meter: torch.Tensor

    @classmethod
    def create(cls, state: ScalerState, device: torch.device) -> DeviceState:
        """Tensors on `device` holding `state`."""
        device_state = cls(
            scale=torch.empty((), dtype=torch.float32, device=device),
            growth_tracker=torch.empty((), dtype=torch.int32, device=device),
            hysteresis_tracker=torch.empty((), dtype=torch.int32, device=device),
            counters=torch.zeros(COUNTERS, dtype=torch.float64, device=device),
            count_terms=torch.tensor(_COUNT_TERMS, dtype=torch.float32, device=device),
            fit=torch.empty(2 + len(state.scale.window), dtype=torch.float32, device=device),
            meter=torch.zeros(3, dtype=torch.float64, device=device),
        )
        device_state.write(state)
        return device_state

    def write(self, state: ScalerState) -> None:
        """Overwrite the tensors in place with `state` (keeping their identity)."""
        self.scale.fill_(state.scale.scale)
        self.growth_tracker.fill_(state.scale.growth_tracker)
        self.hysteresis_tracker.fill_(state.scale.hysteresis_tracker)
        c = state.counters
        head = (c.steps, c.skipped_steps, c.consecutive_skips)  # in Count's order
        values = (*head, c.steps - c.last_overflow_step, c.forward_overflows, c.retries, 0, 0)
        self.counters.copy_(torch.tensor(values, dtype=torch.float64))  # the streaks start afresh
        fit = state.scale
        self.fit.copy_(torch.tensor([fit.margin, fit.streak, *fit.window]))

    def apply_(
        self, policy: ScalePolicy, verdict: Verdict, manual: torch.Tensor | None = None
    ) -> None:
        """Count one step and move the scale, from the group's `verdict`, without a host sync.

        Read from it: the agreed flags, by `Flag`, each exactly 0.0 or 1.0 (a forward overflow
        is a skip: never above the skip flag); whether the host read them and the step was not
        skipped (`read is False`: a plain step's decision), where the counts move by constants
        (the flags' terms vanish, the streaks end), and there is no forward overflow to hold the
        scale for, nor a backoff to floor: kernels fewer; the bound of the largest scaled
        gradient (`peak`, the fit's); the meter's counts (read at the scale the gradients
        carried, before it moves). `manual`: set the scale to this instead of moving it
        (`update(new_scale=...)`).
        """
        flags, clean = verdict.flags, verdict.read is False
        terms = self.count_terms
        rows = terms[0] if clean else torch.addmm(terms[:1], flags.view(1, 2), terms[1:])
        keep, add = rows.view(2, len(Count))
        torch.addcmul(add[:COUNTERS], self.counters, keep[:COUNTERS], out=self.counters)
        if verdict.counts is not None:  # counted this step, the scale not moved yet
            self._meter_(verdict.counts.double())
        if manual is not None:
            self.scale.copy_(manual)
        elif policy.fit:  # the fit's bound, by the scale the gradients carried
            peak = verdict.peak if verdict.peak is not None else self.scale.new_zeros(())
            policy.fit_(self.scale, self.hysteresis_tracker, self.fit, flags, peak / self.scale)
        elif clean:
            policy.update_(
                self.scale, self.growth_tracker, self.hysteresis_tracker, flags[0], clean=True
            )
        else:  # a gradient overflow backs off; a forward one holds
            trackers = (self.growth_tracker, self.hysteresis_tracker)
            policy.update_(self.scale, *trackers, add[Count.BACKOFF], flags[Flag.FORWARD])
        if not clean and policy.dynamic:  # the floor streak goes on only at the floor
            self.counters[Count.FLOOR_STREAK].mul_(self.scale <= policy.min_scale)

    def _meter_(self, counts: torch.Tensor) -> None:
        """Read the meter from the group's counts, on the device: the step, the fraction of
        the non-zero elements below `UNDERFLOW_BELOW` (subnormal in fp16) at this scale, and
        the scale, this one times a power of two, from which at most `UNDERFLOW_TARGET` of them
        would be (the lowest such; NaN without a non-zero element)."""
        below = int(math.log2(UNDERFLOW_BELOW)) - BIN_LOW + 1  # the bins under it: 0 .. below-1
        total = counts.sum()
        shares = counts.cumsum(0) / total  # at each bin: the fraction at or under it
        shift = below - (shares <= UNDERFLOW_TARGET).sum()  # bins to move up (or down)
        fitted = torch.where(total > 0, self.scale * torch.exp2(shift), math.nan)
        step = self.counters[Count.STEPS]
        self.meter.copy_(torch.stack([step, shares[below - 1], fitted.double()]))

    def back_off_for_retry_(self, policy: ScalePolicy) -> bool:
        """Back the scale off once for a rerun of the batch (`step(closure=...)`), and count the
        retry; False, changing nothing, where the scale cannot go lower (`dynamic=False`, or at
        the floor). One host read of the scale."""
        if not policy.dynamic or float(self.scale.item()) <= policy.min_scale:
            return False
        policy.backoff_(self.scale, self.growth_tracker)
        self.counters[Count.RETRIES].add_(1)
        return True

    def packed(self) -> torch.Tensor:
        """`[scale, growth_tracker, hysteresis_tracker, *counters, *fit, *meter]`, one float64
        tensor, in one kernel (a `cat` that promotes the dtypes).

        One host read then gets everything (`read`, and the step reports).
        """
        head = (self.scale, self.growth_tracker, self.hysteresis_tracker)
        return torch.cat([*(t.reshape(1) for t in head), self.counters, self.fit, self.meter])


# Where `DeviceState.packed()` holds the streaks: after the scale and its two trackers.
PACKED_STREAKS = slice(3 + Count.FLOOR_STREAK, 3 + COUNTERS)


def unpack(values: list[float]) -> tuple[ScaleState, Counters]:
    """The host values of `DeviceState.packed()` (the meter's three last are not read here)."""
    scale, growth, hysteresis, *rest = values
    steps, skipped, consecutive, since, forward, retries = rest[:6]  # the streaks: not state
    last_overflow = steps - since if skipped else 0
    counters = Counters(*map(int, (steps, skipped, consecutive, last_overflow, forward, retries)))
    margin, streak, *window = rest[COUNTERS:-3]
    trackers = (int(growth), int(hysteresis), int(margin))
    return ScaleState(scale, *trackers, window=tuple(window), streak=int(streak)), counters


class ScaleHome:
    """Where this rank's scale state lives, and the one answer to "does this rank hold a scale?".

    The state stays on the host (`host`) until `scale()` puts it where the loss is
    ([`at()`][at]): this rank scaled. A rank that never scales (a pipeline stage before
    the last) gets it where its gradients are when it first steps
    ([`for_gradients()`][for_gradients]), *unconfirmed*: it checks its gradients but modifies
    nothing until the group's first agreement shows that some rank scaled
    ([`confirm()`][confirm]). Every change to the state goes through this object.
    """

    def __init__(self, host: ScalerState) -> None:
        self.host = host
        """The state on the host: all of it before a device holds it; after, its policy and
        the values the state started from (torch's `_init_scale`)."""
        self.device: DeviceState | None = None
        """The state on its device, once a loss or a step put it there."""
        self.scaled_here = False
        """Whether this rank called `scale()`."""
        self.unconfirmed = False
        """The state was put here by a step, not by `scale()`, and no agreement has yet
        confirmed that some rank scales."""

    def at(self, device: torch.device, *, loss: bool = False) -> DeviceState:
        """The state on `device`, put there now if no device holds it yet; `loss`: for a loss
        on `device` (this rank scales; the scale lives where the first loss does)."""
        self.scaled_here = self.scaled_here or loss
        if self.device is None:
            self.device = DeviceState.create(self.host, device)
        return self.device

    def for_gradients(self, device: torch.device) -> DeviceState:
        """The state for a rank that steps without having scaled: where its gradients are,
        unconfirmed until the group agrees that some rank scaled."""
        if self.device is None:
            self.unconfirmed = True
        return self.at(device)

    def confirm(self) -> None:
        """The group agreed that some rank scaled: this rank may now modify its gradients."""
        self.unconfirmed = False

    def require(self, funcname: str) -> DeviceState:
        """The state on its device; torch's error if no `scale()` (or step) put it there.

        Raises:
            RuntimeError: no state on a device yet, in torch's words.
        """
        if self.device is None:
            raise RuntimeError(no_scale_message(funcname))
        return self.device

    def set_policy(self, **changes: Any) -> None:
        """Change policy settings (validated by `ScalePolicy`)."""
        self.host = replace(self.host, policy=replace(self.host.policy, **changes))

    def set_start(self, **changes: Any) -> None:
        """Change the values the state starts from on a device (torch's `_init_scale`...)."""
        self.host = replace(self.host, scale=replace(self.host.scale, **changes))

    def load(self, state: ScalerState) -> None:
        """Take `state` (a loaded state dict), on the host and, if one holds it, the device."""
        self.host = state
        if self.device is not None:
            self.device.write(state)

    def read(self) -> ScalerState:
        """The whole state as host values: one host read once a device holds it."""
        if self.device is None:
            return self.host
        scale, counters = unpack(self.device.packed().tolist())
        return ScalerState(policy=self.host.policy, scale=scale, counters=counters)
