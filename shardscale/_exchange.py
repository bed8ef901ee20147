"""The exchange: the process group a scaler agrees over, and every collective the scaler runs
on it (the agreement's one all-reduce, the gathers of `verify_agreement` and `locate_overflow`,
the async scaler's own group), each bounded, each failure reported as what it is.

What travels is its callers' business: the agreement's ballot and what the group agreed are
`shardscale._check`'s; here a collective is only issued, waited for and named in its errors.
Without an initialised process group, or at world size 1, no collective is issued.

How long a collective may wait for a rank that never arrives: on the CPU and on backends that
stage through the host (gloo), the host waits at most `timeout` (`sync_timeout`), then raises
[`ShardScaleDistributedError`][] naming the step and what happened: *late* (the wait ran out, or
the backend reports a timeout) or *gone* (the connection broke). On NCCL the host does not wait
at all (the stream does), and the bound is the process group's own timeout
(`init_process_group(timeout=...)`), which NCCL's watchdog enforces: it aborts the collective and
frees the GPU, which no wait on the host can (`sync_timeout` warns there, once, and is not
applied). The async scaler's own group is made with `timeout=sync_timeout`, so its watchdog
enforces it.
"""

from __future__ import annotations

import pickle
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from shardscale._errors import ShardScaleDistributedError, ShardScaleWarning
from shardscale._torch import group_device_types

# A backend reporting a timeout: gloo's "Timed out waiting", NCCL's "Watchdog caught collective
# operation timeout" (not the "Timeout(ms)=..." NCCL prints in every work's name).
_TIMED_OUT = re.compile(r"timed out|timeout(?!\s*\(ms\))", re.IGNORECASE)
_BROKEN = re.compile(r"connection (reset|closed|refused)|broken pipe", re.IGNORECASE)
# torch's own check of every collective (TORCH_DISTRIBUTED_DEBUG=DETAIL) found ranks issuing
# different ones: they took different code paths, which no waiting fixes.
_MISMATCH = re.compile(r"mismatch between collectives", re.IGNORECASE)


def _bound_device(group: dist.ProcessGroup) -> torch.device | None:
    """The accelerator `group` (or the default group, whose binding new groups inherit) is
    bound to by `init_process_group(device_id=...)`: where its communicator lives."""
    for candidate in (group, dist.group.WORLD if dist.is_available() else None):
        bound = getattr(candidate, "bound_device_id", None)
        if bound is not None:
            return torch.device(bound)
    return None


def _backend(group: dist.ProcessGroup | None, device_type: str | None = None) -> str | None:
    """The backend `group` runs `device_type`'s collectives on (None: it cannot be asked);
    without a `device_type`, the group's whole backend string."""
    try:
        backend = str(dist.get_backend(group)).lower()  # "nccl", "cpu:gloo,cuda:nccl", ...
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if ":" in backend and device_type is not None:
        return dict(pair.split(":", 1) for pair in backend.split(",")).get(device_type, backend)
    return backend


class Exchange:
    """The process group a scaler agrees over, and every collective it runs on it, bounded.

    Args:
        process_group: the group whose ranks must agree; None means the default (world) group,
            looked up at the first step so a scaler may be built before `init_process_group`.
        timeout: the longest the host waits for the other ranks at a collective on the CPU or
            gloo (None: the group's own timeout).
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
    ) -> None:
        self.process_group = process_group
        """The group given at construction (None: the default group)."""
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._world_size: int | None = None
        # Filled only with choices that hold on every thread (not the current-device fallback).
        self._comm_devices: dict[torch.device, torch.device] = {}
        self._accelerator: torch.device | None = None  # the scale's, once a ballot was made there
        self._host_waits: dict[torch.device, bool] = {}

    @property
    def world_size(self) -> int:
        """The group's size; 1 when no process group is initialised."""
        if self._world_size is None:
            requested = self.process_group
            if requested is not None and not isinstance(requested, dist.ProcessGroup):
                return 1  # duck-typed (torch's DummyProcessGroup): size 1, checked by the config
            if not (dist.is_available() and dist.is_initialized()):
                if requested is not None:
                    raise RuntimeError(
                        "a process_group was given, but torch.distributed is not initialised: "
                        "call torch.distributed.init_process_group() first"
                    )
                return 1
            self._group = requested if requested is not None else dist.group.WORLD
            self._world_size = dist.get_world_size(self._group)
        return self._world_size

    @property
    def rank(self) -> int:
        """This rank's place in the group (0 without a process group)."""
        if self.world_size == 1 or self._group is None:
            return 0
        return dist.get_group_rank(self._group, dist.get_rank())

    def comm_device(self, preferred: torch.device) -> torch.device:
        """Where a collective for tensors on `preferred` travels.

        `preferred` itself if the group runs its device type. Otherwise (a CPU-preferred
        collective on an NCCL group: `locate_overflow`'s gathers, `verify_agreement` of a
        CPU state, CPU-offloaded gradients) never trust the current device alone (it is 0 on a
        new thread and in scripts that never call `set_device`): the group's bound device
        (`init_process_group(device_id=...)`), else the scale's device (the first accelerator a
        collective was asked for here: the agreement's ballot is made on it), else this thread's
        current device of the group's type.
        """
        comm = self._comm_devices.get(preferred)
        if comm is not None:
            return comm
        if self.world_size == 1 or self._group is None:
            return preferred
        device_types = group_device_types(self._group)
        if preferred.type in device_types:
            comm = preferred
            if preferred.type != "cpu" and self._accelerator is None:
                self._accelerator = preferred
        else:
            known = (_bound_device(self._group), self._accelerator)
            comm = next((d for d in known if d is not None and d.type in device_types), None)
            if comm is None and device_types[0] == "cpu":
                return torch.device("cpu")
            if comm is None:  # this thread's current device: known on this thread only, not cached
                module = torch.get_device_module(device_types[0])
                return torch.device(device_types[0], module.current_device())
        self._comm_devices[preferred] = comm
        return comm

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, step: int, what: str
    ) -> None:
        """Reduce `tensor` in place over the group with `op`, bounded: the agreement's one
        collective (`what` names what it carries, in the errors).

        Raises:
            ShardScaleDistributedError: a rank did not arrive within `timeout`, or left.
        """
        self._collective(dist.all_reduce, tensor, step, f"{what} (all_reduce)", op=op)

    def compare(self, values: torch.Tensor, names: Sequence[str], step: int) -> None:
        """Check that every rank holds the same `values` (float64, one per name), in one
        all_gather and one host transfer.

        Raises:
            ShardScaleDistributedError: they differ (the message gives every rank's value of
                each field that differs), or a rank did not arrive or left.
        """
        values = values.to(device=self.comm_device(values.device), dtype=torch.float64)
        rows = self._all_gather(values, step, "their scaler states (verify_agreement's all_gather)")
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

    def gather_objects(
        self, obj: object, step: int | None, what: str, near: Iterable[torch.device] = ()
    ) -> list[object]:
        """Every rank's `obj` (picklable), in rank order: `all_gather_object`, bounded.

        Two collectives (the sizes, then the padded bytes), each bounded like the agreement, on
        the group's communication device for the first accelerator among `near` (the devices
        of the tensors `obj` describes: this rank's own, never the current device's guess), else
        for the CPU; two host transfers, whatever the world size. Not torch's
        `all_gather_object`, which does the same two collectives: it cannot be bounded (it
        waits synchronously, for the group's own timeout, 30 minutes by default on gloo), and
        on an accelerator backend it gathers on the current device, the guess `near` avoids.
        """
        if self.world_size == 1:
            return [obj]
        cpu = torch.device("cpu")
        comm = self.comm_device(next((d for d in near if d.type != "cpu"), cpu))
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(comm)
        size = torch.full((1,), data.numel(), dtype=torch.int64, device=comm)
        lengths = self._all_gather(size, step, f"the sizes of {what}").reshape(-1).tolist()
        padded = torch.zeros(int(max(lengths)), dtype=torch.uint8, device=comm)
        padded[: data.numel()] = data
        rows = self._all_gather(padded, step, what)
        return [pickle.loads(rows[r, : int(n)].numpy().tobytes()) for r, n in enumerate(lengths)]

    def _all_gather(self, mine: torch.Tensor, step: int | None, what: str) -> torch.Tensor:
        """Every rank's `mine` (1-D, one size everywhere), as the rows of one host tensor."""
        gathered = mine.new_empty((self.world_size, mine.numel()))
        rows = list(gathered.unbind())
        self._collective(dist.all_gather, rows, step, f"{what} (all_gather)", mine.reshape(-1))
        return gathered.cpu()  # the one host transfer

    def dedicated(self, backend: str | None = None) -> dist.ProcessGroup | None:
        """A process group of its own over this group's ranks, bounded by `timeout` (None at
        world size 1, where no collective runs).

        For collectives issued from another thread (the async scaler's optimizer thread): a
        group's collectives must come in the same order on every rank, and that thread's would
        race with the model's. Its NCCL watchdog enforces `timeout` (torch's default otherwise).

        Made by the group's members alone (`use_local_synchronization`: a subgroup's scaler
        needs no rank outside it), except where that hangs: when the default group is bound to
        a device (`init_process_group(device_id=...)`) an NCCL group is made by splitting the
        default communicator, which every rank of the default group must join. So then:
        the whole world's group is made by every rank (each builds its scaler), and a proper
        subgroup needs `backend="gloo"` (a gloo group is never split from NCCL's).

        Raises:
            ValueError: a proper subgroup, a bound device, and a backend other than gloo.
        """
        if self.world_size == 1 or self._group is None:
            return None
        ranks = dist.get_process_group_ranks(self._group)
        if backend is None:  # stays None where it cannot be asked: new_group takes the default's
            backend = _backend(self._group)
        bound = _bound_device(self._group)
        local = bound is None or (backend is not None and backend.lower() == "gloo")
        if local or len(ranks) == dist.get_world_size():  # else every rank is a member
            group = dist.new_group(
                ranks, backend=backend, timeout=self.timeout, use_local_synchronization=local
            )
            return cast(dist.ProcessGroup, group)
        raise ValueError(
            f"the async scaler's own process group for ranks {ranks} cannot be made by "
            f"those ranks alone: the default group is bound to {bound} "
            "(init_process_group(device_id=...)), so a new NCCL group is split from the "
            "default communicator, which every rank must join, and the others never would "
            'have. Pass flag_backend="gloo" (a small gloo group of these ranks for the '
            "overflow flag), or give the scaler the whole world's group"
        )

    def _collective(
        self,
        collective: Callable[..., dist.Work | None],
        tensor: torch.Tensor | list[torch.Tensor],
        step: int | None,
        what: str,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Run `collective(tensor, *args, ...)` on the group: the one place the scaler issues
        and bounds a collective.

        Where the backend waits on the host (the CPU, gloo), the host waits here at most
        `timeout`. On NCCL nothing waits on the host; the group's own timeout bounds it.

        Raises:
            ShardScaleDistributedError: a rank did not arrive in time, or left (its connection
                broke), or (under `TORCH_DISTRIBUTED_DEBUG=DETAIL`) issued another collective;
                the message names the step.
        """
        device = (tensor[0] if isinstance(tensor, list) else tensor).device
        waits = self._host_waits.get(device)
        if waits is None:
            waits = self._host_waits[device] = self._waits_on_host(device)
        bounded = waits and self.timeout is not None
        enqueued = time.monotonic()
        try:
            work = collective(tensor, *args, group=self._group, async_op=bounded, **kwargs)
            completed = work is None or not bounded or work.wait(cast(timedelta, self.timeout))
        except RuntimeError as error:
            # Late or gone, by the clock and by what the backend says, not by one wording.
            waited = time.monotonic() - enqueued
            timed_out = self.timeout is not None and waited >= self.timeout.total_seconds()
            broken = isinstance(error, dist.DistNetworkError) or _BROKEN.search(str(error))
            if not broken and (timed_out or _TIMED_OUT.search(str(error))):
                raise self._late(step, what) from error
            if _MISMATCH.search(str(error)):
                raise ShardScaleDistributedError(
                    f"{_at(step)}the ranks issued different collectives where this one issued "
                    f"{what}: they took different code paths ({error})"
                ) from error
            raise ShardScaleDistributedError(
                f"{_at(step)}exchanging {what} with the other {self.world_size - 1} "
                f"rank(s) failed: a rank left the process group ({error})"
            ) from error
        if not completed:
            raise self._late(step, what)

    def _waits_on_host(self, device: torch.device) -> bool:
        """Whether the group's collectives on `device` wait on the host (the CPU, gloo, MPI:
        `sync_timeout` bounds them there) or on a stream (NCCL: the group's own timeout does;
        a `sync_timeout` given warns, once)."""
        backend = _backend(self._group, device.type)
        waits = device.type == "cpu" or backend in (None, "gloo", "mpi")
        if not waits and self.timeout is not None:
            warnings.warn(
                f"sync_timeout={self.timeout.total_seconds():g} s is not applied to the "
                f"{backend} collectives on {device}: there the process group's own timeout "
                "(init_process_group(timeout=...)) bounds them, enforced by its watchdog, "
                "which frees the GPU (docs/reliability.md)",
                ShardScaleWarning,
                stacklevel=3,
            )
        return waits

    def _late(self, step: int | None, what: str) -> ShardScaleDistributedError:
        waited = "waited out the process group's own timeout"
        if self.timeout is not None:
            waited = f"waited {self.timeout.total_seconds():g} s"
        return ShardScaleDistributedError(
            f"{_at(step)}{waited} for all "
            f"{self.world_size} ranks of the process group to exchange {what}, and at least "
            "one never arrived: it crashed, hung, or took another code path (e.g. skipped "
            "scaler.step(), or stepped another optimizer). The process group cannot be "
            "trusted after this: end the job (torchrun restarts it from the last checkpoint)."
        )


def _at(step: int | None) -> str:
    return "" if step is None else f"step {step}: "
