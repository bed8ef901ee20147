"""Agreement: the one collective that makes every rank take the same skip/step decision.

Invariant: every rank of the group sees the same ``found_inf`` before ``optimizer.step()``.

Each rank folds its per-device flags into one small float32 tensor on the group's communication
device and the group runs ONE ``all_reduce(SUM)`` on it, however many devices and dtypes hold
the gradients. The tensor's slots:

* ``OVERFLOW``: how many ranks found an inf/NaN in their shard;
* ``HAS_GRADS``: how many ranks hold any gradient element (0 means nobody ran backward).

The agreed ``found_inf`` is the overflow count clamped to 1.0, on the scale's device. It must be
exactly 0.0 or 1.0: torch's fused optimizers skip only when ``found_inf == 1.0``, so a summed flag
of 2.0 (two ranks overflowed) would make them step with inf gradients.

Without an initialised process group, or with a world size of 1, no collective is issued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardscale._devices import move

__all__ = ["AgreedFlags", "Agreement"]

OVERFLOW = 0
HAS_GRADS = 1
_NUM_SLOTS = 2

_NO_GRADS = (
    "No inf checks were recorded for this optimizer: none of its parameters has a gradient "
    "on any of the {world_size} rank(s). Call scaler.scale(loss).backward() before step()."
)


@dataclass(frozen=True, slots=True)
class AgreedFlags:
    """The outcome of one agreement, identical on every rank."""

    found_inf: torch.Tensor
    """float32 scalar on the scale's device: 1.0 if any rank overflowed, else 0.0."""
    overflow_ranks: torch.Tensor | None
    """float32 scalar on the communication device: how many ranks overflowed (None at world
    size 1, where it equals ``found_inf``)."""


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

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self._requested = process_group
        self._group: dist.ProcessGroup | None = None
        self._world_size: int | None = None

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
        if self.world_size == 1:
            return preferred
        assert self._group is not None  # set by world_size
        device_types = _group_device_types(self._group)
        if preferred.type in device_types:
            return preferred
        return _device_of_type(device_types[0])

    def agree(self, local_flags: list[torch.Tensor], device: torch.device) -> AgreedFlags:
        """Combine this rank's per-device flags with every other rank's, in one collective.

        Args:
            local_flags: float32 scalar flags from the local check, one per device holding
                gradients; empty when this rank holds no gradient elements.
            device: the scale's device, where the agreed ``found_inf`` is returned.

        Raises:
            RuntimeError: no rank holds any gradient (every rank raises together).
        """
        world_size = self.world_size
        if world_size == 1:
            if not local_flags:
                raise RuntimeError(_NO_GRADS.format(world_size=1))
            return AgreedFlags(found_inf=self._local_max(local_flags, device), overflow_ranks=None)

        comm = self.comm_device(device)
        flags = torch.zeros(_NUM_SLOTS, dtype=torch.float32, device=comm)
        if local_flags:
            flags[OVERFLOW].copy_(self._local_max(local_flags, comm))
            flags[HAS_GRADS].fill_(1.0)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self._group)
        # A rank with no gradient elements learns whether anybody had some; the others need not
        # ask, which keeps the host sync off their path.
        if not local_flags and flags[HAS_GRADS].item() == 0:
            raise RuntimeError(_NO_GRADS.format(world_size=world_size))
        found_inf = move(flags[OVERFLOW].clamp(max=1.0), device)
        return AgreedFlags(found_inf=found_inf, overflow_ranks=flags[OVERFLOW])

    @staticmethod
    def _local_max(local_flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        if len(local_flags) == 1:
            return move(local_flags[0], device)
        return torch.stack([move(flag, device) for flag in local_flags]).amax()
