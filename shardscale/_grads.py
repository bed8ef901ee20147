"""What a gradient is, whatever wraps it, and how a step walks many of them: the one place that
knows the gradient kinds.

Whatever the parallelism, the gradient an optimizer sees is one of:

* a plain tensor: single process, DDP, pipeline stages, FSDP1's `use_orig_params` views;
* an FSDP1 flat parameter's gradient: one flat shard holding slices of many original
  parameters (`original_slices` cuts it back);
* a DTensor (FSDP2, HSDP, tensor and expert parallel): we take its local shard and never rely on
  DTensor's own reductions, and read its layout from its public `device_mesh` and `placements`;
* a sparse tensor: we use its coalesced values.

Three questions are answered here and nowhere else: which elements this rank holds
(`local_grad`, `local_grads`), how many ranks hold the same elements (`GradWalk.groups`, for a
global norm that counts every element once), and which original parameter an element belongs to
(`original_slices`, for naming overflows).

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.

A step groups its gradients afresh ([`GradWalk`][]): by (device, dtype), one fused kernel call
per group, each gradient taken as it is (FSDP2's padding between shards is never read). Nothing is
kept by gradient identity: the default loop hands new gradient tensors every step. A layout kept
while the gradients stayed the same objects, with flat buffers where FSDP2's shards tile their
reduce-scatter buffer, was measured and removed: on the default loop it paid only for
`clip_grad_norm_` over hundreds of small tensors (docs/benchmarks.md). For that clip, on the CPU,
a group whose gradients tile one buffer back to back is recognised afresh at every call and taken
as one view of exactly their elements.

The kernels a step runs over its groups (check-and-unscale, the multiply, the norms and the
clip) are here too, in [`Kernels`][], beside the groups they take: `shardscale._check` decides which
gradients go through which, and agrees with every rank on the flags they raise.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardscale._errors import ShardScaleWarning
from shardscale._torch import (
    check_and_unscale_,
    dtensor_spec,
    flat_param_sizes,
    flat_param_slices,
    foreach_mul_,
    foreach_norm,
    group_by_device_and_dtype,
    is_flat_param,
    is_fsdp_flattened,
    local_tensor,
    no_torch_function_subclass,
    sparse_values,
)

# Local gradient tensors keyed by (device, dtype): one fused kernel call per key.
GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
# Local gradients by (device, dtype, replica count): one norm and one weight per key.
NormGroups = dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_GRAD = operator.attrgetter("grad")
_BASE = operator.attrgetter("_base")
_FLAT_PARAM = "_flat_param"


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself if already there, else a copy, asynchronous only to an
    accelerator (the host must never read a CPU copy before it lands)."""
    return tensor.to(device, non_blocking=device.type != "cpu")


def local_grads(params: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[int], bool]:
    """The local gradients of `params` that exist, their positions in `params`, and whether any
    exists (an empty shard's counts, as torch records an inf check for any gradient it holds).

    An uncoalesced sparse gradient is coalesced in place on its parameter first (half precision
    sums through fp32; see the module docstring); `local_grad` reads one without touching it.

    Raises:
        TypeError: a gradient is not floating point (it cannot hold an inf or a NaN).
    """
    # Reading .grad on a DTensor parameter goes through __torch_function__ (~0.25 us); with it
    # disabled, 0.1 us, as on a plain tensor. This runs per parameter per step.
    with no_torch_function_subclass():
        grads: list[torch.Tensor | None] = list(map(_GRAD, params))
    present, positions = [], []
    for position, grad in enumerate(grads):
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            grad = local_tensor(grad)
        if not grad.is_floating_point():
            raise TypeError(
                f"gradients must be floating point to be checked for inf/NaN, got {grad.dtype}"
            )
        if grad.is_sparse:
            if not grad.is_coalesced():
                half = grad.dtype in _HALF_DTYPES
                coalesced = (grad.float() if half else grad).coalesce().to(grad.dtype)
                params[position].grad = grad = coalesced
            grad = sparse_values(grad)
        present.append(grad)
        positions.append(position)
    return present, positions, bool(present)


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds, for reading (norms, locating overflows).

    A DTensor's local shard; a sparse gradient's coalesced values (coalesced into a copy if it
    is not yet: duplicates sum only then, and that sum is what may overflow); else `grad`.
    """
    if isinstance(grad, DTensor):
        grad = local_tensor(grad)
    if grad.is_sparse:
        grad = sparse_values(grad if grad.is_coalesced() else grad.coalesce())
    return grad


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


def original_slices(name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, local gradient elements)` per original parameter held in `param`'s gradient.

    One pair for most parameters; an FSDP1 flat parameter yields the slice of each original
    parameter that lies in this rank's shard, cut by the offsets FSDP records, named
    `<module prefix>.<original name>`. Nothing when `param` has no gradient.
    """
    grad = param.grad
    if grad is None:
        return
    local = local_grad(grad)
    if not is_flat_param(param):
        yield name, local
        return
    prefix = name[: -len(_FLAT_PARAM)] if name.endswith(_FLAT_PARAM) else f"{name}."
    flat = local.reshape(-1)
    for fqn, start, numel in flat_param_slices(param):
        yield prefix + fqn, flat[start : start + numel]


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


class GradWalk:
    """A scaler's walks of its local gradients, grouped afresh at every call (module docstring).

    Nothing is cached by gradient identity: the default loop (`zero_grad()`, FSDP2's
    reduce-scatter) hands new gradient tensors every step, where a layout kept from the last
    step never matches. Only each DTensor parameter's replica count is kept, by its spec object.
    """

    def __init__(self) -> None:
        self._replicas: dict[int, tuple[object, int]] = {}  # per parameter: (spec, count)

    def groups(self, params: Iterable[torch.Tensor]) -> tuple[GradGroups, bool]:
        """`params`' local gradients by (device, dtype): one fused kernel call per group; and
        whether any exists.

        Raises:
            TypeError: a gradient is not floating point.
        """
        grads, _positions, held = local_grads(tuple(params))
        groups: GradGroups = {}
        if grads:
            for key, (tensor_lists, _indices) in group_by_device_and_dtype(
                [cast(Any, grads)]
            ).items():
                groups[key] = cast(list[torch.Tensor], tensor_lists[0])
        return groups, held

    def norm_groups(
        self, params: Iterable[torch.Tensor], plain: int
    ) -> tuple[NormGroups, bool, bool]:
        """`params`' local gradients by (device, dtype, replica count) for a global norm
        ([`NormGroups`][]; `plain`: how many ranks hold the same plain gradients); whether any
        was a plain tensor (its count came from `plain`); whether any exists.

        On the CPU a kernel over many tensors is a loop of kernels (a norm ~2 us each): a group
        tiling one buffer back to back is taken as one view of it ([`_one_view`][]), for 0.5 us
        a tensor (docs/benchmarks.md).

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
                    count, is_plain = self._replica_count(params[positions[index]], plain)
                    any_plain = any_plain or is_plain
                    groups.setdefault((device, dtype, count), []).append(grad)
        for key, tensors in groups.items():
            view = _one_view(tensors) if key[0].type == "cpu" else None
            if view is not None:
                groups[key] = [view]
        return groups, any_plain, held

    def _replica_count(self, param: torch.Tensor, plain: int) -> tuple[int, bool]:
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


# ------------------------------------------------------------------ the kernels over the groups

Groups = GradGroups | NormGroups
# One float32 scalar per device holding gradients: 1.0 where any element was non-finite.
Flags = dict[torch.device, torch.Tensor]

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
_DTYPE = operator.itemgetter(1)


def exact_norm_check(groups: NormGroups, norm_type: float) -> bool:
    """Whether a non-finite norm means a non-finite element, and nothing else.

    True for `p <= 2` and the inf-norm over gradients of at most float32 range: their float64
    sums cannot overflow. Otherwise the caller checks the elements in an extra pass.
    """
    small_p = norm_type <= 2.0 or math.isinf(norm_type)
    return small_p and torch.float64 not in map(_DTYPE, groups)


class Kernels:
    """A scaler's kernels over its gradient groups, and the constants they take.

    Unscaling and checking are one fused pass per (device, dtype) group, torch's
    `_amp_foreach_non_finite_check_and_unscale_`: it multiplies by `inv_scale` and raises a flag in
    the same pass. Measured on CPU (docs/benchmarks.md), it costs about a bare `_foreach_mul_` in
    fp16 and up to ~1.5x one in fp32 (it tests element by element there). The check-only pass of
    fused optimizers uses it too, with a factor of 1, except over large CPU tensors (64Ki elements
    and more), which it reads by their sums: a float sum is finite only where every element is, and
    the sums take about two thirds of the kernel's time there (`isfinite().all()` and
    `_foreach_norm(inf)` take ~12x a multiply, `aminmax` 1.3-3x). A non-finite sum (an overflow, or
    finite elements summing past float32's range) is checked again by the kernel, so the flag is
    exact. Per tensor, a sum costs a few us more than the kernel's share: small tensors stay with
    the kernel.

    Clipping to a global norm takes two passes, whatever the layout:

    1. read: the per-tensor norms of the still-scaled gradients, unscaled and reduced to this rank's
       share `sum |g|^p / r`, `r` being how many ranks hold those same elements (so the sum over the
       group counts every element once; the inf-norm needs no weights, its reduction is a max). A
       non-finite element makes its tensor's norm non-finite, so this pass is also the overflow
       check (for p <= 2 and the inf-norm; a larger p takes one extra check pass). Scaled fp32
       gradients can be large enough that their squares overflow float32, so a finite gradient must
       never be taken for an overflow: on the CPU, where some norm comes out non-finite, the norms
       are taken again in float64 (deciding that is a host read, free there; float64 norms cost 8x
       there; a group tiling one buffer is one tensor there, `GradWalk.groups`), on an accelerator
       every norm accumulates in float64 (a memory-bound pass either way).
    2. read+write: multiply by `inv_scale * min(1, max_norm / (total + 1e-6))`, after the agreement.

    The small constants the kernels need (a float32 one, a float64 one, a scratch flag, `max_norm`)
    are made once per device and kept here, one `Kernels` per scaler, never shared between scalers.
    """

    def __init__(self) -> None:
        self._ones: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._scratch: Flags = {}
        self._max_norm: dict[torch.device, tuple[float, torch.Tensor]] = {}

    def one(self, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A one on `device`, made once: for a kernel that wants a factor but has nothing to
        multiply by (the check-only pass, a clip of unscaled gradients). Never modify it."""
        one = self._ones.get((device, dtype))
        if one is None:
            one = self._ones[(device, dtype)] = torch.ones((), dtype=dtype, device=device)
        return one

    def inverse(self, scale: torch.Tensor) -> torch.Tensor:
        """1/scale in float32, taken in float64 as torch's scalers do (bit for bit with them).

        One kernel: the division runs in float64 (the one operand is float64) and is rounded once
        to float32 as it is stored, exactly `scale.double().reciprocal().float()`.
        """
        out = torch.empty((), dtype=torch.float32, device=scale.device)
        return torch.div(self.one(scale.device, torch.float64), scale, out=out)

    def check_(self, groups: Groups, inv_scale: torch.Tensor | None, flags: Flags) -> Flags:
        """Multiply every gradient by `inv_scale` (if given) and flag the devices with inf/NaN.

        `flags` are raised (the kernel only ever sets them to 1.0), so that several calls end
        with one flag per device; a device without one gets a new zero flag. `inv_scale` is
        copied once per device (a blocking copy to the CPU).
        """
        factors: dict[torch.device, torch.Tensor] = {}
        for key, grads in groups.items():
            device = key[0]  # (device, dtype), or (device, dtype, replica count)
            if device not in flags:
                flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            if device not in factors:
                factors[device] = self.one(device) if inv_scale is None else move(inv_scale, device)
            if inv_scale is None and device.type == "cpu" and grads[0].numel() >= 1 << 16:
                # A check only, of large CPU tensors: read, not rewrite. A sum is finite only
                # where every element is; one that is not is checked again, exactly.
                if not math.isfinite(sum(g.sum(dtype=torch.float32).item() for g in grads)):
                    check_and_unscale_(grads, flags[device], factors[device])
            else:
                check_and_unscale_(grads, flags[device], factors[device])
        return flags

    def multiply_(self, groups: Groups, factor: torch.Tensor) -> None:
        """Multiply every gradient in `groups` by the float32 scalar `factor`, in place.

        On an accelerator with the check kernel, not `_foreach_mul_`: on CUDA `_foreach_mul_`
        takes its per-tensor slow path when the factor's dtype differs from the gradients' (a
        float32 factor on fp16 or bf16 gradients: one launch per tensor), while the check kernel
        takes a float32 factor for every gradient dtype in one launch, and multiplies in the
        same precision (float32 for fp16/bf16, as `mul_` does). Its flags are scratch ones
        nobody reads.

        On the CPU with `_foreach_mul_`: there the check kernel tests element by element, up to
        1.45x the time of the vectorised multiply in fp32 (docs/benchmarks.md), and `mul_` takes
        a 0-dim CPU factor in float32 for fp16/bf16 too, never rounding it to their dtype.
        """
        on_accelerators: dict[Any, list[torch.Tensor]] = {}
        on_cpu = None  # the factor, copied to the CPU once
        for key, grads in groups.items():
            if key[0].type != "cpu":
                on_accelerators[key] = grads
                continue
            on_cpu = move(factor, key[0]) if on_cpu is None else on_cpu
            foreach_mul_(grads, on_cpu)
        if on_accelerators:
            self.check_(on_accelerators, factor, self._scratch)

    def local_norms_(
        self,
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

    def clip_(
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
            factor = torch.fmax(torch.fmin(coef, self.one(device)), found_inf)
        if inv_scale is not None:
            factor = factor * move(inv_scale, device)
        self.multiply_(groups, factor)


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
