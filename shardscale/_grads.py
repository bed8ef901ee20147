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
"""

from __future__ import annotations

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
    dtensor_spec,
    flat_param_sizes,
    flat_param_slices,
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


def move_together(
    grad_scale: torch.Tensor | None, found_inf: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`grad_scale` and `found_inf` on `device`: themselves when there, else ONE copy (both
    stacked: one blocking copy to the CPU, not two)."""
    if found_inf.device == device and (grad_scale is None or grad_scale.device == device):
        return grad_scale, found_inf
    if grad_scale is None or grad_scale.dtype != found_inf.dtype:
        return None if grad_scale is None else move(grad_scale, device), move(found_inf, device)
    both = move(torch.stack((grad_scale.reshape(()), found_inf)), device)
    return both[0].reshape(grad_scale.shape), both[1]


def local_grads(params: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[int], bool]:
    """The local gradients of `params` that exist, their positions in `params`, and whether any
    holds an element (an empty shard does not).

    An uncoalesced sparse gradient is coalesced in place on its parameter first (half precision
    sums through fp32; see the module docstring); `local_grad` reads one without touching it.

    Raises:
        TypeError: a gradient is not floating point (it cannot hold an inf or a NaN).
    """
    # Reading .grad on a DTensor parameter goes through __torch_function__ (~0.25 us); with it
    # disabled, 0.1 us, as on a plain tensor. This runs per parameter per step.
    with no_torch_function_subclass():
        grads: list[torch.Tensor | None] = list(map(_GRAD, params))
    present, positions, has_elements = [], [], False
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
        has_elements = has_elements or grad.numel() > 0
    return present, positions, has_elements


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


def grads_device(params: Iterable[torch.Tensor]) -> torch.device:
    """Where the local gradients of `params` live: the first gradient's (local) device.

    Else the first parameter's (a rank that holds no gradient yet), else the CPU. A rank that
    computes no loss (a pipeline stage before the last) puts the scale state there.
    """
    first: torch.Tensor | None = None
    for param in params:
        if param.grad is not None:
            return local_grad(param.grad).device
        first = param if first is None else first
    if first is None:
        return torch.device("cpu")
    return (local_tensor(first) if isinstance(first, DTensor) else first).device


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
        whether any holds an element.

        Raises:
            TypeError: a gradient is not floating point.
        """
        grads, _positions, has_elements = local_grads(tuple(params))
        groups: GradGroups = {}
        if grads:
            for key, (tensor_lists, _indices) in group_by_device_and_dtype(
                [cast(Any, grads)]
            ).items():
                groups[key] = cast(list[torch.Tensor], tensor_lists[0])
        return groups, has_elements

    def norm_groups(
        self, params: Iterable[torch.Tensor], plain: int
    ) -> tuple[NormGroups, bool, bool]:
        """`params`' local gradients by (device, dtype, replica count) for a global norm
        ([`NormGroups`][]; `plain`: how many ranks hold the same plain gradients); whether any
        was a plain tensor (its count came from `plain`); whether any holds an element.

        On the CPU a kernel over many tensors is a loop of kernels (a norm ~2 us each): a group
        tiling one buffer back to back is taken as one view of it ([`_one_view`][]), for 0.5 us
        a tensor (docs/benchmarks.md).

        Raises:
            TypeError: a gradient is not floating point.
        """
        params = tuple(params)
        grads, positions, has_elements = local_grads(params)
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
        return groups, any_plain, has_elements

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
