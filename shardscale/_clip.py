"""`clip_grad_norm_`: the gradients' global norm, agreed in the step's one collective with the
overflow flags, then the clip. An opt-in of its own: a step that clips no gradients never enters
this module, and a clip reaches the agreement through the two calls a step makes too
([`Agreement.ballot`][shardscale._check.Agreement.ballot], then
[`Agreement.vote`][shardscale._check.Agreement.vote]).

The norm is global: every rank's shards and every pipeline stage's parameters count, and
replicas count once. A rank's share of it is `sum |g|^p / r` (the max for the inf-norm), `r`
being how many ranks hold those same elements ([`Clipping`][]'s replica count: a DTensor says it
itself, from its mesh and placements; plain tensors and FSDP1 flat parameters are replicated over
the `replica_group` the caller names). The share travels in the ballot's norm slot (an
inf-norm's in this rank's own slot among W, its reduction a max), so the SUM of the collective
adds the shares up.

Clipping takes two passes over the gradients, whatever the layout:

1. read: the per-tensor norms of the still-scaled gradients, unscaled and reduced to this rank's
   share. A non-finite element makes its tensor's norm non-finite, so this pass is also the
   overflow check (for p <= 2 and the inf-norm; a larger p takes one extra check pass). Scaled
   fp32 gradients can be large enough that their squares overflow float32, so a finite gradient
   must never be taken for an overflow: on the CPU, where some norm comes out non-finite, the
   norms are taken again in float64 (deciding that is a host read, free there; float64 norms
   cost 8x there), on an accelerator every norm accumulates in float64 (a memory-bound pass
   either way). On the CPU a group whose gradients tile one buffer back to back (FSDP2's shards
   of its reduce-scatter output) is recognised afresh at every call and taken as one view of
   exactly their elements (a norm ~2 us per tensor there; the view 0.5 us: docs/benchmarks.md).
2. read+write: multiply by `inv_scale * min(1, max_norm / (total + 1e-6))`, after the agreement.

What a clip unscaled and agreed is the iteration's ([`ClipRecord`][], in its book): the steps
after it ask it whether they take its verdict ([`ClipRecord.adopts`][], the clip's rule), through
the one question `shardscale._stepping` asks of a clip. So that they answer alike on every rank
whatever each rank's list covered (a list built from its own gradients, a dense part without the
experts), over several ranks the clip also checks, and unscales without clipping, the gradients
its list leaves out of the optimizers stepped before: their flags join the clip's, and their
steps take its verdict with no collective and no host read of their own.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardscale._bins import Reading
from shardscale._check import Ballot, Check, Iteration, waiting_votes
from shardscale._errors import ShardScaleWarning
from shardscale._grads import Flags, GradGroups, NormGroups, grad_groups, local_grads, move
from shardscale._state import Flag, Verdict
from shardscale._stepping import IterationBook, OptimizerRecord, Stage, Steps, optimizer_params
from shardscale._torch import (
    check_and_unscale_,
    dtensor_spec,
    flat_param_sizes,
    foreach_norm,
    group_by_device_and_dtype,
    is_flat_param,
    is_fsdp_flattened,
    no_torch_function_subclass,
)

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
_DTYPE = operator.itemgetter(1)
_BASE = operator.attrgetter("_base")


def check_clip_args(max_norm: float, norm_type: float) -> tuple[float, float]:
    """Validate `max_norm` (finite, > 0) and `norm_type` (> 0, or inf)."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm}")
    if not (norm_type > 0 and not math.isnan(norm_type)):
        raise ValueError(f"norm_type must be > 0 (or math.inf), got {norm_type}")
    return float(max_norm), float(norm_type)


def plain_replicas(replica_group: object, world_size: int) -> int:
    """The number of ranks `clip_grad_norm_`'s `replica_group` names (see its docs)."""
    if replica_group is None:
        return world_size
    if isinstance(replica_group, DeviceMesh):
        if replica_group.ndim != 1:
            raise ValueError(
                f"replica_group must be a 1-D DeviceMesh, got one of shape "
                f"{tuple(replica_group.shape)}: slice it by the data-parallel dimension"
            )
        return replica_group.size()
    if isinstance(replica_group, dist.ProcessGroup):
        return dist.get_world_size(replica_group)
    if isinstance(replica_group, bool) or not isinstance(replica_group, int):
        raise TypeError(
            "replica_group must be a ProcessGroup, a 1-D DeviceMesh, an int or None, got "
            f"{type(replica_group).__name__}"
        )
    if not 1 <= replica_group <= world_size:
        raise ValueError(
            f"replica_group must be in [1, {world_size}] (the scaler's group size), got "
            f"{replica_group}"
        )
    return replica_group


@dataclass(frozen=True, slots=True)
class ClipRequest:
    """What `clip_grad_norm_` asks of an agreement.

    Attributes:
        replicas: How many ranks hold the same plain (non-DTensor) gradients (`replica_group`).
        scaled: Whether the gradients still carry the scale (False: `unscale_()` divided it out).
        left_out: The parameters whose gradients this rank holds and the clip leaves out, of
            optimizers stepped before (over several ranks): checked and unscaled with the
            clip's (not clipped), so that their steps take its verdict.
    """

    params: list[torch.Tensor]
    max_norm: float
    norm_type: float
    replicas: int
    scaled: bool = True
    left_out: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True, slots=True)
class ClipResult:
    """What a clip's agreement returns: its check's verdict, the global norm, and whether this
    rank clipped plain gradients without having scaled (a pipeline stage, whose replica count
    the default group likely overstates)."""

    verdict: Verdict
    total_norm: torch.Tensor
    plain_on_a_stage: bool = False


@dataclass(slots=True)
class ClipRecord:
    """What `clip_grad_norm_` unscaled and agreed on in this iteration, for steps to take (the
    iteration's book holds it: `IterationBook.clipped`).

    Attributes:
        param_ids: The parameters (ids) whose gradients it checked and unscaled here: its
            list's, and (over several ranks) those it left out of optimizers stepped before.
        known: The leaf optimizers (ids) stepped before the clip.
        alone: Whether this rank is the whole group (world size 1): what its list covered is
            then what the group's did.
    """

    param_ids: frozenset[int]
    verdict: Verdict
    known: frozenset[int] = frozenset()
    alone: bool = True

    def adopts(self, record: OptimizerRecord) -> bool:
        """Whether `record` takes the clip's unscale and verdict (it takes them then), with no
        collective of its own; else its parameters the clip unscaled keep the clip's unscale,
        the rest is checked at its own agreement (an empty check on a rank whose list covered
        them all), and its verdict is the clip's with its own.

        Decided alike on every rank, never by which parameters this rank's list holds or left
        out (lists built from each rank's own gradients differ: MoE tokens reach other experts
        on each). Over several ranks an optimizer stepped before the clip takes its verdict:
        the clip checked and unscaled its gradients here, those its list left out included
        ([`Clipping`][]); one stepped for the first time, whose parameters the clip could not
        know, is checked at a collective of its own, on every rank, that first step only
        (docs/guides.md#costs), and takes the clip's verdict with its own. Alone (world size
        1, no collective) the clip's own list decides, as torch's steps do: the clip's verdict
        where it left out no gradient of the optimizer, else the clip's with the rest's where
        it covered some.
        """
        if record.stage is not Stage.READY or record.clipped is not None:
            return False
        if self.alone:
            params = list(optimizer_params((record.optimizer,)))
            left_out = [param for param in params if id(param) not in self.param_ids]
            takes = not any(param.grad is not None for param in left_out)
            shares = len(left_out) < len(params)
        else:
            takes, shares = id(record.optimizer) in self.known, True
        if takes:
            record.verdict, record.stage = self.verdict, Stage.UNSCALED
        elif shares:
            record.clipped = self
        return takes


class NormWalk:
    """A clip's walk of its local gradients, grouped afresh at every call by (device, dtype,
    replica count): nothing is kept by gradient identity (`shardscale._grads`), only each
    DTensor parameter's replica count, by its sharding spec object."""

    def __init__(self) -> None:
        self._replicas: dict[int, tuple[object, int]] = {}  # per parameter: (spec, count)

    def groups(self, params: Iterable[torch.Tensor], plain: int) -> tuple[NormGroups, bool, bool]:
        """`params`' local gradients by (device, dtype, replica count) for a global norm
        ([`NormGroups`][shardscale._grads.NormGroups]; `plain`: how many ranks hold the same
        plain gradients); whether any was a plain tensor (its count came from `plain`); whether
        any exists. On the CPU a group tiling one buffer is one view ([`_one_view`][]).

        Raises:
            TypeError: a gradient is not floating point.
        """
        params = tuple(params)
        grads, positions, held = local_grads(params)
        groups: NormGroups = {}
        any_plain = False
        grouped = group_by_device_and_dtype([cast(Any, grads)], with_indices=True) if grads else {}
        with no_torch_function_subclass():
            for (device, dtype), (tensor_lists, indices) in grouped.items():
                for grad, index in zip(
                    cast(list[torch.Tensor], tensor_lists[0]), indices, strict=True
                ):
                    count, is_plain = self.replica_count(params[positions[index]], plain)
                    any_plain = any_plain or is_plain
                    groups.setdefault((device, dtype, count), []).append(grad)
        for key, tensors in groups.items():
            view = _one_view(tensors) if key[0].type == "cpu" else None
            if view is not None:
                groups[key] = [view]
        return groups, any_plain, held

    def replica_count(self, param: torch.Tensor, plain: int) -> tuple[int, bool]:
        """How many ranks hold the same local gradient elements as this rank does for `param`,
        and whether its gradient is a plain tensor (its replicas named by the caller, not read
        from a DTensor or an FSDP1 flat parameter).

        * DTensor: read from its own `device_mesh` and `placements`: the product of the mesh
          sizes of its `Replicate` dimensions (HSDP's replicate dimension, a TP `Replicate`).
          Ranks outside its mesh hold other parameters (another pipeline stage, other experts)
          or other shards, so disjoint stages and expert shards add up.
        * Plain tensor: `plain`, the ranks the caller says replicate it (DDP: the whole
          group; a pipeline stage: its data-parallel group; pure pipeline: 1).
        * FSDP1 flat parameter: `plain` ranks hold it, in as many shards as it has.
        * A parameter FSDP1 flattened (`use_orig_params=True`): taken as fully sharded, 1.
        """
        grad = param.grad
        if type(grad) is not DTensor and not isinstance(grad, DTensor):
            if not is_fsdp_flattened(param):
                return plain, True
            if is_flat_param(param):
                unsharded, sharded = flat_param_sizes(param)
                return max(plain // max(unsharded // max(sharded, 1), 1), 1), False
            return 1, False  # a view into a flat parameter (`use_orig_params`)
        # By the gradient's sharding spec, per parameter: FSDP2 hands each step's gradient with
        # the parameter's one spec object (3x cheaper than reading the mesh and placements).
        known = self._replicas.get(id(param))
        spec = dtensor_spec(grad)
        if known is None or known[0] is not spec:
            known = self._replicas[id(param)] = (spec, _dtensor_replicas(grad))
        return known[1], False


class Clipping:
    """A scaler's clips: `clip_grad_norm_` checked, agreed and clipped (module docstring).

    Keeps what it learns across iterations: its gradient walk ([`NormWalk`][]), `max_norm` on
    each device, whether it warned that plain replicas were assumed.

    Args:
        steps: the scaler's steps, whose iteration the clip records in.
    """

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.agreement = steps.agreement
        self._walk = NormWalk()
        self._max_norm: dict[torch.device, tuple[float, torch.Tensor]] = {}
        self._warned = False  # that plain replicas were assumed on a stage without a loss

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float,
        replica_group: object,
        enabled: bool,
    ) -> torch.Tensor:
        """`scaler.clip_grad_norm_` (see there): the total norm, agreed in one collective.
        A disabled scaler (not `enabled`) agrees on the norm alone, and clips as torch does."""
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        replicas = plain_replicas(replica_group, self.agreement.exchange.world_size)
        if enabled:
            return self._clip_in_step(params, max_norm, norm_type, replicas)
        request = ClipRequest(params, max_norm, norm_type, replicas, scaled=False)
        return self._agree(self.steps.book, None, request).total_norm

    def _clip_in_step(
        self, params: list[torch.Tensor], max_norm: float, norm_type: float, replicas: int
    ) -> torch.Tensor:
        """An enabled scaler's clip: the book records what it unscaled and agreed, for the steps
        to take.

        Raises:
            RuntimeError: no rank holds a gradient for `params` (on every rank).
        """
        steps, world_size = self.steps, self.agreement.exchange.world_size
        # False: unscale_() ran for these already, and they are clipped as they are
        scaled = self._begin(steps.book, params)
        ids, alone = frozenset(map(id, params)), world_size == 1
        left_out = () if alone else self._left_out_here(steps.book, ids)
        request = ClipRequest(params, max_norm, norm_type, replicas, scaled, left_out)
        scale = steps.loss_scale("clip_grad_norm_", params)
        result = self._agree(steps.book, scale, request, steps.book.waiting())
        if result.verdict.has_grads:
            checked = ids | frozenset(map(id, left_out))
            known = frozenset(steps.known)
            steps.book.clipped = ClipRecord(checked, result.verdict, known, alone)
        steps.settle()  # the checks unscale_() left waiting were agreed too
        if not result.verdict.has_grads:
            raise RuntimeError(
                "clip_grad_norm_() got parameters none of which has a gradient on any of the "
                f"{world_size} rank(s): call scaler.scale(loss).backward() first"
            )
        if result.plain_on_a_stage and not self._warned:  # last: this rank's own diagnostic
            self._warned = warn_plain_replicas_assumed(replicas, world_size)
        return result.total_norm

    def _begin(self, book: IterationBook, params: list[torch.Tensor]) -> bool:
        """Whether `clip_grad_norm_`'s gradients still carry the scale (False: `unscale_()`
        divided it out of every one of them: they are clipped as they are).

        Raises:
            RuntimeError: the clip was called already since the last update, or after some,
                but not all, of its parameters were unscaled.
        """
        if book.clipped is not None:
            raise RuntimeError("clip_grad_norm_() has already been called since the last update().")
        ids = frozenset(map(id, params))
        done: set[int] = set()  # the parameters unscaled already
        for record in book.records.values():
            if record.stage is not Stage.READY:
                done.update(map(id, optimizer_params((record.optimizer,))))
        if ids & done and not ids <= done:
            raise RuntimeError(
                "clip_grad_norm_() got parameters of which some, but not all, were already "
                "unscaled by unscale_(): clip each optimizer's parameters after its unscale_(), "
                "or all of them before any unscale_()"
            )
        return not (done and ids <= done)

    def _left_out_here(
        self, book: IterationBook, clipped: frozenset[int]
    ) -> tuple[torch.Tensor, ...]:
        """The parameters whose gradients this rank holds and a clip of `clipped` (their ids)
        leaves out, of optimizers stepped before and not yet unscaled in this iteration."""
        left_out: dict[int, torch.Tensor] = {}
        for ref in list(self.steps.known.values()):
            optimizer = ref()
            record = None if optimizer is None else book.records.get(id(optimizer))
            if optimizer is None or (record is not None and record.stage is not Stage.READY):
                continue
            for param in optimizer_params((optimizer,)):
                if param.grad is not None and id(param) not in clipped:
                    left_out[id(param)] = param
        return tuple(left_out.values())

    def _agree(
        self,
        book: Iteration,
        scale: torch.Tensor | None,
        request: ClipRequest,
        waiting: Sequence[Check] = (),
    ) -> ClipResult:
        """The norm share of the request's gradients travels with the flags (and with the
        checks `unscale_` left waiting) in ONE collective; then they are clipped (and unscaled,
        unless `unscale_` did) to the agreed global norm. A waiting check takes the clip's flags
        with its own where it holds some of the clip's parameters on any rank (the ballot's
        clipped slots: `shardscale._check`), so that no step runs on gradients an overflowing
        clip left unclipped; its flags join the clip's where it holds some of them here. Without
        a `scale` (a disabled scaler) only the norm is agreed on, and the gradients are clipped
        as torch clips them (a non-finite norm included)."""
        agreement, norm_type = self.agreement, request.norm_type
        with torch.no_grad():
            norms, plain, has_grads = self._walk.groups(request.params, request.replicas)
            # a disabled scaler has no scale: the gradients' device (the CPU without any)
            device = next(iter(norms), (torch.device("cpu"),))[0] if scale is None else scale.device
            own = Check(has_grads=has_grads, param_ids=frozenset(map(id, request.params)))
            checks = [own, *waiting]
            shared = tuple(unit > 0 and _overlaps(check, own) for unit, check in enumerate(checks))
            has_scale = scale is None or not agreement.home.unconfirmed
            ballot = agreement.ballot(book, device, "clip_grad_norm_", checks, has_scale, shared)
            counting = scale is not None and agreement.counting(book, device)
            inv = self._local_pass(book, ballot, own, norms, request, scale, counting)
            rest, rest_flags, rest_reading = self._check_left_out(book, request, device, counting)
            others = waiting_votes(checks)
            others += [(0, flag) for u, flag in others if shared[u]] + rest_flags
            agreement.fill(ballot, [*(check.reading for check in checks), rest_reading], counting)
            verdicts = agreement.vote(book, ballot, others, "clip_grad_norm_", norm_type, counting)
            for check, verdict in zip(checks, verdicts, strict=True):
                check.verdict = verdict
            total = _total_norm(ballot, norm_type)
            found_inf = None if scale is None else verdicts[0].flags[Flag.SKIP]
            self._clip_(norms, request.max_norm, total, inv, found_inf)
            if rest and scale is not None:  # the confirmed scale: left out, unscaled only
                agreement.kernels.multiply_(rest, agreement.kernels.inverse(scale))
        stage = plain and scale is not None and not agreement.home.scaled_here
        return ClipResult(verdicts[0], move(total, ballot.device), stage)

    def _local_pass(
        self,
        book: Iteration,
        ballot: Ballot,
        own: Check,
        norms: NormGroups,
        request: ClipRequest,
        scale: torch.Tensor | None,
        counting: bool,
    ) -> torch.Tensor | None:
        """A clip's local pass: what the fit and the meter read (into `own`, its check, where
        they read), this rank's norm share into the ballot, and the check into its first slot.
        Returns the inverse scale the gradients are still to be multiplied by (None:
        `unscale_()` divided it out, or no scale)."""
        kernels, norm_type, device = self.agreement.kernels, request.norm_type, ballot.device
        fit = scale is not None and self.agreement.home.host.policy.fit
        if counting or fit:  # its gradients' peak is times the scale where unscaled already
            unscaled = None if request.scaled else scale
            read = (book, (norms,), request.params, device, unscaled, fit, counting)
            own.reading = self.agreement.readings.read(*read)
        inv = kernels.inverse(scale) if request.scaled and scale is not None else None
        # The norms' check raises the ballot's own slot (no kernel of its own) where a
        # non-finite norm means a non-finite element; otherwise the elements are checked.
        exact = exact_norm_check(norms, norm_type)
        flags = {ballot.skip().device: ballot.skip()}
        factor = kernels.one(device) if inv is None else inv
        share = ballot.inf_norm_slot if math.isinf(norm_type) else ballot.norm
        _local_norms_(norms, norm_type, factor, flags if exact else {}, share)
        if inv is not None and not exact:
            kernels.check_(norms, None, flags)
        return inv

    def _check_left_out(
        self, book: Iteration, request: ClipRequest, device: torch.device, counting: bool
    ) -> tuple[GradGroups, list[tuple[int, torch.Tensor]], Reading | None]:
        """The check of the gradients a clip leaves out, of optimizers stepped before (over
        several ranks: [`ClipRecord.adopts`][]), before the agreement: their groups (unscaled
        after it, where the group confirmed the scale), their flags (the clip's: its unit's),
        and what the fit and the meter read of them (they still carry the scale)."""
        if not request.left_out:
            return {}, [], None
        groups, _held = grad_groups(request.left_out)
        flags: Flags = {}
        self.agreement.kernels.check_(groups, None, flags)
        fit, reading = self.agreement.home.host.policy.fit, None
        if counting or fit:
            read = (book, (groups,), list(request.left_out), device, None, fit, counting)
            reading = self.agreement.readings.read(*read)
        return groups, [(0, flag) for flag in flags.values()], reading

    def _clip_(
        self,
        groups: NormGroups,
        max_norm: float,
        total_norm: torch.Tensor,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """Pass 2: multiply every gradient by `inv_scale * min(1, max_norm / (total + 1e-6))`.

        On the device, without a host synchronisation, in five scalar kernels and one per group.
        On an overflow (`found_inf` 1.0: the step will be skipped) it only unscales, where torch
        would turn the gradients to NaN, so that what overflowed can still be seen. A norm that
        is non-finite without an overflow (p-th powers beyond float32's range, p > 2) clips to
        zero, as torch does. Without `found_inf` (a disabled scaler, which skips nothing) it
        clips exactly as torch does: a non-finite norm turns the gradients to 0 or NaN.
        """
        device = total_norm.device
        known = self._max_norm.get(device)
        if known is None or known[0] != max_norm:
            full = torch.full((), max_norm, dtype=torch.float32, device=device)
            known = self._max_norm[device] = (max_norm, full)
        coef = torch.div(known[1], total_norm + _CLIP_EPS)
        if found_inf is None:  # torch's clamp, which keeps a NaN
            factor = torch.clamp(coef, max=1.0)
        else:  # fmin/fmax ignore a NaN (a NaN norm: an overflow), so an overflow gives exactly 1
            factor = torch.fmax(torch.fmin(coef, self.agreement.kernels.one(device)), found_inf)
        if inv_scale is not None:
            factor = factor * move(inv_scale, device)
        self.agreement.kernels.multiply_(groups, factor)


def _local_norms_(
    groups: NormGroups,
    norm_type: float,
    inv_scale: torch.Tensor,
    flags: Flags,
    out: torch.Tensor,
) -> None:
    """Pass 1 (read only): this rank's share of the unscaled global norm, into `out` (the
    ballot's float32 slot), and the check.

    The per-tensor norms of every group with the same replica count are moved to `out`'s
    device (a non-blocking copy from the CPU: CPU-offloaded gradients cost no device-to-host
    copy here), stacked in one kernel, then unscaled and checked in one more (the check
    kernel, which raises `flags[device]` where a norm is non-finite: pass the ballot's flags
    where [`exact_norm_check()`][exact_norm_check] holds), then reduced in one, straight into
    `out` (more for p other than 1, 2 and inf, or several replica counts). So the kernels per
    step grow with the number of groups, never with the number of tensors.

    The share is `sum |g * inv_scale|_p^p / r` (the max for the inf-norm), zero without
    gradient elements, non-finite where a norm was.
    """
    device = out.device
    if device not in flags:
        flags[device] = torch.zeros((), dtype=torch.float32, device=device)
    pieces: dict[int, list[torch.Tensor]] = {}
    for (_device, _dtype, replicas), grads in groups.items():
        pieces.setdefault(replicas, []).append(move(_norms(grads, norm_type), device))
    reduce = torch.amax if math.isinf(norm_type) else torch.sum
    share: torch.Tensor | None = None
    for replicas, parts in pieces.items():
        size = sum(map(torch.Tensor.numel, parts))
        norms = torch.cat(parts, out=torch.empty(size, dtype=torch.float32, device=device))
        check_and_unscale_([norms], flags[device], move(inv_scale, device))
        direct = len(pieces) == 1 and (replicas == 1 or math.isinf(norm_type))
        if norm_type == 2.0:  # the common case in one kernel: a dot product
            part = torch.dot(norms, norms, out=out) if direct else torch.dot(norms, norms)
        elif norm_type == 1.0 or math.isinf(norm_type):
            part = reduce(norms, 0, out=out) if direct else reduce(norms, 0)
        else:
            part = norms.pow(norm_type).sum()
        if replicas != 1 and not math.isinf(norm_type):  # a max: replicas need no weight
            part = part / replicas
        if share is not None:
            part = torch.maximum(share, part) if math.isinf(norm_type) else share + part
        share = part
    if share is None:
        out.zero_()
    elif share is not out:
        out.copy_(share)


def _total_norm(ballot: Ballot, norm_type: float) -> torch.Tensor:
    """The agreed global norm: the largest inf-norm share, or the summed p-th powers' root."""
    if math.isinf(norm_type):
        shares = ballot.tensor[ballot.layout.inf_norms]
        return shares[0] if len(shares) == 1 else shares.amax()
    total = ballot.norm
    return total if norm_type == 1.0 else total.pow(1.0 / norm_type)


def _overlaps(check: Check, clip: Check) -> bool:
    """Whether `check` (a waiting `unscale_()`'s) holds some of the clip's parameters."""
    return not check.param_ids.isdisjoint(clip.param_ids)


def exact_norm_check(groups: NormGroups, norm_type: float) -> bool:
    """Whether a non-finite norm means a non-finite element, and nothing else.

    True for `p <= 2` and the inf-norm over gradients of at most float32 range: their float64
    sums cannot overflow. Otherwise the caller checks the elements in an extra pass.
    """
    small_p = norm_type <= 2.0 or math.isinf(norm_type)
    return small_p and torch.float64 not in map(_DTYPE, groups)


def _one_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view of exactly `tensors`' elements where they tile one buffer back to back (the same
    `_base`, each contiguous, each starting where the one before ends: FSDP2's shards of its
    reduce-scatter output), else None. Checked afresh at each call, all in C."""
    base = tensors[0]._base
    if base is None:
        return None
    starts = list(map(torch.Tensor.storage_offset, tensors))
    ends = list(map(operator.add, starts, map(torch.Tensor.numel, tensors)))
    tiled = starts[1:] == ends[:-1] and all(map(torch.Tensor.is_contiguous, tensors))
    if tiled and all(map(operator.is_, map(_BASE, tensors), [base] * len(tensors))):
        return tensors[0].as_strided((ends[-1] - starts[0],), (1,))
    return None


def _dtensor_replicas(grad: DTensor) -> int:
    """The product of the mesh sizes of `grad`'s `Replicate` dimensions."""
    replicas = 1
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(
                "a gradient's placements must be Shard or Replicate to take its norm, got "
                f"{tuple(grad.placements)}: a Partial gradient is a sum still to be reduced "
                "(redistribute it first)"
            )
        # is_replicate(), not `not is_shard()`: FSDP2 x TP's _StridedShard is no Shard
        # (is_shard() False), yet shards all the same
        if placement.is_replicate():
            replicas *= grad.device_mesh.size(dim)
    return replicas


def warn_plain_replicas_assumed(replicas: int, world_size: int) -> bool:
    """Warn where the default replica group is most likely wrong: plain gradients clipped on a
    rank that never scaled (a pipeline stage), taken as replicated on every rank. Whether it
    warned (callers warn once)."""
    if replicas != world_size or world_size == 1:
        return False
    warnings.warn(
        "clip_grad_norm_ on a rank that never called scale() (a pipeline stage that computes "
        "no loss?) got plain (non-DTensor) gradients and, with replica_group=None, takes "
        f"them as replicated on all {world_size} ranks of the scaler's group (as under DDP). "
        "If they are this stage's own, pass replica_group= (the stage's data-parallel group, "
        "or 1 for pure pipeline parallelism): otherwise the norm is too small.",
        ShardScaleWarning,
        stacklevel=5,
    )
    return True


def _norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per-tensor p-norms, taken in float64 where their p-th powers need it, never overflowing
    for finite elements ([`Kernels`][], pass 1).

    On an accelerator one 1-D float64 tensor: one `_foreach_norm`, stacked in one kernel (a
    launch per ~128 norms on CUDA; concatenated into float32 with the other groups' instead, each
    norm took a launch of its own, as the first GPU run counted: 428 for 400 tensors). On the CPU
    one 1-D float32 tensor.
    """
    if math.isinf(norm_type):  # an empty shard's inf-norm raises; its every p-norm is 0
        device, grads = grads[0].device, [grad for grad in grads if grad.numel()]
        if not grads:  # this rank still joins the collective, with a share of 0
            return torch.zeros(1, dtype=torch.float32, device=device)
    if grads[0].device.type != "cpu":
        return torch.stack(foreach_norm(grads, norm_type, dtype=torch.float64))
    norms = torch.stack(foreach_norm(grads, norm_type, dtype=torch.float32))
    if math.isinf(norm_type) or bool(norms.isfinite().all()):  # a host read: free on the CPU
        return norms
    # a norm (not its p-th power) of finite elements fits float32
    return torch.stack(foreach_norm(grads, norm_type, dtype=torch.float64)).float()
