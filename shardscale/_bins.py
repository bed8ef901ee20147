"""The gradients' range, read beside the agreement: the fit's peak and the meter's 128 bins.

Two features read how large the gradients are, and ride the step's one collective
(`shardscale._check`'s ballot carries what they read; here it is made and read back):

* the fit (`scale_policy="fit"`): each rank's largest |scaled gradient| that fp16 had to hold,
  in one backward ([`Fp16Gradients`][]). It travels in the ballot's slot for this rank (one per
  rank: the ballot reduces by SUM), so that the largest survives the reduction (a NaN as an inf:
  fp16's overflows mostly reach the gradients as NaN, and a NaN beside an inf must not hide
  it); the fit then takes the power of two just above the group's largest ([`power_above`][]);
* the underflow meter (every `underflow_every` steps, where [`can_count`][]): 128 slots,
  one per power of two, slot i for magnitudes in [2^(i+BIN_LOW-1), 2^(i+BIN_LOW)), 2^-64 to 2^64
  in all; each counts this rank's non-zero gradient elements in it ([`counted`][]), the counts add
  up over the ranks (a SUM), and [`meter_reading`][] reads off the fraction below fp16's normal
  range and the scale that would keep all but `UNDERFLOW_TARGET` of them above it.

"Underflow" has one definition, here, for the meter, `find_underflowing_grads`, the activation
watch and the example job: of the non-zero gradient elements whose scaled magnitude lies in the
bins' range [2^-64, 2^64], those below `UNDERFLOW_BELOW` (2^-14: subnormal in fp16, or flushed to
zero) ([`underflow_counts`][] counts them directly, the meter through its bins).
"""

from __future__ import annotations

import functools
import math
import re
import warnings
import weakref
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from shardscale._errors import ShardScaleWarning
from shardscale._grads import GradGroups, NormGroups, grad_groups, move
from shardscale._policy import FIT_MAX_MARGIN, FIT_MAX_STREAK, ScalePolicy
from shardscale._torch import foreach_norm, local_tensor

# The bins: how many, and the power of two that bounds slot 0 from above (module docstring).
BINS, BIN_LOW = 128, -63
# fp16's smallest normal magnitude (a scaled gradient below it is subnormal in fp16, or flushed
# to zero), and the meter's target: the fraction of the non-zero elements allowed below it.
UNDERFLOW_BELOW, UNDERFLOW_TARGET = 2.0**-14, 1e-3
# The log2 range `histc` counts: slot i is [i + BIN_LOW - 1, i + BIN_LOW).
_LOG_RANGE = (BIN_LOW - 1, BIN_LOW + BINS - 1)
# The slots below UNDERFLOW_BELOW: 0 .. _BELOW - 1.
_BELOW = int(math.log2(UNDERFLOW_BELOW)) - BIN_LOW + 1
Groups = tuple[GradGroups | NormGroups, ...]


def _logs(values: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """log2 of |`values`| times `scale`, float32, in a new tensor (never the gradient itself)."""
    magnitudes = values.abs().float()
    if scale is not None:
        magnitudes.mul_(
            move(scale, magnitudes.device) if isinstance(scale, torch.Tensor) else scale
        )
    return magnitudes.log2_()


def can_count(device: torch.device) -> bool:
    """Whether elements may be counted on `device` (`histc`): not on CUDA with deterministic
    algorithms on, where `histc` has no deterministic kernel and would raise."""
    return device.type != "cuda" or not torch.are_deterministic_algorithms_enabled()


def underflow_counts(values: torch.Tensor, scale: float) -> torch.Tensor:
    """`[below, counted]` of `values` times `scale` (module docstring): the non-zero elements in
    the bins' range, and those of them below `UNDERFLOW_BELOW`; int64, on `values`' device."""
    logs = _logs(values, scale)
    counted = (logs >= _LOG_RANGE[0]) & (logs <= _LOG_RANGE[1])
    below = counted & (logs < math.log2(UNDERFLOW_BELOW))
    return torch.stack((below.sum(), counted.sum()))


def meter_reading(counts: torch.Tensor, scale: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The meter's reading of the group's `counts` (float64), on the device: `[step, the
    fraction of the counted elements below UNDERFLOW_BELOW at `scale`, the lowest scale, this
    one times a power of two, at which at most UNDERFLOW_TARGET of them would be]` (the scale
    NaN without a counted element)."""
    total = counts.sum()
    shares = counts.cumsum(0) / total  # at each slot: the fraction at or under it
    shift = _BELOW - (shares <= UNDERFLOW_TARGET).sum()  # slots to move up (or down)
    fitted = torch.where(total > 0, scale * torch.exp2(shift), math.nan)
    return torch.stack([step, shares[_BELOW - 1], fitted.double()])


def counted(groups: Groups, device: torch.device, scale: torch.Tensor | None) -> torch.Tensor:
    """The meter's bins of `groups` (times `scale`, for gradients unscaled already): how many
    non-zero elements fall in each slot (zeros, inf, NaN and magnitudes beyond the range in
    none), float32 on `device`. Four kernels per tensor (abs, log2, `histc`, the add into the
    bins; a fifth casts fp16/bf16 to float32, another multiplies by `scale`), a temporary of one
    tensor's size at a time, no host read."""
    bins = torch.zeros(BINS, dtype=torch.float32, device=device)
    for group in groups:
        for grads in group.values():
            for grad in grads:
                bins += move(torch.histc(_logs(grad, scale), BINS, *_LOG_RANGE), device)
    return bins


def peak(groups: Groups, device: torch.device, scale: torch.Tensor | None) -> torch.Tensor | None:
    """The fit's reading of `groups`: their largest |gradient| (times `scale`, for gradients
    unscaled already), a float32 scalar on `device` (non-finite where one is); None without a
    gradient element (an empty shard holds none, and its inf-norm would raise: it reads as
    nothing, and the rank still joins the collective). One read pass: a kernel per (device,
    dtype) group, and two more."""
    norms = []
    for group in groups:
        for grads in group.values():
            held = [grad for grad in grads if grad.numel()]
            if held:
                norms += [
                    move(norm, device) for norm in foreach_norm(held, math.inf, dtype=torch.float32)
                ]
    if not norms:
        return None
    largest = torch.stack(norms).amax()
    return largest if scale is None else largest * move(scale, device)


def power_above(value: torch.Tensor) -> torch.Tensor:
    """The power of two just above `value` (>= 0, finite): 2^e with `value` < 2^e; 0 for 0."""
    return torch.ldexp(torch.sign(value), torch.frexp(value).exponent)


# Autograd nodes that only move a gradient on its way to a leaf (views; the splits and copies of
# FSDP1's flat parameters; module hooks): the node before them says where it formed.
_THROUGH = re.compile(
    r"(Unsafe)?(View|Reshape|ReshapeAlias|AsStrided|Alias|Slice|Select|Narrow|T|Transpose|Permute"
    r"|Expand|Squeeze|Unsqueeze|Split|SplitWithSizes|Unbind|Cat|Stack|Clone|Flatten|Unflatten)"
    r"Backward\d"
    # torch's own autograd Functions that hand a gradient on unchanged in precision: module
    # hooks, DTensor's to_local()/from_local() and redistribution, DDP's and FSDP2's markers
    r"|(BackwardHookFunction|_ToTorchTensor|_FromTorchTensor|Redistribute|NestedRedistribute"
    r"|_DDPSink|RegisterPreBackwardFunction|RegisterPostBackwardFunction)Backward"
    # weight_norm's reparametrization (w = g v / |v|, both APIs): g's and v's gradients are the
    # weight's, projected and rescaled, of its magnitude: they stand for the fp16 one the cast
    # formed, which no leaf holds
    r"|WeightNormInterfaceBackward\d"
)
# autocast's cast of a parameter (and any `.to`): its gradient formed in the cast's dtype
_CAST = "ToCopyBackward0"
# a backward that cannot be looked into: torch.compile's (AOTAutograd's), and any other
# autograd Function written in Python (one that casts inside: Transformer Engine's, apex's,
# `custom_fwd(cast_inputs=torch.float16)`; reentrant checkpointing's recompute)
_OPAQUE = "CompiledFunctionBackward"
# where a gradient formed, the weakest first: a leaf reached along several paths takes the last
_FORMED = ("fp32", _OPAQUE, "fp16")


class Fp16Gradients:
    """What the fit reads: the gradients formed in fp16, one backward at a time.

    Under fp16 autocast a Linear's weight and bias are cast to fp16, so their gradients form in
    fp16 (and reach the fp32 `.grad` through the cast's backward, unchanged); a LayerNorm's, an
    embedding's, a gain's form in fp32 and cannot overflow fp16's range. So the losses of the
    first iteration are walked, each once: a leaf reached through a cast, or of
    dtype float16 (a model in fp16, FSDP2's `param_dtype`), forms its gradient in fp16; one
    reached only through torch's own ops forms it in fp32 and is not read; one behind a backward
    that cannot be looked into (torch.compile's, an autograd Function written in Python, which
    may cast inside) is read, with a warning, once (the safe side). A step that holds gradients
    of leaves no walk met (an expert routed later, a layer unfrozen, one inside reentrant
    checkpointing) reads them from `.grad`, also under accumulation (the sum: the safe side;
    under FSDP2, where they cannot be told apart, the sharded `.grad` is read whole), and the
    next iteration's losses are walked again; where nothing forms in fp16 (no autocast, no fp16
    parameter), there is nothing to tell apart, and every gradient is read.

    With one backward an iteration the fit reads `.grad` at the step (one pass, as before).
    Accumulated micro-batches make `.grad` up to K times any one backward's fp16 tensor, so from
    the iteration's second loss on, each backward's own gradients are read as they arrive (a
    hook per fp16-formed leaf: one small kernel per gradient tensor per backward), the first
    backward's from `.grad` when the second loss is scaled; the step's `.grad` pass then only
    says whether anything is non-finite. Where the graph's leaves are not the optimizer's
    parameters (FSDP2 all-gathers unsharded ones, whose gradients are the fp16 tensors; the
    optimizer's sharded `.grad` is their reduction), every backward is read that way, from
    the second iteration on.
    """

    def __init__(self) -> None:
        self.fp32_formed: frozenset[int] = frozenset()
        """The ids of the leaves whose gradients form in fp32: not read."""
        self._leaves: list[weakref.ref[torch.Tensor]] = []  # the fp16-formed ones
        self._leaf_ids: set[int] = set()  # every leaf's the walks met
        # whether this iteration's losses are walked, and the next one's; how many gradients a
        # step held that no walk met, when a walk was last asked for (a gradient no graph
        # shows, one written by hand, asks once)
        self._walking, self._walk_next, self._unmet_asked = False, True, 0
        self._opaque_said = False  # the opaque backwards' warning: said once
        # whether the graph's leaves are others than the optimizer's parameters (FSDP2's
        # unsharded ones): then every backward is read as it arrives (None: not known yet)
        self._foreign: bool | None = None
        self._readings: list[torch.Tensor] | None = None  # this iteration's, once it accumulates
        self._losses: list[torch.Tensor] = []
        # the hooks on the parameters are the reader's: removed with it, or when the fit stops
        self._hooks: list[RemovableHandle] = []
        weakref.finalize(self, _remove, self._hooks)

    def close(self) -> None:
        """Forget the graph and remove the hooks (the fit no longer runs: a load switched the
        policy); a fit that runs again walks the next loss's graph afresh."""
        _remove(self._hooks)
        self.fp32_formed, self._leaf_ids, self._leaves = frozenset(), set(), []
        self._walking, self._walk_next, self._unmet_asked = False, True, 0
        self._foreign, self._readings, self._losses = None, None, []

    def saw_loss(self, loss: torch.Tensor, book: Any) -> None:
        """`scale()` took `loss`, the latest of the iteration `book`'s losses; per-backward
        readings of this iteration go to `book.fit_readings`."""
        losses, readings = book.losses, book.fit_readings
        if len(losses) == 1:  # an iteration's first loss
            self._walking, self._walk_next = self._walk_next, False
        if self._walking and loss.grad_fn is not None:
            self._look(loss)
        self._losses, self._readings = losses, readings
        if len(losses) == 2:  # the first backward is over: its gradients are .grad now
            leaves = [leaf for ref in self._leaves if (leaf := ref()) is not None]
            groups, _ = grad_groups(leaves)
            first = peak((groups,), loss.device, None)
            if first is not None:
                readings.append(first)

    def read(
        self,
        groups: tuple[Any, ...],
        params: list[torch.Tensor],
        device: torch.device,
        scale: torch.Tensor | None,
        book: Any,
    ) -> torch.Tensor | None:
        """The largest |scaled gradient| of the iteration `book`'s backwards: of `groups`, the
        `.grad` of `params` (times `scale` where unscaled already), those formed in fp32 left
        out; or the largest each backward held (`book.fit_readings`: under accumulation, and
        where the graph's leaves are not `params`, FSDP2's unsharded parameters), where `.grad`
        is finite (a non-finite `.grad` says so itself)."""
        if self._foreign is None and self._leaf_ids:  # learnt once, at the first step
            self._foreign = not any(id(param) in self._leaf_ids for param in params)
        if self.fp32_formed and not self._foreign:
            kept = (param for param in params if id(param) not in self.fp32_formed)
            groups = (grad_groups(kept)[0],)
        readings = book.fit_readings
        largest = peak(groups, device, scale)
        unmet = self._unmet(params)
        if not readings or largest is None:
            return largest
        each = torch.stack([move(reading, device) for reading in readings]).amax()
        if unmet:  # no walk met them, so no hook read them: their `.grad`
            late = largest if self._foreign else peak((grad_groups(unmet)[0],), device, scale)
            each = each if late is None else torch.maximum(each, late)
        return torch.where(torch.isfinite(largest), each, largest)

    def _unmet(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of `params` holding a gradient that no walk met (under FSDP2, whose leaves are
        others, all of them where there are more such gradients than leaves met); the next
        iteration's losses are walked when there are more of them than when it was last asked."""
        held = [param for param in params if param.grad is not None]
        unmet = [param for param in held if id(param) not in self._leaf_ids]
        if self._foreign:
            unmet = held if len(held) > len(self._leaf_ids) else []
        if len(unmet) > self._unmet_asked:
            self._walk_next, self._unmet_asked = True, len(unmet)
        return unmet

    def _look(self, loss: torch.Tensor) -> None:
        """Walk `loss`'s graph: which leaves no walk met before form their gradient in fp32
        (not read), and a hook on each of the others, for the backwards of accumulated
        micro-batches (a leaf taken for fp32 before and reached through a cast now joins them)."""
        fp16, fp32, opaque = _leaves_by_precision(loss.grad_fn)
        if not fp16:  # nothing forms in fp16 (no autocast, no fp16 leaf): nothing to tell apart
            fp16, fp32 = fp32, []
        known = set(self._leaf_ids)
        fp16 = [leaf for leaf in fp16 if id(leaf) not in known or id(leaf) in self.fp32_formed]
        self.fp32_formed = self.fp32_formed | {id(leaf) for leaf in fp32 if id(leaf) not in known}
        self.fp32_formed -= {id(leaf) for leaf in fp16}
        self._leaf_ids.update(map(id, [*fp16, *fp32]))
        for leaf in fp16:
            self._leaves.append(weakref.ref(leaf))
            hook = functools.partial(_read_backward, weakref.ref(self))
            self._hooks.append(leaf.register_hook(hook))  # type: ignore[no-untyped-call]
        if opaque and not self._opaque_said:
            self._opaque_said = True
            warnings.warn(_OPAQUE_WARNING.format(count=opaque), ShardScaleWarning, stacklevel=4)

    def on_backward(self, grad: torch.Tensor) -> None:
        """One leaf's gradient in one backward (a hook): read from the iteration's second loss,
        and always where the leaves are not the optimizer's parameters."""
        readings = self._readings
        wanted = len(self._losses) >= 2 or self._foreign
        if readings is not None and wanted and not grad.is_sparse:
            values = local_tensor(grad) if isinstance(grad, DTensor) else grad
            if values.numel():  # an empty shard's inf-norm raises; it holds nothing to read
                readings.append(torch.linalg.vector_norm(values, math.inf, dtype=torch.float32))


# What the fit and the meter read of a check's gradients: the largest |scaled gradient| (the
# fit's; None without it), and the counts by power of two (the meter's steps; else None).
Reading = tuple[torch.Tensor | None, torch.Tensor | None]

_METER_SKIPPED = (
    "step {step}: the underflow meter (underflow_every) could not read this step: CUDA's "
    "deterministic mode is on, and histc has no deterministic kernel. It reads the next of its "
    "steps that can be; until one has, stats.underflow is None, never a 0 that was not measured "
    "(said once)"
)


class Readings:
    """What the fit and the meter read of a step's gradients, beside the agreement: the seam
    through which a check reaches them (`shardscale._check` calls it only on the steps they
    read, so a plain step never enters this module). What they read rides the ballot: written
    into its peak slot and bins before the collective, taken from them after it.

    Args:
        meter_every: the meter's steps (`underflow_every`; 0: never).
    """

    def __init__(self, meter_every: int) -> None:
        self.meter_every = meter_every
        self.fp16 = Fp16Gradients()  # which gradients the fit reads, per backward
        self._warned_meter = False  # that a meter step could not be read

    def can_count_on(self, step: int, device: torch.device) -> bool:
        """On one of the meter's steps: whether its counts can be made on `device` (not on CUDA
        in deterministic mode); a step that cannot is said, once."""
        if can_count(device):
            return True
        if not self._warned_meter:
            self._warned_meter = True
            warnings.warn(_METER_SKIPPED.format(step=step), ShardScaleWarning, stacklevel=6)
        return False

    def read(
        self,
        book: Any,
        groups: Groups,
        params: list[torch.Tensor],
        device: torch.device,
        scale: torch.Tensor | None,
        fit: bool,
        counting: bool,
    ) -> Reading:
        """What the fit (`fit`) and the meter (`counting`) read of `groups`, the gradients of
        `params` (times `scale`, for gradients unscaled already): the largest |gradient| fp16
        held, of those formed in fp16 ([`Fp16Gradients`][]), and the counts on the meter's
        steps."""
        largest = self.fp16.read(groups, params, device, scale, book) if fit else None
        return largest, counted(groups, device, scale) if counting else None

    def fill(
        self, peak_slot: torch.Tensor, bins: torch.Tensor, readings: list[Reading], counting: bool
    ) -> None:
        """Write this rank's `readings` into a ballot: the largest peak into its peak slot, the
        counts added up into its bins (on the meter's steps)."""
        peaks = [peak for peak, _ in readings if peak is not None]
        if peaks:  # a NaN counts as an inf: an overflow, and survives the reduction
            largest = (
                peaks[0]
                if len(peaks) == 1
                else torch.stack([move(p, peak_slot.device) for p in peaks]).amax()
            )
            largest = move(largest, peak_slot.device)
            torch.nan_to_num(largest, nan=math.inf, posinf=math.inf, out=peak_slot)
        counts = [count for _, count in readings if count is not None]
        if counting and counts:
            torch.sum(torch.stack([move(c, bins.device) for c in counts]), 0, out=bins)

    def keep(
        self,
        book: Any,
        peaks: torch.Tensor,
        bins: torch.Tensor | None,
        device: torch.device,
        fit: bool,
    ) -> None:
        """After the collective: the group's reading into `book`, on `device`: the fit's (the
        power of two above the largest of `peaks`, where `fit`), and the meter's counts (`bins`,
        on its steps)."""
        if fit:
            largest = peaks[0] if len(peaks) == 1 else peaks.amax()
            book.peaks.append(move(power_above(largest), device))
        if bins is not None:
            book.counts.append(move(bins, device))


def _remove(hooks: list[RemovableHandle]) -> None:
    for hook in hooks:
        hook.remove()
    hooks.clear()


def _read_backward(reader: weakref.ref[Fp16Gradients], grad: torch.Tensor) -> None:
    """A leaf's hook: hands its gradient to the reader, while it lives."""
    alive = reader()
    if alive is not None:
        alive.on_backward(grad)


_OPAQUE_WARNING = (
    "scale_policy='fit' cannot tell how {count} parameter(s) form their gradients: their "
    "backward is opaque (torch.compile's, or an autograd Function's written in Python, which "
    "may cast inside). It reads them all, as if formed in fp16: the safe side (where some "
    "form in fp32 it holds a lower scale than it needs). Said once"
)


def _leaves_by_precision(root: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The leaves under autograd node `root`: those whose gradients form in fp16 (reached
    through a cast, of dtype float16, or behind an opaque backward), those whose gradients
    form in fp32 (reached through other ops alone), and how many were behind an opaque one.

    One walk from the root: each node passes on where the gradient it hands down formed (a
    cast: fp16; an opaque backward: unknown; a node of `_THROUGH`: what it was handed; any
    other: fp32), and each leaf keeps the strongest it is handed along any path."""
    formed: dict[Any, str] = {}  # the leaves' AccumulateGrad nodes
    stack, seen = [(root, "fp32")], set()
    while stack:
        node, handed = stack.pop()
        name = type(node).__name__
        opaque = name.startswith(_OPAQUE) or isinstance(node, BackwardCFunction)
        here = "fp16" if name == _CAST else _OPAQUE if opaque else "fp32"
        here = handed if _THROUGH.fullmatch(name) else here
        for child, _ in node.next_functions:
            if child is None or (child, here) in seen:
                continue
            seen.add((child, here))
            if hasattr(child, "variable"):
                formed[child] = max(formed.get(child, "fp32"), here, key=_FORMED.index)
            else:
                stack.append((child, here))
    fp16 = [n.variable for n, f in formed.items() if f != "fp32" or n.variable.dtype == torch.half]
    fp32 = [n.variable for n, f in formed.items() if f == "fp32" and n.variable.dtype != torch.half]
    return fp16, fp32, sum(f == _OPAQUE for f in formed.values())


def fit_(
    policy: ScalePolicy,
    scale: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    fit: torch.Tensor,
    flags: torch.Tensor,
    seen: torch.Tensor,
) -> None:
    """Apply `policy`'s fit ([`next()`][shardscale.ScalePolicy.next] under the fit) in place,
    on the device, without a host sync: the fit's own maths, beside its reading.

    Args:
        scale: float32 scalar tensor.
        hysteresis_tracker: int32 scalar tensor on the same device.
        fit: float32 `[margin, streak, window...]`: the fit's fields of
            [`ScaleState`][shardscale.ScaleState].
        flags: the agreed float32 `[skip, forward overflow]`, each 0.0 or 1.0.
        seen: float32 scalar, the step's largest unscaled gradient bound (0 where none;
            anything, inf included, on an overflow step, where it is not read).
    """
    margin, streak, window = fit[0], fit[1], fit[2:]
    overflow, moves = flags[0] - flags[1], flags[1] == 0  # a gradient overflow; not forward
    clean = flags[0] == 0
    shifted = torch.cat((torch.where(clean, seen, 0.0).reshape(1), window[:-1]))
    widest = shifted.amax()
    fitted = torch.exp2(16.0 - margin).div_(widest).clamp_(policy.min_scale, policy.max_scale)
    if math.frexp(policy.backoff_factor)[0] == 0.5:  # a power of two: float32 is exact
        backed = scale * torch.pow(policy.backoff_factor, torch.exp2(streak))
    else:  # each product in float64, rounded once, as the reference takes it
        jump = torch.pow(policy.backoff_factor, torch.exp2(streak.double()))
        backed = (scale.double() * jump).float()
    backed.clamp_(min=policy.min_scale)
    if policy.hysteresis > 1:  # else nothing is tolerated, and the tracker stays at 1
        tolerated = (overflow > 0) & (hysteresis_tracker > 1)
        backed = torch.where(tolerated, scale, backed)
        new_tracker = torch.where(clean, policy.hysteresis, hysteresis_tracker - tolerated.int())
        torch.where(moves, new_tracker, hysteresis_tracker, out=hysteresis_tracker)
    kept = torch.where(clean & (widest > 0), fitted, scale)
    moved = torch.where(overflow > 0, backed, kept)
    torch.where(moves, moved, scale, out=scale)
    learned = window.amax() > 0  # the window said this scale was safe
    widened = (margin + overflow * learned).clamp_(max=FIT_MAX_MARGIN)
    streaked = (streak + 1).clamp_(max=FIT_MAX_STREAK) * overflow
    new_fit = torch.cat((widened.reshape(1), streaked.reshape(1), shifted))
    torch.where(moves, new_fit, fit, out=fit)
