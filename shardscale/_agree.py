"""Agreement: the one collective that makes every rank take the same skip/step decision.

(And the rarer ones that check agreement, `compare`: every collective the scaler issues lives
here, bounded by the same timeout.)

Invariant: every rank of the group sees the same `found_inf` before `optimizer.step()`.

Each rank writes what it saw into ONE small float32 tensor, its *ballot*, on the group's
communication device, and the group runs ONE `all_reduce` on it, however many devices,
dtypes and optimizers hold the gradients:

```text
[holds gradients, overflowed, has a scale, norm share]
```

* holds gradients: 0 for an empty shard, or a rank that ran no backward;
* overflowed: 1 if an inf or NaN is in this rank's gradients;
* has a scale: 0 for a rank that never called `scale()` (a pipeline stage before the last),
  until the group has confirmed that some rank does;
* norm share: this rank's part of a global gradient norm (`clip_grad_norm_` only).

The reduction is MAX, or SUM when a finite p-norm travels (its shares add up; the flags then
count, and `found_inf = min(overflowed, 1)`). Either way `found_inf` is exactly 0.0 or 1.0:
torch's fused optimizers skip only when `found_inf == 1.0`, so a summed flag of 2.0 (two ranks
overflowed) would make them step with inf gradients.

Only a rank that lacks something reads the result on the host (one synchronisation): a rank
without gradients asks whether anybody had some (nobody: an error on every rank together), a rank
that never scaled asks whether anybody did. Ranks that hold gradients and a scale never wait for
the host.

Without an initialised process group, or with a world size of 1, no collective is issued.

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
enforced at this agreement's next collective or at `settle()`, which every host read of an
agreed value calls first.
"""

from __future__ import annotations

import functools
import math
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardscale._checkpoint import Counters, ScalerState, to_state_dict
from shardscale._device_state import DeviceState
from shardscale._devices import move
from shardscale._errors import ShardScaleDistributedError, no_scale_message
from shardscale._policy import ScalePolicy, ScaleState

__all__ = ["Agreement", "Ballot", "Verdict", "state_fields"]

_NO_GRADS = (
    "No inf checks were recorded for this optimizer: none of its parameters has a gradient "
    "on any of the {world_size} rank(s). Call scaler.scale(loss).backward() before step()."
)
_HOLDS, _OVERFLOWED, _SCALED, _NORM = range(4)


@dataclass(frozen=True, slots=True)
class Ballot:
    """What this rank puts into the collective: `[holds, overflowed, has a scale, norm]`."""

    tensor: torch.Tensor
    holds_grads: bool
    """What the holds slot says, known on the host (a rank without gradients reads the result)."""

    def flags(self) -> dict[torch.device, torch.Tensor]:
        """Flags for the local check: its overflow slot, for gradients on the ballot's device."""
        return {self.tensor.device: self.tensor[_OVERFLOWED]}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the group agreed on, identical on every rank."""

    found_inf: torch.Tensor
    """float32 scalar on the scale's device: 1.0 if any rank overflowed, else 0.0."""
    total_norm: torch.Tensor | None = None
    """The global gradient norm (float32 scalar), when one was exchanged; non-finite on every
    rank when any rank overflowed."""


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


class Agreement:
    """The process group a scaler agrees over, and the one collective it runs per step.

    Args:
        process_group: the group whose ranks must agree; None means the default (world) group,
            looked up at the first step so a scaler may be built before `init_process_group`.
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
        (`init_process_group(device_id=...)`), else the scale's device (where this agreement's
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

    def ballot(
        self, device: torch.device, *, holds_grads: bool, has_scale: bool, with_norm: bool = False
    ) -> Ballot:
        """A fresh ballot on the communication device for `device`, overflow slot at 0.

        The local check raises the overflow slot itself ([`Ballot.flags()`][Ballot.flags]), so the
        flag of gradients on that device costs no extra kernel. One copy kernel, no host transfer.
        """
        comm = self.comm_device(device)
        template = _ballot_template(comm, holds_grads, has_scale, with_norm)
        return Ballot(template.clone(), holds_grads)

    def agree(
        self,
        ballot: Ballot,
        local_flags: Iterable[torch.Tensor],
        *,
        device: torch.device,
        step: int,
        confirm_scale: str | None = None,
        norm_share: torch.Tensor | None = None,
        norm_type: float = 2.0,
    ) -> Verdict:
        """Combine this rank's ballot with every other rank's, in one collective.

        Args:
            ballot: from [`ballot()`][ballot], its overflow slot raised by the local check where the
                gradients are on its device.
            local_flags: float32 scalar flags of local checks, on any device (1.0: an element
                was non-finite): those of other devices than the ballot's, and of checks made
                before the ballot (`unscale_`); the ballot's own slot may be among them.
            device: the scale's device, where the verdict's tensors are returned.
            step: the step being taken, for error messages.
            confirm_scale: the method being called (`"step"`...) on a rank that never called
                `scale()`, until the group confirms that some rank did (its ballot says it has
                no scale); None otherwise.
            norm_share: this rank's share of a gradient norm (`_clip.local_norms`), to travel
                in the same collective (the ballot was made `with_norm`). It must be
                non-finite wherever the ballot's own slot was raised (the check of the norms
                raises it); flags from other checks (`local_flags`) make it inf here.
            norm_type: that norm's p (inf: the shares combine by max).

        Raises:
            RuntimeError: no rank holds any gradient, or (`confirm_scale`) no rank ever called
                `scale()`: every rank raises together, torch's words.
            ShardScaleDistributedError: a rank did not arrive within `timeout`, or left.
        """
        votes = ballot.tensor
        slot = votes[_OVERFLOWED]
        # The slot itself, told by being a view of the ballot at its offset (not by data_ptr:
        # on the meta device, the CPU suite's stand-in for a GPU, every data_ptr is 0).
        others = [
            flag
            for flag in local_flags
            if not (flag._base is votes and flag.storage_offset() == slot.storage_offset())
        ]
        for flag in others:  # one kernel per other flag (devices, earlier checks), not per grad
            torch.maximum(slot, move(flag, votes.device), out=slot)
        if norm_share is not None:
            share = move(norm_share, votes.device)
            if others or math.isinf(norm_type):
                # A flag that is not the norms' own (or a max, which NCCL may take NaN-blind)
                # must still show in the norm: this share goes in as inf. Otherwise the slot
                # was raised only where a norm was non-finite, so the share already is.
                share = torch.where(slot > 0, math.inf, share)
            votes[_NORM].copy_(share)
        summed = norm_share is not None and not math.isinf(norm_type)
        if self.world_size > 1:
            op = dist.ReduceOp.SUM if summed else dist.ReduceOp.MAX
            what = "the overflow flag" + (" and gradient norm" if norm_share is not None else "")
            self.collective(
                lambda async_op: dist.all_reduce(
                    votes, op=op, group=self._group, async_op=async_op
                ),
                step,
                f"{what} (all_reduce)",
                device=votes.device,
            )
        if confirm_scale is not None or not ballot.holds_grads:  # the one host read, these only
            self.settle()
            agreed = votes.tolist()
            if confirm_scale is not None and agreed[_SCALED] == 0.0:
                raise RuntimeError(no_scale_message(confirm_scale))
            if agreed[_HOLDS] == 0.0:
                raise RuntimeError(_NO_GRADS.format(world_size=self.world_size))
        found_inf = votes[_OVERFLOWED]
        if summed:
            found_inf = found_inf.clamp(max=1.0)  # a count of ranks: exactly 0/1 after this
        if norm_share is None:
            return Verdict(found_inf=move(found_inf, device))
        total = votes[_NORM]
        if summed and norm_type != 1.0:
            total = total.pow(1.0 / norm_type)
        # An overflow shows in the norm on every rank: the overflowing rank's share was
        # non-finite (see above), and a sum or max with it is too.
        return Verdict(found_inf=move(found_inf, device), total_norm=move(total, device))

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

    def dedicated(self, backend: str | None = None) -> Agreement:
        """An agreement like this one on a process group of its own, over the same ranks.

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
            return Agreement(self._requested, self.timeout)
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
        return Agreement(own, self.timeout)

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
        """Bound, on the host, the collective this agreement left in flight on an accelerator.

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


_DEVICE_FIELDS = (
    "scale",
    "_growth_tracker",
    "_hysteresis_tracker",
    "steps",
    "skipped_steps",
    "consecutive_skips",
    "last_overflow_step",
)
"""The state-dict fields a `DeviceState` holds, in the order `state_fields` builds them."""


def state_fields(
    state: ScalerState | DeviceState, policy: ScalePolicy
) -> tuple[list[str], torch.Tensor]:
    """The scaler state's fields for `Agreement.compare`: names as in the state dict, and
    their values as one float64 tensor where the state lives.

    A `DeviceState` is never read on the host: its fields are computed on its device (the
    policy's settings join as a constant made there once), so `verify_agreement` pays one host
    transfer in all, the comparison's.
    """
    if isinstance(state, ScalerState):
        host = to_state_dict(state)
        return list(host), torch.tensor([float(v) for v in host.values()], dtype=torch.float64)
    settings = to_state_dict(
        ScalerState(
            policy=policy,
            scale=ScaleState(scale=1.0, growth_tracker=0, hysteresis_tracker=0),
            counters=Counters(),
        )
    )
    names = tuple(settings)
    packed = state.packed()  # [scale, growth, hysteresis, steps, skipped, consecutive, since]
    steps, skipped, since = packed[3], packed[4], packed[6]
    last_overflow = torch.where(skipped > 0, steps - since, torch.zeros_like(steps))
    constants, order = _settings_on(
        packed.device, names, tuple(float(settings[n]) for n in names if n not in _DEVICE_FIELDS)
    )
    return list(names), torch.cat((packed[:6], last_overflow.reshape(1), constants))[order]


@functools.cache
def _settings_on(
    device: torch.device, names: tuple[str, ...], settings: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's settings as a tensor on `device`, and the index that puts the device
    fields and the settings into `names`' order: made once per device and policy."""
    built = [*_DEVICE_FIELDS, *(n for n in names if n not in _DEVICE_FIELDS)]
    order = [built.index(n) for n in names]
    return (
        torch.tensor(settings, dtype=torch.float64, device=device),
        torch.tensor(order, dtype=torch.int64, device=device),
    )


@functools.cache
def _ballot_template(
    device: torch.device, holds_grads: bool, has_scale: bool, with_norm: bool
) -> torch.Tensor:
    values = [float(holds_grads), 0.0, float(has_scale)] + ([0.0] if with_norm else [])
    return torch.tensor(values, dtype=torch.float32, device=device)
