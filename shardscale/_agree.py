"""Agreement: the one collective that makes every rank take the same skip/step decision.

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

Every collective runs through the bounded exchange this class builds on
([`Exchange`][shardscale._exchange.Exchange]): a rank that never arrives is an error naming the
step, within the scaler's `sync_timeout`, not a hang.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardscale._devices import move
from shardscale._errors import no_scale_message
from shardscale._exchange import Exchange

__all__ = ["Agreement", "Ballot", "Verdict"]


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


class Agreement(Exchange):
    """The one collective a scaler runs per step, on the bounded exchange it builds on.

    Args:
        process_group: the group whose ranks must agree; None means the default (world) group,
            looked up at the first step so a scaler may be built before `init_process_group`.
        timeout: the longest wait for the other ranks at a collective (None: the group's own).
    """

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


@functools.cache
def _ballot_template(
    device: torch.device, holds_grads: bool, has_scale: bool, with_norm: bool
) -> torch.Tensor:
    values = [float(holds_grads), 0.0, float(has_scale)] + ([0.0] if with_norm else [])
    return torch.tensor(values, dtype=torch.float32, device=device)
