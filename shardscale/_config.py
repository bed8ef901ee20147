"""The scaler's options, validated once: one frozen config object per scaler.

Every option a user passes to [`ShardedGradScaler`][shardscale.ShardedGradScaler] lands here, is
checked here (the rule, then the value), and is normalised here (a device name to its type, seconds
to a `timedelta`), so the classes that use them trust them. The scale policy's own settings are
checked by [`ScalePolicy`][], which the config builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from shardscale._compat import check_group
from shardscale._policy import ScalePolicy

__all__ = ["ScalerConfig", "timeout_option"]


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


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")
    return value


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalerConfig:
    """Every option of a [`ShardedGradScaler`][shardscale.ShardedGradScaler], validated when built.

    Raises:
        TypeError: an option has the wrong type.
        ValueError: an option is out of range; the message states the rule and the value.
    """

    device: str | None = None
    """Device type of the loss (`"cuda"`, `"cpu"`...); None follows the first loss."""
    init_scale: float | None = None
    """The first step's scale; None: `2.0**16`, or 1.0 when `dynamic=False`."""
    growth_factor: float = 2.0
    """Multiplies the scale after `growth_interval` clean steps (> 1)."""
    backoff_factor: float = 0.5
    """Multiplies the scale on an overflow (in (0, 1))."""
    growth_interval: int = 2000
    """Consecutive clean steps before the scale grows (>= 1)."""
    enabled: bool = True
    """False makes every method a no-op and `step` a plain `optimizer.step()`."""
    process_group: dist.ProcessGroup | None = None
    """The ranks that must agree; None: the default (world) group."""
    hysteresis: int = 1
    """Overflows tolerated before backing off, replenished on growth (Megatron, DeepSpeed)."""
    min_scale: float = 1.0
    """The floor (> 0): the scale never backs off below it."""
    max_scale: float | None = None
    """The ceiling for growth; None: no ceiling."""
    dynamic: bool = True
    """False keeps the scale fixed (the bf16 guard); non-finite steps are still skipped."""
    sync_timeout: timedelta | float | None = None
    """The longest wait for the other ranks at a collective (`timedelta` or seconds)."""
    verify_every: int = 0
    """Compare the scaler state across ranks every N steps (0: never)."""
    max_consecutive_skips: int | None = None
    """Raise after more consecutive skipped steps than this (None: no limit)."""
    locate_overflow: bool = False
    """On overflow steps, find which parameters on which rank hold the inf/NaN gradients."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are set once, here
        set_(self, "device", _device_type(self.device))
        _bool("enabled", self.enabled)
        _bool("dynamic", self.dynamic)
        _bool("locate_overflow", self.locate_overflow)
        check_group(self.process_group)  # torch's DummyProcessGroup-like groups at size 1 too
        set_(self, "sync_timeout", timeout_option("sync_timeout", self.sync_timeout))
        if _int("verify_every", self.verify_every) < 0:
            raise ValueError(f"verify_every must be >= 0 (0: never), got {self.verify_every}")
        if self.max_consecutive_skips is not None:
            limit = self.max_consecutive_skips
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise TypeError(
                    f"max_consecutive_skips must be an int or None, got {type(limit).__name__}"
                )
            if limit < 1:
                raise ValueError(
                    f"max_consecutive_skips must be >= 1 (None: no limit), got {limit}"
                )
        policy = self.policy()  # checks the policy's own settings
        policy.initial_state(self.first_scale())  # checks init_scale against them

    @property
    def timeout(self) -> timedelta | None:
        """`sync_timeout` as a `timedelta` (normalised at construction)."""
        return cast(timedelta | None, self.sync_timeout)

    def policy(self) -> ScalePolicy:
        """The scale policy these options describe."""
        return ScalePolicy(
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_scale=math.inf if self.max_scale is None else self.max_scale,
            dynamic=self.dynamic,
        )

    def first_scale(self) -> float:
        """`init_scale`, or its default: `2.0**16`, 1.0 for a static scale."""
        if self.init_scale is not None:
            return self.init_scale
        return 2.0**16 if self.dynamic else 1.0


def _device_type(device: object) -> str | None:
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device must be a str, a torch.device or None, got {type(device).__name__}: {device!r}"
        )
    try:
        return torch.device(device).type
    except RuntimeError as error:
        raise ValueError(f"device must name a torch device type, got {device!r}") from error
