"""What happened at each step, told to whoever listens: stats, hooks, the log, the skip limit,
the floor warning, located overflows.

Invariant: reporting never adds a host synchronisation to the step. The numbers live on the device
(`DeviceState`); after each `update()` they are packed into one small tensor and copied to the host.
On the CPU that copy is the read. On a GPU it is started without waiting (into one of two pinned
buffers taken in turn, on the current stream of the state's own device, with an event recorded
there) and delivered at the next `update()` (or when
[`ShardedGradScaler.stats`][shardscale.ShardedGradScaler.stats] is read), by when the device has
long finished it: hooks, log lines and the `max_consecutive_skips` check then run one step late, and
cost no sync (the wait on the previous step's event lets the host run at most one step ahead while
someone listens).

Nobody listening (no hook, no limit, the `"shardscale"` logger below INFO) costs nothing.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.utils.hooks import RemovableHandle

from shardscale._errors import ShardScaleSkipError, ShardScaleWarning
from shardscale._exchange import UNDERFLOW_TARGET
from shardscale._locate import logger
from shardscale._policy import ScalePolicy
from shardscale._state import Count, Counters, DeviceState, unpack

# The meter's log line, above its target (logging's %-arguments: formatted only when logged).
_UNDERFLOW_MESSAGE = "step %d: %.3g%% of the non-zero gradient elements were below fp16's normal "
_UNDERFLOW_MESSAGE += "range (2^-14) at its scale; from a scale of %g, at most %g%% would be"

# At most one skipped-step message per this many seconds; the next one counts the rest.
LOG_INTERVAL_S = 10.0

# Device types whose stats are copied without waiting, under a CUDA event. "meta" is the CPU
# suite's stand-in for a GPU (its tests replace torch.cuda's events and streams with recorders),
# so that this path runs in CI; other accelerators read at once (correct, one sync per update).
_EVENT_DEVICE_TYPES = frozenset({"cuda", "meta"})


@dataclass(frozen=True, slots=True)
class ScalerStats:
    """The scaler's counters after a step: identical on every rank of the group."""

    steps: int
    """Steps counted so far (`update()` calls that consumed an overflow check)."""
    skipped_steps: int
    """Of those, the steps skipped because some rank overflowed."""
    consecutive_skips: int
    """Skipped steps since the last step taken."""
    scale: float
    """The scale now (after the step's `update()`)."""
    last_overflow_step: int
    """The number (1-based) of the last skipped step; 0 if none was."""
    forward_overflows: int = 0
    """Of the skipped steps, those whose loss itself was non-finite on some rank (a forward
    overflow: the scale was held, not backed off)."""
    retries: int = 0
    """Batches run again by `step(closure=...)` after their gradients overflowed."""
    underflow: float = 0.0
    """The meter's last reading: the fraction of non-zero gradient elements below 2^-14."""
    underflow_scale: float = 0.0
    """The lowest scale at which at most 0.1% of them would have been below 2^-14."""
    underflow_step: int = 0
    """The step of that reading (0: none yet; `underflow_every`, docs/observability.md)."""

    @property
    def last_step_skipped(self) -> bool:
        """Whether step number `steps` was skipped."""
        return self.steps > 0 and self.last_overflow_step == self.steps


def stats_of(scale: float, counters: Counters, meter: Sequence[float] = (0, 0, 0)) -> ScalerStats:
    """Stats from host values (`meter`: `DeviceState.meter`'s)."""
    step, fraction, fitted = meter
    counted = asdict(counters) | {"underflow_step": int(step)}
    return ScalerStats(scale=scale, underflow=fraction, underflow_scale=fitted, **counted)


def stats_from(values: list[float]) -> ScalerStats:
    """Stats from `DeviceState.packed()`'s values, read on the host."""
    scale, counters = unpack(values)
    return stats_of(scale.scale, counters, values[-3:])


StatsHook = Callable[[ScalerStats], None]


class StepReporter:
    """Delivers each step's stats to hooks, the log and the consecutive-skip limit."""

    def __init__(self, max_consecutive_skips: int | None) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        # an OrderedDict: RemovableHandle holds a weak reference to it, which a dict refuses
        self._hooks: OrderedDict[int, StatsHook] = OrderedDict()
        # The step whose copy is in flight (delivered at the next push or flush).
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._last_logged = -float("inf")
        self._unlogged_skips = 0
        # The forward overflows counted so far (delivered, or loaded): a step that adds one was
        # skipped for its loss, not its gradients.
        self._forward_overflows = 0
        self._warned_at_floor = False

    def restart(self, counters: Counters) -> None:
        """A state was loaded: forget the step in flight, count from `counters`."""
        self._pending = None
        self._forward_overflows = counters.forward_overflows

    def register(self, hook: StatsHook) -> RemovableHandle:
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def push(self, state: DeviceState) -> None:
        """Take one step's state; deliver it now (CPU) or at the next push/flush.

        Packs the state only when someone listens: with nobody, an update pays no kernel here.
        """
        listening = self._hooks or self.max_consecutive_skips is not None
        if not (listening or logger.isEnabledFor(logging.INFO)):
            self._pending = None
            return
        packed = state.packed()
        if packed.device.type not in _EVENT_DEVICE_TYPES:
            # The CPU (where the copy is the read), or an accelerator without CUDA's events,
            # whose non-blocking copy nothing could wait for: read now.
            self.flush()
            self._deliver(stats_from(packed.tolist()))
            return
        # Pinned, so the copy runs without the host (torch's caching host allocator keeps the
        # few small blocks this takes, in turn, from one step to the next).
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        # On the stream of the packed tensor's OWN device, not the current device's (which, on
        # the async scaler's optimizer thread or without torch.cuda.set_device, is another
        # GPU's): the copy and the event that covers it must be on the same stream.
        with torch.cuda.device(packed.device):
            host.copy_(packed, non_blocking=True)
            event.record(torch.cuda.current_stream(packed.device))
        self.flush(then=(host, event))

    def flush(self, then: tuple[torch.Tensor, torch.cuda.Event] | None = None) -> None:
        """Deliver a step still in flight (waits for its copy); `then` (the step just copied)
        is in flight from now on, delivered or not."""
        pending, self._pending = self._pending, then
        if pending is not None:
            host, event = pending
            event.synchronize()  # recorded a step ago: normally long complete
            self._deliver(stats_from(host.tolist()))

    def _deliver(self, stats: ScalerStats) -> None:
        forward = stats.forward_overflows > self._forward_overflows
        self._forward_overflows = stats.forward_overflows
        if stats.last_step_skipped:
            self._log_skip(stats, forward)
        if stats.underflow_step == stats.steps and stats.underflow > UNDERFLOW_TARGET:
            values = (stats.steps, 100 * stats.underflow, stats.underflow_scale)
            logger.info(_UNDERFLOW_MESSAGE, *values, 100 * UNDERFLOW_TARGET)
        for hook in list(self._hooks.values()):
            hook(stats)
        limit = self.max_consecutive_skips
        if limit is not None and stats.consecutive_skips > limit:
            raise ShardScaleSkipError(
                f"step {stats.steps}: {stats.consecutive_skips} consecutive steps skipped for "
                f"inf/NaN gradients or losses ({stats.forward_overflows} forward overflow(s) in "
                f"all), more than max_consecutive_skips={limit}; the scale is {stats.scale:g}. A "
                "scale that stays small while steps keep overflowing, or a loss that is itself "
                "inf/NaN, usually means the model or the loss produces inf/NaN by itself (try "
                "locate_overflow=True to see which parameters, and which ranks' losses)."
            )

    def _log_skip(self, stats: ScalerStats, forward: bool) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        now = time.monotonic()
        if now - self._last_logged < LOG_INTERVAL_S:
            self._unlogged_skips += 1
            return
        more = f" ({self._unlogged_skips} more skipped step(s) since the last message)"
        cause = (
            "the loss itself was non-finite on some rank (a forward overflow: loss scaling "
            "cannot fix it; the scale is held)"
            if forward
            else "inf/NaN gradients on some rank"
        )
        logger.info(
            "step %d skipped: %s; scale now %g, %d consecutive skip(s), %d of %d steps skipped%s",
            stats.steps,
            cause,
            stats.scale,
            stats.consecutive_skips,
            stats.skipped_steps,
            stats.steps,
            more if self._unlogged_skips else "",
        )
        self._last_logged = now
        self._unlogged_skips = 0

    def warn_if_at_floor(self, state: DeviceState, policy: ScalePolicy, steps: int) -> float:
        """Warn, once, when the scale has backed off to `min_scale` and cannot go lower.

        Reads the scale and the skipped-step count in ONE host read (a synchronisation on an
        accelerator: callers there only call it where they read the device anyway, and
        `get_scale()` takes the scale it returns).

        Returns:
            The scale, as read.
        """
        if self._warned_at_floor or not policy.dynamic:
            return float(state.scale.item())
        scale, skipped = torch.stack((state.scale.double(), state.counters[Count.SKIPPED])).tolist()
        if scale <= policy.min_scale and skipped > 0:
            self._warned_at_floor = True
            warnings.warn(
                f"the loss scale has backed off to min_scale={policy.min_scale} (by step {steps}) "
                "and cannot go lower: steps that still overflow are skipped and the scale holds. "
                "Gradients that are non-finite even at this scale usually mean a NaN/inf in the "
                "model or the loss.",
                ShardScaleWarning,
                stacklevel=3,
            )
        return float(scale)
