"""Agreement: the one collective that makes every rank take the same skip/step decision.

(And the rarer ones that check agreement, ``compare``: every collective the scaler issues lives
here, bounded by the same timeout.)

Invariant: every rank of the group sees the same ``found_inf`` before ``optimizer.step()``.

Each rank writes what it saw into ONE small float32 tensor, its *ballot*, on the group's
communication device, and the group runs ONE ``all_reduce`` on it, however many devices,
dtypes and optimizers hold the gradients::

    [holds gradients, overflowed, has a scale, norm share]

* holds gradients: 0 for an empty shard, or a rank that ran no backward;
* overflowed: 1 if an inf or NaN is in this rank's gradients;
* has a scale: 0 for a rank that never called ``scale()`` (a pipeline stage before the last),
  until the group has confirmed that some rank does;
* norm share: this rank's part of a global gradient norm (``clip_grad_norm_`` only).

The reduction is MAX, or SUM when a finite p-norm travels (its shares add up; the flags then
count, and ``found_inf = min(overflowed, 1)``). Either way ``found_inf`` is exactly 0.0 or 1.0:
torch's fused optimizers skip only when ``found_inf == 1.0``, so a summed flag of 2.0 (two ranks
overflowed) would make them step with inf gradients.

Only a rank that lacks something reads the result on the host (one synchronisation): a rank
without gradients asks whether anybody had some (nobody: an error on every rank together), a rank
that never scaled asks whether anybody did. Ranks that hold gradients and a scale never wait for
the host.

Without an initialised process group, or with a world size of 1, no collective is issued.

With a ``timeout``, a rank that never arrives (it crashed, hung, or took another code path) makes
the others raise ``ShardScaleDistributedError`` within that time instead of waiting out the
process group's own timeout (30 minutes by default).
"""

from __future__ import annotations

import functools
import math
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardscale._devices import move
from shardscale._errors import ShardScaleDistributedError, no_scale_message

__all__ = ["Agreement", "Ballot", "Verdict"]

_NO_GRADS = (
    "No inf checks were recorded for this optimizer: none of its parameters has a gradient "
    "on any of the {world_size} rank(s). Call scaler.scale(loss).backward() before step()."
)
_HOLDS, _OVERFLOWED, _SCALED, _NORM = range(4)


@dataclass(frozen=True, slots=True)
class Ballot:
    """What this rank puts into the collective: ``[holds, overflowed, has a scale, norm]``."""

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


def _group_device_types(group: dist.ProcessGroup) -> list[str]:
    """The device types ``group`` can run collectives on, in its backend's order."""
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
            looked up at the first step so a scaler may be built before ``init_process_group``.
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
    ) -> None:
        self._requested = process_group
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._world_size: int | None = None
        self._comm_devices: dict[torch.device, torch.device] = {}

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
        """Where the flag tensor travels: ``preferred`` if the group supports its type.

        With NCCL and CPU-offloaded gradients, that is the current CUDA device.
        """
        comm = self._comm_devices.get(preferred)
        if comm is None:
            comm = preferred
            if self.world_size > 1:
                assert self._group is not None  # set by world_size
                device_types = _group_device_types(self._group)
                if preferred.type not in device_types:
                    comm = _device_of_type(device_types[0])
            self._comm_devices[preferred] = comm
        return comm

    def ballot(
        self, device: torch.device, *, holds_grads: bool, has_scale: bool, with_norm: bool = False
    ) -> Ballot:
        """A fresh ballot on the communication device for ``device``, overflow slot at 0.

        The local check raises the overflow slot itself (:meth:`Ballot.flags`), so the flag of
        gradients on that device costs no extra kernel. One copy kernel, no host transfer.
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
            ballot: from :meth:`ballot`, its overflow slot raised by the local check where the
                gradients are on its device.
            local_flags: float32 scalar flags of local checks, on any device (1.0: an element
                was non-finite): those of other devices than the ballot's, and of checks made
                before the ballot (``unscale_``); the ballot's own slot may be among them.
            device: the scale's device, where the verdict's tensors are returned.
            step: the step being taken, for error messages.
            confirm_scale: the method being called (``"step"``...) on a rank that never called
                ``scale()``, until the group confirms that some rank did (its ballot says it has
                no scale); None otherwise.
            norm_share: this rank's share of a gradient norm (``_clip.local_norms``), to travel
                in the same collective (the ballot was made ``with_norm``). It must be
                non-finite wherever the ballot's own slot was raised (the check of the norms
                raises it); flags from other checks (``local_flags``) make it inf here.
            norm_type: that norm's p (inf: the shares combine by max).

        Raises:
            RuntimeError: no rank holds any gradient, or (``confirm_scale``) no rank ever called
                ``scale()``: every rank raises together, torch's words.
            ShardScaleDistributedError: a rank did not arrive within ``timeout``, or left.
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
            )
        if confirm_scale is not None or not ballot.holds_grads:  # the one host read, these only
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

    def compare(self, fields: Mapping[str, float], device: torch.device, step: int) -> None:
        """Check that every rank holds the same ``fields``, in one all_gather.

        Raises:
            ShardScaleDistributedError: they differ (the message gives every rank's value of
                each field that differs), or a rank did not arrive or left.
        """
        names = list(fields)
        comm = self.comm_device(device)
        mine = torch.tensor([float(fields[n]) for n in names], dtype=torch.float64, device=comm)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.collective(
            lambda async_op: dist.all_gather(gathered, mine, group=self._group, async_op=async_op),
            step,
            "their scaler states (verify_agreement's all_gather)",
        )
        rows = torch.stack(gathered).cpu()
        differing = [i for i in range(len(names)) if not torch.all(rows[:, i] == rows[0, i])]
        if differing:
            details = "; ".join(
                f"{names[i]}: "
                + ", ".join(f"rank {r} = {rows[r, i].item():g}" for r in range(len(gathered)))
                for i in differing
            )
            raise ShardScaleDistributedError(
                f"step {step}: the scaler states of the {len(gathered)} ranks differ: {details}"
            )

    def gather_objects(self, obj: object, step: int | None, what: str) -> list[object]:
        """Every rank's ``obj`` (picklable), in rank order: ``all_gather_object``, bounded.

        Two collectives (the sizes, then the padded bytes), each waited on at most ``timeout``,
        on the group's communication device.
        """
        if self.world_size == 1:
            return [obj]
        comm = self.comm_device(torch.device("cpu"))
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(comm)
        size = torch.full((1,), data.numel(), dtype=torch.int64, device=comm)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        self.collective(
            lambda async_op: dist.all_gather(sizes, size, group=self._group, async_op=async_op),
            step,
            f"the sizes of {what} (all_gather)",
        )
        lengths = [int(n.item()) for n in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=comm)
        padded[: data.numel()] = data
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.collective(
            lambda async_op: dist.all_gather(
                gathered, padded, group=self._group, async_op=async_op
            ),
            step,
            f"{what} (all_gather)",
        )
        return [
            pickle.loads(bytes(chunk[:length].cpu().tolist()))
            for chunk, length in zip(gathered, lengths, strict=True)
        ]

    def dedicated(self) -> Agreement:
        """An agreement like this one on a process group of its own, made by the group's
        members alone (a subgroup's scaler needs no rank outside it).

        For collectives issued from another thread (the async scaler's optimizer thread): a
        group's collectives must come in the same order on every rank, and that thread's would
        race with the model's own.
        """
        if self.world_size == 1:
            return Agreement(self._requested, self.timeout)
        assert self._group is not None  # set by world_size
        ranks = dist.get_process_group_ranks(self._group)
        own = dist.new_group(ranks, use_local_synchronization=True)
        return Agreement(own, self.timeout)

    def collective(
        self, start: Callable[[bool], dist.Work | None], step: int | None, what: str
    ) -> None:
        """Run ``start(async_op)`` and wait for it, at most ``timeout``.

        Raises:
            ShardScaleDistributedError: a rank did not arrive in time, or left the group (its
                connection broke) during the collective; the message names the step.
        """
        try:
            work = start(self.timeout is not None)
            completed = work is None or self.timeout is None or work.wait(self.timeout)
        except RuntimeError as error:
            if "timed out" not in str(error).lower():
                raise ShardScaleDistributedError(
                    f"{_at(step)}exchanging {what} with the other {self.world_size - 1} "
                    f"rank(s) failed: a rank left the process group ({error})"
                ) from error
            completed = False
        if not completed:
            assert self.timeout is not None
            raise ShardScaleDistributedError(
                f"{_at(step)}waited {self.timeout.total_seconds():g} s for all "
                f"{self.world_size} ranks of the process group to exchange {what}, and at least "
                "one never arrived: it crashed, hung, or took another code path (e.g. skipped "
                "scaler.step(), or stepped another optimizer). The process group cannot be "
                "trusted after this: end the job (torchrun restarts it from the last checkpoint)."
            )


def _at(step: int | None) -> str:
    return "" if step is None else f"step {step}: "


@functools.cache
def _ballot_template(
    device: torch.device, holds_grads: bool, has_scale: bool, with_norm: bool
) -> torch.Tensor:
    values = [float(holds_grads), 0.0, float(has_scale)] + ([0.0] if with_norm else [])
    return torch.tensor(values, dtype=torch.float32, device=device)
