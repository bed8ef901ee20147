"""What a gradient is, whatever wraps it: the one place that knows the gradient kinds.

Whatever the parallelism, the gradient an optimizer sees is one of:

* a plain tensor: single process, DDP, pipeline stages, FSDP1's ``use_orig_params`` views;
* an FSDP1 flat parameter's gradient: one flat shard holding slices of many original
  parameters (:func:`original_slices` cuts it back);
* a DTensor (FSDP2, HSDP, tensor and expert parallel): we take its local shard and never rely on
  DTensor's own reductions, and read its layout from its public ``device_mesh`` and
  ``placements``;
* a sparse tensor: we use its coalesced values.

Three questions are answered here and nowhere else: which elements this rank holds
(:func:`local_grad`, :func:`collect_local_grads`), how many ranks hold the same elements
(:func:`replica_count`, for a global norm that counts every element once), and which original
parameter an element belongs to (:func:`original_slices`, for naming overflows).

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

__all__ = [
    "GradGroups",
    "collect_local_grads",
    "grads_device",
    "holds_elements",
    "local_grad",
    "original_slices",
    "replica_count",
]

GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
"""Local gradient tensors keyed by (device, dtype): one fused kernel call per key."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLAT_PARAM = "_flat_param"


def _coalesced_(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Coalesce a sparse gradient in place on ``param``; half precision sums through fp32."""
    if grad.is_coalesced():
        return grad
    if grad.dtype in _HALF_DTYPES:
        coalesced = grad.float().coalesce().to(grad.dtype)
    else:
        coalesced = grad.coalesce()
    param.grad = coalesced
    return coalesced


def collect_local_grads(params: Iterable[torch.Tensor]) -> GradGroups:
    """Group this rank's local gradient tensors of ``params`` by (device, dtype).

    Empty shards stay in their group (the kernel passes over them); whether this rank holds any
    gradient element at all is :func:`holds_elements`'s question. Uncoalesced sparse gradients
    are coalesced in place first (see the module docstring).

    Raises:
        TypeError: a gradient is not floating point (it could not hold an inf or a NaN).
    """
    local: list[torch.Tensor | None] = []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            # What to_local() returns under no_grad, without its Python overhead: this loop runs
            # once per parameter per step, and hundreds of parameters are common.
            grad = grad._local_tensor
        if grad.is_sparse:
            grad = _coalesced_(param, grad)._values()
        local.append(grad)
    groups: GradGroups = {}
    if not local:  # a rank that ran no backward; the grouping helper rejects empty input
        return groups
    grouped = _group_tensors_by_device_and_dtype([local], with_indices=False)  # C++, one pass
    for (device, dtype), (tensor_lists, _) in grouped.items():
        if not dtype.is_floating_point:
            raise TypeError(
                f"gradients must be floating point to be checked for inf/NaN, got {dtype}"
            )
        groups[(device, dtype)] = cast(list[torch.Tensor], tensor_lists[0])  # no None was given
    return groups


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds, for reading (norms, locating overflows).

    A DTensor's local shard; a sparse gradient's coalesced values (coalesced into a copy if it
    is not yet: duplicates sum only then, and that sum is what may overflow); else ``grad``.
    :func:`collect_local_grads` walks the same way, coalescing in place.
    """
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    if grad.is_sparse:
        grad = (grad if grad.is_coalesced() else grad.coalesce())._values()
    return grad


def holds_elements(groups: GradGroups) -> bool:
    """Whether any gradient in ``groups`` has an element (empty shards do not count)."""
    return any(grad.numel() > 0 for grads in groups.values() for grad in grads)


def grads_device(params: Iterable[torch.Tensor]) -> torch.device:
    """Where the local gradients of ``params`` live: the first gradient's (local) device.

    Else the first parameter's (a rank that holds no gradient yet), else the CPU. A rank that
    computes no loss (a pipeline stage before the last) puts the scale state there.
    """
    first_param: torch.Tensor | None = None
    for param in params:
        if param.grad is not None:
            return local_grad(param.grad).device
        if first_param is None:
            first_param = param
    if first_param is not None:
        local = first_param._local_tensor if isinstance(first_param, DTensor) else first_param
        return local.device
    return torch.device("cpu")


@functools.lru_cache(maxsize=256)
def _dtensor_replicas(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> int:
    """Cached per sharding layout: a model has few, and its parameters repeat them."""
    replicas = 1
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(
                "a gradient's placements must be Shard or Replicate to take its norm, got "
                f"{placements}: a Partial gradient is a sum still to be reduced (redistribute it "
                "first)"
            )
        if placement.is_replicate():  # not `not is_shard()`: FSDP2 x TP's _StridedShard is no
            replicas *= mesh.size(dim)  # Shard (is_shard() is False), yet shards all the same
    return replicas


def replica_count(param: torch.Tensor, plain_replicas: int) -> int:
    """How many ranks hold the same local gradient elements as this rank does for ``param``.

    * DTensor: read from its own ``device_mesh`` and ``placements``: the product of the mesh
      sizes of its ``Replicate`` dimensions (HSDP's replicate dimension, a TP ``Replicate``).
      Ranks outside its mesh hold other parameters (another pipeline stage, other experts)
      or other shards, so disjoint stages and expert shards add up.
    * Plain tensor: ``plain_replicas``, the ranks the caller says replicate it (DDP: the whole
      group; a pipeline stage: its data-parallel group; pure pipeline: 1).
    * FSDP1 flat parameter: ``plain_replicas`` ranks hold it, in as many shards as it has.
    * A parameter FSDP1 flattened (``use_orig_params=True``): taken as fully sharded, 1.
    """
    grad = param.grad
    if isinstance(grad, DTensor):
        return _dtensor_replicas(grad.device_mesh, tuple(grad.placements))
    if getattr(param, "_is_flat_param", False):
        unsharded: int = param._padded_unsharded_size.numel()  # type: ignore[attr-defined]
        sharded: int = max(param._sharded_size.numel(), 1)  # type: ignore[attr-defined]
        return max(plain_replicas // max(unsharded // sharded, 1), 1)
    if getattr(param, "_fsdp_flattened", False):
        return 1
    return plain_replicas


def original_slices(name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, local gradient elements)`` per original parameter held in ``param``'s gradient.

    One pair for most parameters; an FSDP1 flat parameter yields the slice of each original
    parameter that lies in this rank's shard, cut by the offsets FSDP records, named
    ``<module prefix>.<original name>``. Nothing when ``param`` has no gradient.
    """
    grad = param.grad
    if grad is None:
        return
    local = local_grad(grad)
    if not getattr(param, "_is_flat_param", False):
        yield name, local
        return
    prefix = name[: -len(_FLAT_PARAM)] if name.endswith(_FLAT_PARAM) else f"{name}."
    flat = local.reshape(-1)
    for fqn, info in zip(param._fqns, param._shard_param_infos, strict=True):  # type: ignore[attr-defined]
        if info.in_shard:
            start = info.offset_in_shard
            yield prefix + fqn, flat[start : start + info.numel_in_shard]
