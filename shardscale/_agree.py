"""Agreement: the one collective that makes every rank take the same skip/step decision.

(And the rarer ones that check agreement, ``compare``: every collective the scaler issues lives
here, bounded by the same timeout.)

Invariant: every rank of the group sees the same ``found_inf`` before ``optimizer.step()``.

Each rank folds its per-device flags into ONE float32 scalar on the group's communication
device, and the group runs ONE ``all_reduce(MAX)`` on it, however many devices and dtypes hold
the gradients. The scalar says what the rank saw:

* 0: no gradient element at all (an empty shard, or no backward on this rank);
* 1: gradients, all finite;
* 2: an inf or NaN in this rank's gradients.

After the reduction, 0 means nobody ran backward (an error on every rank together); otherwise
``found_inf = value - 1`` is exactly 0.0 or 1.0. Exactly: torch's fused optimizers skip
only when ``found_inf == 1.0``, so a summed flag of 2.0 (two ranks overflowed) would make them
step with inf gradients.

Without an initialised process group, or with a world size of 1, no collective is issued.

With a ``timeout``, a rank that never arrives (it crashed, hung, or took another code path) makes
the others raise ``ShardScaleDistributedError`` within that time instead of waiting out the
process group's own timeout (30 minutes by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from shardscale._devices import move
from shardscale._errors import ShardScaleDistributedError

__all__ = ["Agreement"]

_NO_GRADS = (
    "No inf checks were recorded for this optimizer: none of its parameters has a gradient "
    "on any of the {world_size} rank(s). Call scaler.scale(loss).backward() before step()."
)


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

    def agree(
        self, local_flags: list[torch.Tensor], holds_grads: bool, device: torch.device, step: int
    ) -> torch.Tensor:
        """Combine this rank's per-device flags with every other rank's, in one collective.

        Args:
            local_flags: float32 scalar flags from the local check, one per device holding
                gradients (the caller's own tensors: they may be modified).
            holds_grads: whether this rank holds any gradient element.
            device: the scale's device, where the agreed ``found_inf`` is returned.
            step: the step being taken, for error messages.

        Returns:
            ``found_inf``: a float32 scalar on ``device``, 1.0 if any rank overflowed, else 0.0.

        Raises:
            RuntimeError: no rank holds any gradient (every rank raises together).
            ShardScaleDistributedError: a rank did not arrive within ``timeout``, or left.
        """
        world_size = self.world_size
        if world_size == 1:
            if not holds_grads:
                raise RuntimeError(_NO_GRADS.format(world_size=1))
            return self._local_max(local_flags, device)

        comm = self.comm_device(device)
        if holds_grads:
            flag = self._local_max(local_flags, comm).add_(1.0)
        else:
            flag = torch.zeros((), dtype=torch.float32, device=comm)
        self.collective(
            lambda async_op: dist.all_reduce(
                flag, op=dist.ReduceOp.MAX, group=self._group, async_op=async_op
            ),
            step,
            "the overflow flag (all_reduce)",
        )
        # Only a rank with nothing to check asks whether anybody had something: the host sync
        # stays off the path of the ranks that hold gradients.
        if not holds_grads and flag.item() == 0.0:
            raise RuntimeError(_NO_GRADS.format(world_size=world_size))
        # Some rank held gradients, so the maximum is 1 or 2: found_inf is exactly 0.0 or 1.0.
        return move(flag.sub_(1.0), device)

    def agree_with_norm(
        self,
        local_flags: list[torch.Tensor],
        holds_grads: bool,
        norm_power: torch.Tensor,
        norm_type: float,
        device: torch.device,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`agree`, carrying a gradient norm's partial sums in the same collective.

        The payload is ``[holds gradients, overflowed, norm_power]``: SUMmed for a finite
        p-norm (the flags become counts; ``found_inf = overflowed > 0`` stays exactly 0/1), and
        MAXed for the inf-norm, whose partial results combine by max.

        Args:
            norm_power: this rank's float32 share (``_clip.local_norm_power``).

        Returns:
            ``(found_inf, total_norm)`` on ``device``. ``total_norm`` is non-finite on every
            rank when any rank overflowed.
        """
        comm = self.comm_device(device)
        overflowed = self._local_max(local_flags, comm) if local_flags else _zero(comm)
        payload = torch.stack(
            (_zero(comm).add_(1.0 if holds_grads else 0.0), overflowed, move(norm_power, comm))
        )
        if self.world_size > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            self.collective(
                lambda async_op: dist.all_reduce(
                    payload, op=op, group=self._group, async_op=async_op
                ),
                step,
                "the overflow flag and gradient norm (all_reduce)",
            )
        if not holds_grads and payload[0].item() == 0.0:  # only ranks without gradients ask
            raise RuntimeError(_NO_GRADS.format(world_size=self.world_size))
        found_inf = (payload[1] > 0).float()
        total = payload[2] if math.isinf(norm_type) else payload[2].pow(1.0 / norm_type)
        # An overflow must show in the norm on every rank, whatever the sums made of it.
        total = torch.where(
            (found_inf > 0) & total.isfinite(), torch.full_like(total, math.inf), total
        )
        return move(found_inf, device), move(total, device)

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

    def collective(self, start: Callable[[bool], dist.Work | None], step: int, what: str) -> None:
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
                    f"step {step}: exchanging {what} with the other {self.world_size - 1} "
                    f"rank(s) failed: a rank left the process group ({error})"
                ) from error
            completed = False
        if not completed:
            assert self.timeout is not None
            raise ShardScaleDistributedError(
                f"step {step}: waited {self.timeout.total_seconds():g} s for all "
                f"{self.world_size} ranks of the process group to exchange {what}, and at least "
                "one never arrived: it crashed, hung, or took another code path (e.g. skipped "
                "scaler.step(), or stepped another optimizer). The process group cannot be "
                "trusted after this: end the job (torchrun restarts it from the last checkpoint)."
            )

    @staticmethod
    def _local_max(local_flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        if len(local_flags) == 1:
            return move(local_flags[0], device)
        return torch.stack([move(flag, device) for flag in local_flags]).amax()


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)
