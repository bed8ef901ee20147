"""The bounded exchange: every collective the scaler issues, and how long it may wait for one.

Invariant: no collective of the scaler waits unboundedly for a rank that never comes, and none
makes the host wait where the device alone could (an accelerator backend with a `timeout`).

With a `timeout`, a rank that never arrives (it crashed, hung, or took another code path) makes
the others raise [`ShardScaleDistributedError`][] within that time instead of waiting out the
process group's own timeout (torch's defaults: 30 minutes for gloo, 10 for NCCL). The error says
what happened, decided by the clock and by what the backend raised, not by one backend's
wording: *late* (the wait ran out, or the backend reports a timeout: gloo's "Timed out", NCCL's
"Watchdog caught collective operation timeout") or *gone* (the connection broke).

Where the host must wait anyway (a CPU ballot; gloo, which stages device tensors through the
host) the wait is bounded there, at the collective. On an accelerator backend (NCCL) waiting
on the host would turn every fused step into a host synchronisation, so the collective is only
made to wait on the device's stream; the bound, counted from the enqueue as NCCL counts it, is
enforced at this exchange's next collective or at `settle()`, which every host read of an
agreed value calls first.
"""

from __future__ import annotations

import pickle
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from shardscale._errors import ShardScaleDistributedError

__all__ = ["Exchange"]

_E = TypeVar("_E", bound="Exchange")


def _device_of_type(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _bound_device(group: dist.ProcessGroup) -> torch.device | None:
    """The accelerator `group` (or the default group, whose binding new groups inherit) is
    bound to by `init_process_group(device_id=...)`: where its communicator lives."""
    for candidate in (group, dist.group.WORLD if dist.is_available() else None):
        bound = getattr(candidate, "bound_device_id", None)
        if bound is not None:
            return torch.device(bound)
    return None


def _waits_on_host(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether waiting for a collective on `device` blocks the host until it is done.

    True on the CPU, and for backends that stage device tensors through the host (gloo, MPI);
    False for accelerator backends (NCCL and its kind), whose `Work.wait()` only makes the
    current stream wait. A backend that cannot be asked is taken as host-waiting: the bounded
    host wait is always correct, only slower.
    """
    if device.type == "cpu":
        return True
    try:
        backend = str(dist.get_backend(group)).lower()  # "nccl", "cpu:gloo,cuda:nccl", ...
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError):
        return True
    if ":" in backend:
        per_type = dict(pair.split(":", 1) for pair in backend.split(","))
        backend = per_type.get(device.type, backend)
    return backend in ("gloo", "mpi")


_TIMEOUT_TEXT = re.compile(r"timed out|timeout(?!\s*\(ms\))", re.IGNORECASE)
"""A backend reporting a timeout: gloo's "Timed out waiting", NCCL's "Watchdog caught
collective operation timeout" (but not the "Timeout(ms)=..." NCCL prints in every work's name)."""
_BROKEN_TEXT = re.compile(
    r"connection (reset|closed|refused)|broken pipe|remote process exited|ncclRemoteError",
    re.IGNORECASE,
)


def _broken_connection(error: BaseException) -> bool:
    return isinstance(error, dist.DistNetworkError) or bool(_BROKEN_TEXT.search(str(error)))


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A collective enqueued on an accelerator and not yet known to have completed."""

    work: dist.Work
    enqueued: float
    """`time.monotonic()` at enqueue: NCCL counts its timeout from there too."""
    step: int | None
    what: str


def _group_device_types(group: dist.ProcessGroup) -> list[str]:
    """The device types `group` can run collectives on, in its backend's order."""
    device_types = getattr(group, "_device_types", None)
    if device_types:
        return [torch.device(t).type for t in device_types]
    backend = str(dist.get_backend(group))  # e.g. "gloo", "nccl", "cpu:gloo,cuda:nccl"
    if ":" in backend:
        return [pair.split(":")[0] for pair in backend.split(",")]
    return ["cuda"] if backend == "nccl" else ["cpu", "cuda"]


class Exchange:
    """The process group a scaler agrees over, and every collective it runs on it, bounded.

    Args:
        process_group: the group whose ranks must agree; None means the default (world) group,
            looked up at the first step so a scaler may be built before `init_process_group`.
        timeout: the longest wait for the other ranks at a collective (None: the group's own).
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
    ) -> None:
        self._requested = process_group
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._world_size: int | None = None
        # Filled only with choices that hold on every thread (not the current-device fallback).
        self._comm_devices: dict[torch.device, torch.device] = {}
        self._accelerator: torch.device | None = None  # the scale's, once a ballot was made there
        self._in_flight: _InFlight | None = None
        self._in_flight_lock = threading.Lock()  # the async scaler's two threads both settle

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group given at construction (None: the default group)."""
        return self._requested

    @property
    def world_size(self) -> int:
        """The group's size; 1 when no process group is initialised."""
        if self._world_size is None:
            if self._requested is not None and not isinstance(self._requested, dist.ProcessGroup):
                return 1  # duck-typed (torch's DummyProcessGroup): size 1, checked by the config
            if not (dist.is_available() and dist.is_initialized()):
                if self._requested is not None:
                    raise RuntimeError(
                        "a process_group was given, but torch.distributed is not initialised: "
                        "call torch.distributed.init_process_group() first"
                    )
                return 1
            self._group = self._requested if self._requested is not None else dist.group.WORLD
            self._world_size = dist.get_world_size(self._group)
        return self._world_size

    def comm_device(self, preferred: torch.device) -> torch.device:
        """Where a collective for tensors on `preferred` travels.

        `preferred` itself if the group runs its device type. Otherwise (a CPU-preferred
        collective on an NCCL group: `locate_overflow`'s gathers, `verify_agreement` of a
        CPU state, CPU-offloaded gradients) never trust the current device alone (it is 0 on a
        new thread and in scripts that never call `set_device`): the group's bound device
        (`init_process_group(device_id=...)`), else the scale's device (where this exchange's
        ballots were made), else this thread's current device of the group's type.
        """
        comm = self._comm_devices.get(preferred)
        if comm is not None:
            return comm
        if self.world_size == 1:
            return preferred
        assert self._group is not None  # set by world_size
        device_types = _group_device_types(self._group)
        if preferred.type in device_types:
            comm = preferred
            if preferred.type != "cpu" and self._accelerator is None:
                self._accelerator = preferred
        else:
            bound = _bound_device(self._group)
            seen = self._accelerator
            if bound is not None and bound.type in device_types:
                comm = bound
            elif seen is not None and seen.type in device_types:
                comm = seen
            else:  # known on this thread only: not cached
                return _device_of_type(device_types[0])
        self._comm_devices[preferred] = comm
        return comm

    def compare(self, values: torch.Tensor, names: Sequence[str], step: int) -> None:
        """Check that every rank holds the same `values`, in one all_gather.

        Args:
            values: float64, one per name, on any device (the scale's: no host round trip).
            names: what each value is, for the message.
            step: the step, for the message.

        One device-to-host copy (the gathered rows, read once), nothing else on the host.

        Raises:
            ShardScaleDistributedError: they differ (the message gives every rank's value of
                each field that differs), or a rank did not arrive or left.
        """
        if values.shape != (len(names),):
            raise ValueError(
                f"compare needs one value per name: {len(names)} names, got values of shape "
                f"{tuple(values.shape)}"
            )
        comm = self.comm_device(values.device)
        mine = values.to(device=comm, dtype=torch.float64)
        gathered = torch.empty((self.world_size, len(names)), dtype=torch.float64, device=comm)
        self.collective(
            lambda async_op: dist.all_gather(
                list(gathered.unbind()), mine, group=self._group, async_op=async_op
            ),
            step,
            "their scaler states (verify_agreement's all_gather)",
            device=comm,
        )
        self.settle()
        rows = gathered.cpu()  # the one host transfer
        differing = [i for i in range(len(names)) if not torch.all(rows[:, i] == rows[0, i])]
        if differing:
            details = "; ".join(
                f"{names[i]}: "
                + ", ".join(f"rank {r} = {float(rows[r, i]):g}" for r in range(len(rows)))
                for i in differing
            )
            raise ShardScaleDistributedError(
                f"step {step}: the scaler states of the {len(rows)} ranks differ: {details}"
            )

    def gather_objects(self, obj: object, step: int | None, what: str) -> list[object]:
        """Every rank's `obj` (picklable), in rank order: `all_gather_object`, bounded.

        Two collectives (the sizes, then the padded bytes), each bounded by `timeout`, on
        the group's communication device; two host transfers (the sizes, then every rank's
        bytes at once), whatever the world size.
        """
        if self.world_size == 1:
            return [obj]
        comm = self.comm_device(torch.device("cpu"))
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(comm)
        size = torch.full((1,), data.numel(), dtype=torch.int64, device=comm)
        sizes = torch.empty((self.world_size, 1), dtype=torch.int64, device=comm)
        self.collective(
            lambda async_op: dist.all_gather(
                list(sizes.unbind()), size, group=self._group, async_op=async_op
            ),
            step,
            f"the sizes of {what} (all_gather)",
            device=comm,
        )
        self.settle()
        lengths = [int(n) for n in sizes.reshape(-1).tolist()]  # host transfer 1
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=comm)
        padded[: data.numel()] = data
        gathered = torch.empty((self.world_size, len(padded)), dtype=torch.uint8, device=comm)
        self.collective(
            lambda async_op: dist.all_gather(
                list(gathered.unbind()), padded, group=self._group, async_op=async_op
            ),
            step,
            f"{what} (all_gather)",
            device=comm,
        )
        self.settle()
        rows = gathered.cpu()  # host transfer 2
        return [
            pickle.loads(rows[r, :length].numpy().tobytes()) for r, length in enumerate(lengths)
        ]

    def dedicated(self: _E, backend: str | None = None) -> _E:
        """An exchange like this one (of this class) on a process group of its own, over the
        same ranks.

        For collectives issued from another thread (the async scaler's optimizer thread): a
        group's collectives must come in the same order on every rank, and that thread's would
        race with the model's own.

        Made by the group's members alone (`use_local_synchronization`: a subgroup's scaler
        needs no rank outside it), except where that hangs: when the default group is bound to
        a device (`init_process_group(device_id=...)`) an NCCL group is made by splitting the
        default communicator, which every rank of the default group must join. So then:
        the whole world's group is made by every rank (each builds its scaler), and a proper
        subgroup needs `backend="gloo"` (a gloo group is never split from NCCL's).

        Args:
            backend: the new group's backend; None: this group's.

        Raises:
            ValueError: a proper subgroup, a bound device, and a backend other than gloo.
        """
        if self.world_size == 1:
            return type(self)(self._requested, self.timeout)
        assert self._group is not None  # set by world_size
        ranks = dist.get_process_group_ranks(self._group)
        if backend is None:
            try:
                backend = str(dist.get_backend(self._group))
            except (RuntimeError, ValueError, KeyError, TypeError, AttributeError):
                backend = None  # the default group's, as new_group takes it
        bound = _bound_device(self._group)
        if bound is None or (backend is not None and backend.lower() == "gloo"):
            own = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
        elif len(ranks) == dist.get_world_size():
            own = dist.new_group(ranks, backend=backend)  # every rank is a member and calls it
        else:
            raise ValueError(
                f"the async scaler's own process group for ranks {ranks} cannot be made by "
                f"those ranks alone: the default group is bound to {bound} "
                "(init_process_group(device_id=...)), so a new NCCL group is split from the "
                "default communicator, which every rank must join, and the others never would "
                'have. Pass flag_backend="gloo" (a small gloo group of these ranks for the '
                "overflow flag), or give the scaler the whole world's group"
            )
        return type(self)(own, self.timeout)

    def collective(
        self,
        start: Callable[[bool], dist.Work | None],
        step: int | None,
        what: str,
        *,
        device: torch.device | None = None,
    ) -> None:
        """Run `start(async_op)`, the one place the scaler issues and bounds a collective.

        Args:
            start: issues the collective (asynchronously when told so) and returns its work.
            step: the step, for messages.
            what: what is exchanged, for messages.
            device: where its tensors are. On an accelerator whose backend waits on the device
                (NCCL), with a `timeout`: the stream waits, the host does not; the collective
                stays in flight, bounded at the next collective or `settle()`. Elsewhere (CPU,
                gloo; or None): the host waits here, at most `timeout`.

        Raises:
            ShardScaleDistributedError: a rank did not arrive in time (this collective, or the
                one still in flight before it), or left the group (its connection broke) during
                it; the message names the step of the collective it happened in.
        """
        self.settle()
        on_device = (
            self.timeout is not None
            and device is not None
            and not _waits_on_host(self._group, device)
        )
        enqueued = time.monotonic()
        try:
            work = start(self.timeout is not None)
            if work is None:
                return
            if on_device:
                work.wait()  # the current stream waits for it; the host goes on
                with self._in_flight_lock:
                    self._in_flight = _InFlight(work, enqueued, step, what)
                return
            completed = self.timeout is None or work.wait(self.timeout)
        except RuntimeError as error:
            raise self._failure(error, enqueued, step, what) from error
        if not completed:
            raise self._late(step, what)

    def settle(self) -> None:
        """Bound, on the host, the collective this exchange left in flight on an accelerator.

        Call it before any host read of an agreed value (a decision read, `stats`,
        `state_dict`...): it waits until the collective completes, at most until `timeout`
        after its enqueue, so that the read that follows cannot hang on a rank that never
        came. Free when nothing is in flight (always so on the CPU, on gloo, and without a
        `timeout`).

        Raises:
            ShardScaleDistributedError: that collective's ranks did not all arrive within the
                timeout, or one left; the message names its step.
        """
        with self._in_flight_lock:
            pending, self._in_flight = self._in_flight, None
        if pending is None:
            return
        assert self.timeout is not None  # only then is a collective left in flight
        deadline = pending.enqueued + self.timeout.total_seconds()
        pause = 5e-5
        while not pending.work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                raise self._late(pending.step, pending.what)
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, 1e-3)  # NCCL's own host wait polls every 1 ms
        try:
            pending.work.wait()  # completed: raises what the backend recorded, if anything
        except RuntimeError as error:
            raise self._failure(error, pending.enqueued, pending.step, pending.what) from error

    def read_flag(self, flag: torch.Tensor) -> bool:
        """An agreed flag's value on the host: the one way the scaler reads one.

        Settles the collective in flight first (`settle()`), so the read, a synchronisation on
        an accelerator, is bounded by `timeout` rather than by the backend's own.
        """
        self.settle()
        return bool(flag.item())

    def _failure(
        self, error: RuntimeError, enqueued: float, step: int | None, what: str
    ) -> ShardScaleDistributedError:
        """What `error` means: late (it reports a timeout, or came when the time ran out) or
        a rank gone (the connection broke, or anything else before the time ran out)."""
        waited = time.monotonic() - enqueued
        timed_out = self.timeout is not None and waited >= self.timeout.total_seconds()
        if not _broken_connection(error) and (timed_out or _TIMEOUT_TEXT.search(str(error))):
            return self._late(step, what)
        return ShardScaleDistributedError(
            f"{_at(step)}exchanging {what} with the other {self.world_size - 1} "
            f"rank(s) failed: a rank left the process group ({error})"
        )

    def _late(self, step: int | None, what: str) -> ShardScaleDistributedError:
        waited = (
            f"waited {self.timeout.total_seconds():g} s"
            if self.timeout is not None
            else "waited out the process group's own timeout"
        )
        return ShardScaleDistributedError(
            f"{_at(step)}{waited} for all "
            f"{self.world_size} ranks of the process group to exchange {what}, and at least "
            "one never arrived: it crashed, hung, or took another code path (e.g. skipped "
            "scaler.step(), or stepped another optimizer). The process group cannot be "
            "trusted after this: end the job (torchrun restarts it from the last checkpoint)."
        )


def _at(step: int | None) -> str:
    return "" if step is None else f"step {step}: "
