"""The scaler's options, validated once: one frozen config object per scaler.

Every option a user passes to [`ShardedGradScaler`][shardscale.ShardedGradScaler] lands here, is
checked here (the rule, then the value), and is normalised here (a device name to its type, seconds
to a `timedelta`), so the classes that use them trust them. The scale policy's own settings are
checked by [`ScalePolicy`][], which the config builds.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardscale._errors import ShardScaleWarning
from shardscale._policy import ScalePolicy, check_bool, check_choice, check_int


class _Default:
    """The default of a setting a checkpoint also holds, as the signature shows it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<default>"


# The constructor's default for each of `SETTINGS`: a value passed, even the default's own, is
# then told from one left out (`ScalerConfig.passed`), so that on resume a shardscale setting
# passed is kept and one left out is the checkpoint's.
DEFAULT: Any = _Default()

# The settings a checkpoint also holds, with the defaults `DEFAULT` stands for: the policy's
# own, but the ceiling's (None: none) and the scale policy's, which the config names otherwise.
SETTINGS: dict[str, Any] = {f.name: f.default for f in fields(ScalePolicy) if f.name != "fit"}
SETTINGS |= {"max_scale": None, "scale_policy": "interval"}


def timeout_option(name: str, value: timedelta | float | None) -> timedelta | None:
    """`value` (a `timedelta`, seconds, or None) as a `timedelta`, checked to be > 0."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{name} must be a datetime.timedelta, a number of seconds or None, got "
            f"{type(value).__name__}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be a finite time > 0, got {seconds} s")
    return timedelta(seconds=seconds)


def check_group(group: object) -> None:
    """Accept `process_group` as torch's ShardedGradScaler does: a `ProcessGroup`, None, or an
    object with `rank()` and `size()` (torch's `DummyProcessGroup`) of size 1, where no
    collective is needed.

    Raises:
        TypeError, ValueError: anything else; the message says what to pass.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup, None, or an object with "
            "rank() and size() (like torch's DummyProcessGroup) of size 1, got "
            f"{type(group).__name__}"
        )
    if group.size() != 1:  # type: ignore[attr-defined]
        raise ValueError(
            f"a process_group that is not a torch.distributed.ProcessGroup (here "
            f"{type(group).__name__}) must have size() == 1, where no collective is needed "
            "(is torch.distributed not initialised? initialise it and pass a "
            f"torch.distributed.ProcessGroup). Got size() = {group.size()!r}"  # type: ignore[attr-defined]
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalerConfig:
    """Every option of a [`ShardedGradScaler`][shardscale.ShardedGradScaler] (its docstring says
    what each means), validated when built.

    Raises:
        TypeError: an option has the wrong type.
        ValueError: an option is out of range; the message states the rule and the value.
    """

    device: str | None = None
    init_scale: float | None = None
    growth_factor: float = DEFAULT
    backoff_factor: float = DEFAULT
    growth_interval: int = DEFAULT
    enabled: bool = True
    process_group: dist.ProcessGroup | None = None
    hysteresis: int = DEFAULT
    min_scale: float = DEFAULT
    max_scale: float | None = DEFAULT
    dynamic: bool = DEFAULT
    sync_timeout: timedelta | None = None
    verify_every: int = 0
    max_consecutive_skips: int | None = None
    max_overflows_at_floor: int | None = 8
    locate_overflow: bool = False
    max_retries: int = 3
    scale_policy: str = DEFAULT
    underflow_every: int = 100
    passed: frozenset[str] = field(default=frozenset(), init=False)
    """The `SETTINGS` given a value, even their default: on resume they stay this scaler's."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are set once, here
        set_(self, "passed", frozenset(n for n in SETTINGS if getattr(self, n) is not DEFAULT))
        for name in SETTINGS.keys() - self.passed:
            set_(self, name, SETTINGS[name])
        device = self.device  # normalised to its type
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(
                "device must be a str, a torch.device or None, got "
                f"{type(device).__name__}: {device!r}"
            )
        try:
            set_(self, "device", None if device is None else torch.device(device).type)
        except RuntimeError as error:
            raise ValueError(f"device must name a torch device type, got {device!r}") from error
        check_bool("enabled", self.enabled)
        check_bool("locate_overflow", self.locate_overflow)
        check_group(self.process_group)  # torch's DummyProcessGroup-like groups at size 1 too
        set_(self, "sync_timeout", timeout_option("sync_timeout", self.sync_timeout))
        check_int("verify_every", self.verify_every, minimum=0, note="0: never")
        check_int("underflow_every", self.underflow_every, minimum=0)
        check_int("max_retries", self.max_retries, minimum=0, note="0: never retry")
        for name in ("max_consecutive_skips", "max_overflows_at_floor"):
            if getattr(self, name) is not None:
                check_int(
                    name, getattr(self, name), minimum=1, note="None: no limit", optional=True
                )
        check_choice("scale_policy", self.scale_policy)
        self.policy().initial_state(self.first_scale())  # the policy's settings, init_scale

    def policy(self) -> ScalePolicy:
        """The scale policy these options describe (the settings of the same names, and
        `max_scale`, `dynamic` and `scale_policy`)."""
        names = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale")
        return ScalePolicy(
            **{name: getattr(self, name) for name in names},
            max_scale=math.inf if self.max_scale is None else self.max_scale,
            dynamic=self.dynamic,
            fit=self.scale_policy == "fit",
        )

    def collective_settings(self) -> tuple[object, ...]:
        """The settings that decide when the scaler communicates (a retry's collective,
        `verify_every`'s and `locate_overflow`'s gathers, an alarm's), and what its meter
        counts: part of every ballot's identity (`shardscale._check`), so that ranks built with
        different ones find out at their first collective."""
        return (
            self.locate_overflow,
            self.verify_every,
            self.max_consecutive_skips,
            self.max_overflows_at_floor,
            self.max_retries,
            self.underflow_every,
        )

    def passed_policy(self) -> frozenset[str]:
        """`passed`, named as the policy's attributes (`scale_policy` is its `fit`)."""
        return frozenset("fit" if name == "scale_policy" else name for name in self.passed)

    def warn_unused(self) -> None:
        """Warn where the settings that move the scale were given to a scaler whose scale they
        cannot move: the interval rule's, to one that fits; any, to one held fixed."""
        given = {name: getattr(self, name) for name in _MOVE_THE_SCALE if name in self.passed}
        fit_ignores = {k: v for k, v in given.items() if k in ("growth_factor", "growth_interval")}
        warn_unused_by_the_fit(self.policy(), stacklevel=4, **fit_ignores)
        if not self.dynamic and given:
            named = ", ".join(f"{name}={value!r}" for name, value in given.items())
            warnings.warn(
                f"{named}: not used with dynamic=False (the scale is fixed)",
                ShardScaleWarning,
                stacklevel=3,
            )

    def first_scale(self) -> float:
        """`init_scale`, or its default: `2.0**16`, 1.0 for a static scale."""
        if self.init_scale is not None:
            return self.init_scale
        return 2.0**16 if self.dynamic else 1.0


# The settings that move the scale: the fit uses neither of the first two (the interval rule's
# own), a fixed scale none.
_MOVE_THE_SCALE = ("growth_factor", "growth_interval", "backoff_factor", "hysteresis")


def warn_unused_by_the_fit(policy: ScalePolicy, stacklevel: int = 3, **settings: float) -> None:
    """Warn where the interval rule's own settings are given to a scaler that fits its scale:
    accepted (they are checked, kept, and saved), but they move nothing."""
    if policy.fit and settings:
        named = ", ".join(f"{name}={value!r}" for name, value in settings.items())
        warnings.warn(
            f"{named} is not used by scale_policy='fit': the fit sets the scale from the "
            "gradients after every clean step; growth_factor and growth_interval are the "
            "interval rule's (scale_policy='interval')",
            ShardScaleWarning,
            stacklevel=stacklevel,
        )
