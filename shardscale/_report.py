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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

from shardscale._checkpoint import Counters
from shardscale._device_state import DeviceState, ScaleHome, state_fields, unpack
from shardscale._errors import ShardScaleSkipError, ShardScaleWarning
from shardscale._locate import NonFiniteGrad
from shardscale._policy import ScalePolicy

if TYPE_CHECKING:
    from shardscale._agree import Agreement
    from shardscale._stepping import Stepper

__all__ = [
    "LOG_INTERVAL_S",
    "ReportingMembers",
    "ScalerStats",
    "StepReporter",
    "log_located",
    "logger",
]

logger = logging.getLogger("shardscale")
"""The library's logger: INFO per skipped step (rate-limited), WARNING for located overflows."""

LOG_INTERVAL_S = 10.0
"""At most one skipped-step message per this many seconds; the next one counts the rest."""

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

    @property
    def last_step_skipped(self) -> bool:
        """Whether step number `steps` was skipped."""
        return self.steps > 0 and self.last_overflow_step == self.steps


def stats_of(scale: float, counters: Counters) -> ScalerStats:
    """Stats from host values."""
    return ScalerStats(
        steps=counters.steps,
        skipped_steps=counters.skipped_steps,
        consecutive_skips=counters.consecutive_skips,
        scale=scale,
        last_overflow_step=counters.last_overflow_step,
    )


def stats_from(values: list[float]) -> ScalerStats:
    """Stats from `DeviceState.packed()`'s values, read on the host."""
    scale, counters = unpack(values)
    return stats_of(scale.scale, counters)


StatsHook = Callable[[ScalerStats], None]


class StepReporter:
    """Delivers each step's stats to hooks, the log and the consecutive-skip limit."""

    def __init__(self, max_consecutive_skips: int | None) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        # an OrderedDict: RemovableHandle holds a weak reference to it, which a dict refuses
        self._hooks: OrderedDict[int, StatsHook] = OrderedDict()
        # The step whose copy is in flight (delivered at the next push or flush), and the two
        # pinned buffers (with their events) that the copies take in turn.
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._buffers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._buffers_device: torch.device | None = None
        self._last_logged = -float("inf")
        self._unlogged_skips = 0
        self._warned_at_floor = False

    def register(self, hook: StatsHook) -> RemovableHandle:
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def listening(self) -> bool:
        return bool(
            self._hooks
            or self.max_consecutive_skips is not None
            or logger.isEnabledFor(logging.INFO)
        )

    def push(self, state: DeviceState) -> None:
        """Take one step's state; deliver it now (CPU) or at the next push/flush.

        Packs the state only when someone listens: with nobody, an update pays no kernel here.
        """
        if not self.listening():
            self._pending = None
            return
        packed = state.packed()
        if packed.device.type not in _EVENT_DEVICE_TYPES:
            # The CPU (where the copy is the read), or an accelerator without CUDA's events,
            # whose non-blocking copy nothing could wait for: read now.
            self.flush()
            self._deliver(stats_from(packed.tolist()))
            return
        host, event = self._free_buffer(packed)
        # On the stream of the packed tensor's OWN device, not the current device's (which, on
        # the async scaler's optimizer thread or without torch.cuda.set_device, is another
        # GPU's): the copy and the event that covers it must be on the same stream.
        with torch.cuda.device(packed.device):
            host.copy_(packed, non_blocking=True)
            event.record(torch.cuda.current_stream(packed.device))
        previous, self._pending = self._pending, (host, event)
        if previous is not None:
            self._deliver_pending(previous)

    def _free_buffer(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer and its event that no copy in flight uses: two, taken in turn.

        A buffer is free once its step was delivered (its event waited for, its values read),
        i.e. unless it is the pending one; so two suffice and no step allocates pinned memory.
        """
        pending = self._pending[0] if self._pending is not None else None
        if packed.device != self._buffers_device:  # a CUDA event records on one device only
            self._buffers, self._buffers_device = [], packed.device
        for pair in self._buffers:
            if pair[0] is not pending and pair[0].shape == packed.shape:
                return pair
        pair = (
            torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True),
            torch.cuda.Event(),  # type: ignore[no-untyped-call]
        )
        self._buffers = [*(p for p in self._buffers if p[0] is pending), pair]
        return pair

    def flush(self) -> None:
        """Deliver a step still in flight (waits for its copy)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._deliver_pending(pending)

    def _deliver_pending(self, pending: tuple[torch.Tensor, torch.cuda.Event]) -> None:
        host, event = pending
        event.synchronize()  # recorded a step ago: normally long complete
        self._deliver(stats_from(host.tolist()))

    def _deliver(self, stats: ScalerStats) -> None:
        if stats.last_step_skipped:
            self._log_skip(stats)
        for hook in list(self._hooks.values()):
            hook(stats)
        limit = self.max_consecutive_skips
        if limit is not None and stats.consecutive_skips > limit:
            raise ShardScaleSkipError(
                f"step {stats.steps}: {stats.consecutive_skips} consecutive steps skipped for "
                f"inf/NaN gradients, more than max_consecutive_skips={limit}; the scale is "
                f"{stats.scale:g}. A scale that stays small while steps keep overflowing usually "
                "means the model or the loss produces inf/NaN by itself (try "
                "locate_overflow=True to see which parameters)."
            )

    def _log_skip(self, stats: ScalerStats) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        now = time.monotonic()
        if now - self._last_logged < LOG_INTERVAL_S:
            self._unlogged_skips += 1
            return
        more = (
            f" ({self._unlogged_skips} more skipped step(s) since the last message)"
            if self._unlogged_skips
            else ""
        )
        logger.info(
            "step %d skipped: inf/NaN gradients on some rank; scale now %g, %d consecutive "
            "skip(s), %d of %d steps skipped%s",
            stats.steps,
            stats.scale,
            stats.consecutive_skips,
            stats.skipped_steps,
            stats.steps,
            more,
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
        scale, skipped = torch.stack((state.scale.double(), state.counters[1])).tolist()
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


def log_located(step: int, located: list[NonFiniteGrad]) -> None:
    """Log where an overflow step's non-finite gradients were (WARNING: a real anomaly)."""
    logger.warning(
        "step %d overflowed; non-finite gradients at: %s",
        step,
        "; ".join(map(str, located)) or "(none: already cleared)",
    )


class ReportingMembers:
    """What happened, as the scaler tells it: `last_step_skipped`, `stats`, stats hooks,
    `last_overflow`, `get_scale`, and whether the ranks still agree (`verify_agreement`).

    A mixin of [`ShardedGradScaler`][shardscale.ShardedGradScaler]: the scaler provides the
    state below (its `_setup` sets it). Every read of an agreed value here settles the
    collective in flight first, so it is bounded by `sync_timeout`.
    """

    _enabled: bool
    _home: ScaleHome
    _agreement: Agreement
    _stepper: Stepper
    _reporter: StepReporter
    _last_skip: bool | torch.Tensor
    _steps: int

    if TYPE_CHECKING:

        @property
        def policy(self) -> ScalePolicy: ...

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent `step()` skipped the optimizer (on every rank).

        Free after a non-fused step (its decision was already read); after a fused step,
        reading it costs one host synchronisation on an accelerator.
        """
        if isinstance(self._last_skip, torch.Tensor):
            # Read each time, never cached: a CUDA-graph replay updates this very tensor.
            return self._agreement.read_flag(self._last_skip)
        return self._last_skip

    @property
    def stats(self) -> ScalerStats:
        """Steps, skipped steps, consecutive skips, the scale and the last overflow's step.

        Identical on every rank; right for fused optimizers too (counted on the device). One
        host read of one small tensor (a synchronisation on an accelerator); no collective.
        """
        # Settled first: the flush waits for a copy that follows the collective in flight.
        self._agreement.settle()
        self._reporter.flush()
        if self._home.device is None:
            scale = self._home.host.scale.scale if self._enabled else 1.0
            return stats_of(scale, self._home.host.counters)
        return stats_from(self._home.device.packed().tolist())

    def register_stats_hook(self, hook: StatsHook) -> RemovableHandle:
        """Call `hook(stats)` after every `update()` that counted a step.

        For TensorBoard / W&B: `stats` is a [`ScalerStats`][]. On the CPU the hook runs
        inside that update(); on an accelerator it runs one update() later (or when
        [`stats`][shardscale.ShardedGradScaler.stats] is read), so that reading the numbers
        never stalls the step.

        Returns:
            A handle whose `remove()` unregisters the hook.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        return self._reporter.register(hook)

    @property
    def last_overflow(self) -> list[NonFiniteGrad]:
        """With `locate_overflow=True`: where the last overflow step's inf/NaN gradients were.

        [`NonFiniteGrad`][] records (rank, name, num_inf, num_nan), identical on every
        rank. Empty before the first overflow, or without `locate_overflow`.
        """
        return list(self._stepper.last_overflow)

    def get_scale(self) -> float:
        """Return the current scale (1.0 when disabled). Costs ONE host sync on an accelerator
        (the scale and the floor warning's skipped-step count come in one read)."""
        if not self._enabled:
            return 1.0
        if self._home.device is None:
            return self._home.host.scale.scale
        self._agreement.settle()
        return self._reporter.warn_if_at_floor(self._home.device, self.policy, self._steps)

    def verify_agreement(self) -> None:
        """Check that every rank holds the same scaler state, in one small collective.

        Compares the scale, the trackers, the counters and the policy settings. They always
        agree if every rank ran the same steps and loaded the same state; this catches the
        cases where they did not (a state dict loaded on some ranks only, a rank restarted
        from another checkpoint). A no-op at world size 1. Costs one host synchronisation.

        Raises:
            ShardScaleDistributedError: the ranks differ; the message lists every rank's values
                for each field that differs. Or a rank did not arrive within `sync_timeout`.
        """
        if not self._enabled or self._agreement.world_size == 1:
            return
        state = self._home.host if self._home.device is None else self._home.device
        names, values = state_fields(state, self.policy)
        self._agreement.compare(values, names, self._steps)
