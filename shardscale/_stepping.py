"""An iteration's checks, its one agreement, and its optimizer steps: the work of one step.

Invariant: every optimizer of an iteration steps or skips on every rank alike, after ONE
collective per `step()`/`clip_grad_norm_()` call however many optimizers, devices and dtypes
hold the gradients; `unscale_()` adds none after the first step (its local check waits for that
collective; on the first step, and on the async scaler, it agrees at once).

The [`Stepper`][] does the work for a scaler and an [`IterationBook`][]
(which optimizer is where in the iteration); the scaler owns the scale and the state. It also
carries what a rank learns across iterations: its gradient walks (cached while the gradients stay
the same tensors), whether it is a pipeline stage that computes no loss, and where the last
overflow was.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from shardscale._agree import Agreement, Verdict
from shardscale._check import check_and_unscale_, combined, inverse, multiply_, ones
from shardscale._clip import apply_, by_device_dtype, local_norms, norm_flags_exact
from shardscale._device_state import ScaleHome
from shardscale._errors import ShardScaleWarning
from shardscale._fused import step_on_device
from shardscale._iteration import Clipped, IterationBook, OptimizerRecord, Stage
from shardscale._locate import NonFiniteGrad, locate, optimizer_named_params
from shardscale._optimizers import optimizer_params, steppables, takes_scale
from shardscale._report import log_located
from shardscale._walk import GradCache, GradGroups, GradWalk

__all__ = ["Stepper"]

_CPU = torch.device("cpu")


class Stepper:
    """Checks, agrees, unscales, clips and steps, for one scaler on one rank.

    Args:
        agreement: the process group and its one collective.
        locate_overflow: on overflow steps, find and log the non-finite gradients.
        defers_agreement: whether `unscale_` leaves its agreement to the next step, clip or
            update (False where those may run on another thread: the async scaler).
    """

    def __init__(
        self,
        agreement: Agreement,
        home: ScaleHome,
        *,
        locate_overflow: bool,
        defers_agreement: bool,
    ) -> None:
        self.agreement = agreement
        self.home = home  # whether this rank scaled, or holds an unconfirmed scale
        self.last_overflow: list[NonFiniteGrad] = []
        self._locate_overflow = locate_overflow
        self._defers = defers_agreement
        self._cache = GradCache()
        # Whether this scaler has been through an agreement: every rank passes its first at the
        # same collective, so "defer unscale_'s agreement" is decided alike everywhere.
        self._agreed_once = False
        self._warned_plain_replicas = False
        # The agreed flag ``locate_overflow`` read in this step() call, and its value: the
        # step's decision then needs no second read.
        self._flag_read: tuple[torch.Tensor, bool] | None = None

    # ------------------------------------------------------------------ unscale_ and step

    def unscale(
        self, book: IterationBook, target: object, scale: torch.Tensor
    ) -> list[OptimizerRecord]:
        """`unscale_` of `target`'s optimizers; returns their records."""
        leaves = [leaf for item in steppables(target) for leaf in item.leaves]
        to_check, adopted = book.begin_unscale(leaves)
        self._locate_adopted(book, adopted)
        # Deferred only once the scaler has agreed before: on its first step a pipeline stage
        # that never scaled must agree before it modifies anything, and every rank must then
        # issue the same collectives, whichever stage it holds.
        if to_check and not (self._defers and self._agreed_once):
            self._check_and_agree(book, to_check, [], scale, "unscale_")
        elif to_check:
            self._check_locally(book, to_check, scale)
        return [book.record(leaf) for leaf in leaves]

    def step(
        self,
        book: IterationBook,
        target: object,
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, bool | torch.Tensor, list[OptimizerRecord]]:
        """`step` of `target` (an optimizer, a container of them, or a list).

        Returns:
            What the `step()` calls returned (a list for a list), the decision (a bool where
            the host read it, else the agreed device flag), and the records stepped.
        """
        items = steppables(target)
        self._flag_read = None  # a read from another call may predate a replay: not reused
        records, adopted = book.begin_step(leaf for item in items for leaf in item.leaves)
        self._locate_adopted(book, adopted)
        ready = [record for record in records if record.stage is Stage.READY]
        if ready or book.pending is not None:
            # Fused optimizers unscale inside their own kernel: check, don't write.
            still_scaled = [r for r in ready if takes_scale(r.optimizer)]
            to_unscale = [r for r in ready if not takes_scale(r.optimizer)]
            self._check_and_agree(book, to_unscale, still_scaled, scale, "step")
        by_optimizer = {id(record.optimizer): record for record in records}
        decisions: dict[int, bool] = {}  # host reads of agreed flags, one per distinct flag
        results = []
        for item in items:
            item_records = [by_optimizer[id(leaf)] for leaf in item.leaves]
            found_inf = combined([r.found_inf for r in item_records])
            if all(takes_scale(leaf) for leaf in item.leaves):
                results.append(
                    step_on_device(
                        item, item_records, found_inf, scale, args, kwargs, self.agreement.settle
                    )
                )
            else:
                if id(found_inf) not in decisions:
                    known = self._flag_read
                    if known is not None and known[0] is found_inf:  # locate_overflow read it
                        decisions[id(found_inf)] = known[1]
                    else:  # the step's one host synchronisation
                        decisions[id(found_inf)] = self.agreement.read_flag(found_inf)
                skipped = decisions[id(found_inf)]
                results.append(
                    None
                    if skipped
                    else step_on_device(
                        item, item_records, found_inf, scale, args, kwargs, self.agreement.settle
                    )
                )
            for record in item_records:
                record.stage = Stage.STEPPED
        overall = combined([record.found_inf for record in records])
        result = results if isinstance(target, (list, tuple)) else results[0]
        return result, decisions.get(id(overall), overall), records

    def resolve_pending(self, book: IterationBook, scale: torch.Tensor, funcname: str) -> None:
        """Agree on the checks `unscale_` left pending (`update()` without `step()`)."""
        if book.pending is not None:
            self._check_and_agree(book, [], [], scale, funcname)

    def _check_locally(
        self, book: IterationBook, records: list[OptimizerRecord], scale: torch.Tensor
    ) -> None:
        """Unscale and check `records`' gradients in place; leave the agreement pending."""
        with torch.no_grad():
            walk = self._walk("unscale", records)
            self._settle_before_host_copy(walk.kernel_groups(), scale)
            flags = check_and_unscale_(walk.kernel_groups(), inverse(scale))
        book.add_pending(records, flags.values(), walk.holds)
        for record in records:
            record.stage = Stage.UNSCALED

    def _settle_before_host_copy(self, groups: GradGroups, scale: torch.Tensor) -> None:
        """Bound the collective in flight before unscaling CPU gradients by a device scale.

        Their inverse scale is copied to the host (blocking), which waits for the device's
        queue: behind the previous step's collective, if it is still in flight (NCCL with
        `sync_timeout`). Settling first bounds that wait by `sync_timeout`.
        """
        if scale.device.type != "cpu" and any(device.type == "cpu" for device, _ in groups):
            self.agreement.settle()

    def _walk(self, purpose: str, records: list[OptimizerRecord]) -> GradWalk:
        """The local gradients of `records`' optimizers, their layout cached per purpose and
        optimizer set (unscaled gradients and only-checked ones are never walked together)."""
        return self._cache.walk(
            (purpose, *(id(r.optimizer) for r in records)),
            (p for record in records for p in optimizer_params(record.optimizer)),
        )

    def _check_and_agree(
        self,
        book: IterationBook,
        to_unscale: list[OptimizerRecord],
        to_check: list[OptimizerRecord],
        scale: torch.Tensor,
        funcname: str,
    ) -> None:
        """Check (and unscale) the records' gradients, then agree on ONE flag for all of them.

        `to_unscale`'s gradients are divided by the scale in place (their stage becomes
        UNSCALED); `to_check`'s are only checked (fused optimizers unscale them in their own
        kernel); checks `unscale_` left pending join. Every record gets the agreed
        `found_inf`. On a rank that never called `scale()` nothing is modified until the
        group has confirmed that some rank did.
        """
        confirm = funcname if self.home.unconfirmed else None
        # Only gradients to unscale need it (a fused optimizer's are only checked).
        inv_scale = inverse(scale) if to_unscale else None
        pending = book.take_pending()
        earlier = pending.records if pending is not None else []
        records = to_unscale + to_check + earlier
        with torch.no_grad():
            unscaling = self._walk("unscale", to_unscale)
            checking = self._walk("check", to_check)
            unscale_groups = unscaling.kernel_groups()
            if not confirm:
                self._settle_before_host_copy(unscale_groups, scale)
            holds = unscaling.holds or checking.holds or (pending is not None and pending.holds)
            ballot = self.agreement.ballot(scale.device, holds_grads=holds, has_scale=not confirm)
            flags = check_and_unscale_(
                unscale_groups, None if confirm else inv_scale, ballot.flags()
            )
            flags = check_and_unscale_(checking.kernel_groups(), None, flags)
            verdict = self.agreement.agree(
                ballot,
                [*flags.values(), *(pending.flags if pending is not None else ())],
                device=scale.device,
                step=book.step,
                confirm_scale=confirm,
            )
            if confirm:  # the group confirmed that some rank scaled: unscale now
                self.home.confirm()
                if inv_scale is not None:
                    multiply_(unscale_groups, inv_scale)
        self._agreed_once = True
        for record in to_unscale:
            record.stage = Stage.UNSCALED
        book.agreed(records, verdict.found_inf)
        self._locate_if_overflowed(verdict.found_inf, records, book.step)

    # ------------------------------------------------------------------ clipping

    def clip(
        self,
        book: IterationBook | None,
        params: list[torch.Tensor],
        max_norm: float,
        norm_type: float,
        replicas: int,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """`clip_grad_norm_`: norm (one read), agreement (one collective), clip (one write).

        Args:
            book: the iteration (None: a disabled scaler, which only clips).
            scale: the scale the gradients carry, or None: only the norm is exchanged (a
                disabled scaler). Gradients `unscale_` already unscaled are clipped as they
                are, and its pending check joins the collective.

        Raises:
            RuntimeError: called twice in the iteration, or on parameters of which some, but
                not all, were unscaled already.
        """
        if book is None or scale is None:
            verdict = self._clip(None, params, max_norm, norm_type, replicas, None, step=0)
            assert verdict.total_norm is not None
            return verdict.total_norm
        if book.clipped is not None:
            raise RuntimeError("clip_grad_norm_() has already been called since the last update().")
        ids = frozenset(id(p) for p in params)
        done = book.unscaled_param_ids()
        if done and ids <= done:  # unscale_() ran for these already: clip them as they are
            verdict = self._clip(book, params, max_norm, norm_type, replicas, None, book.step)
        elif ids & done:
            raise RuntimeError(
                "clip_grad_norm_() got parameters of which some, but not all, were already "
                "unscaled by unscale_(): clip each optimizer's parameters after its unscale_(), "
                "or all of them before any unscale_()"
            )
        else:
            verdict = self._clip(book, params, max_norm, norm_type, replicas, scale, book.step)
            book.clipped = Clipped(param_ids=ids, found_inf=verdict.found_inf)
        assert verdict.total_norm is not None
        return verdict.total_norm

    def _clip(
        self,
        book: IterationBook | None,
        params: list[torch.Tensor],
        max_norm: float,
        norm_type: float,
        replicas: int,
        scale: torch.Tensor | None,
        step: int,
    ) -> Verdict:
        pending = book.take_pending() if book is not None else None
        with torch.no_grad():
            walk = self._cache.walk(("clip", replicas), params)
            groups, plain = walk.norm_groups(replicas)
            self._warn_if_plain_replicas_assumed(plain, replicas)
            if scale is not None:
                device, inv_scale = scale.device, inverse(scale)
            else:
                device = next(iter(groups))[0] if groups else _CPU
                inv_scale = ones(device)  # made once: no kernel per step
            confirm = "clip_grad_norm_" if scale is not None and self.home.unconfirmed else None
            holds = walk.holds or (pending is not None and pending.holds)
            ballot = self.agreement.ballot(
                device, holds_grads=holds, has_scale=confirm is None, with_norm=True
            )
            # The norms' check raises the ballot's own slot (no kernel of its own) where a
            # non-finite norm means a non-finite element; otherwise the elements are checked.
            exact = norm_flags_exact(groups, norm_type)
            share, norm_flags = local_norms(
                groups, norm_type, inv_scale, device, ballot.flags() if exact else None
            )
            flags = list(pending.flags) if pending is not None else []
            if scale is not None:  # this pass is the check of still-scaled gradients
                if not exact:
                    norm_flags = check_and_unscale_(by_device_dtype(groups), None, ballot.flags())
                flags.extend(norm_flags.values())
            verdict = self.agreement.agree(
                ballot,
                flags,
                device=device,
                step=step,
                confirm_scale=confirm,
                norm_share=share,
                norm_type=norm_type,
            )
            if confirm is not None:
                self.home.confirm()
            self._agreed_once = True
            assert verdict.total_norm is not None
            apply_(
                groups,
                max_norm,
                verdict.total_norm,
                None if scale is None else inv_scale,
                verdict.found_inf,
            )
        if pending is not None and book is not None:
            book.agreed(pending.records, verdict.found_inf)
            self._locate_if_overflowed(verdict.found_inf, pending.records, step)
        return verdict

    def _warn_if_plain_replicas_assumed(self, plain: bool, replicas: int) -> None:
        """Warn, once, where the default replica group is most likely wrong: a pipeline stage."""
        world_size = self.agreement.world_size
        if not plain or self.home.scaled_here or replicas != world_size or world_size == 1:
            return
        if self._warned_plain_replicas:
            return
        self._warned_plain_replicas = True
        warnings.warn(
            "clip_grad_norm_ on a rank that never called scale() (a pipeline stage that computes "
            "no loss?) got plain (non-DTensor) gradients and, with replica_group=None, takes "
            f"them as replicated on all {world_size} ranks of the scaler's group (as under DDP). "
            "If they are this stage's own, pass replica_group= (the stage's data-parallel group, "
            "or 1 for pure pipeline parallelism): otherwise the norm is too small.",
            ShardScaleWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------------ locating overflows

    def _locate_adopted(self, book: IterationBook, adopted: list[OptimizerRecord]) -> None:
        """Locate an overflow for the records that just took `clip_grad_norm_`'s verdict."""
        if adopted and book.clipped is not None:
            self._locate_if_overflowed(book.clipped.found_inf, adopted, book.step)

    def _locate_if_overflowed(
        self, found_inf: torch.Tensor, records: list[OptimizerRecord], step: int
    ) -> None:
        """With `locate_overflow`: on an overflow step, find and log the non-finite grads."""
        if not (self._locate_overflow and records):
            return
        overflowed = self.agreement.read_flag(found_inf)  # same on every rank
        self._flag_read = (found_inf, overflowed)
        if not overflowed:
            return
        self.last_overflow = locate(
            (pair for record in records for pair in optimizer_named_params(record.optimizer)),
            self.agreement,
            step,
        )
        log_located(step, self.last_overflow)
