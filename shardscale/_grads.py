"""What a gradient is, whatever wraps it: the one place that knows the gradient kinds.

Whatever the parallelism, the gradient an optimizer sees is one of:

* a plain tensor: single process, DDP, pipeline stages, FSDP1's `use_orig_params` views;
* an FSDP1 flat parameter's gradient: one flat shard holding slices of many original
  parameters (`original_slices` cuts it back);
* a DTensor (FSDP2, HSDP, tensor and expert parallel): we take its local shard and never rely on
  DTensor's own reductions, and read its layout from its public `device_mesh` and
  `placements`;
* a sparse tensor: we use its coalesced values.

Three questions are answered here and nowhere else: which elements this rank holds
(`local_grad`, `local_grads`), how many ranks hold the same elements (`replica_count`, for a
global norm that counts every element once), and which original parameter an element belongs to
(`original_slices`, for naming overflows). How a step walks many gradients at once, cached, is
`shardscale._walk`'s concern.

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

__all__ = [
    "grads_device",
    "local_grad",
    "local_grads",
    "original_slices",
    "plain_replicas",
    "replica_count",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLAT_PARAM = "_flat_param"


def _coalesced_(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Coalesce a sparse gradient in place on `param`; half precision sums through fp32."""
    if grad.is_coalesced():
        return grad
    if grad.dtype in _HALF_DTYPES:
        coalesced = grad.float().coalesce().to(grad.dtype)
    else:
        coalesced = grad.coalesce()
    param.grad = coalesced
    return coalesced


def local_grads(params: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor | None], bool]:
    """Each parameter's local gradient (None: no gradient), and whether any was sparse.

    An uncoalesced sparse gradient is coalesced in place on its parameter first (see the module
    docstring); `local_grad` reads one gradient without touching it.
    """
    # Reading .grad on a DTensor parameter goes through __torch_function__ (~0.25 us); with it
    # disabled, 0.1 us, as on a plain tensor. This runs per parameter per step.
    with torch._C.DisableTorchFunctionSubclass():
        grads = [param.grad for param in params]
    local: list[torch.Tensor | None] = []
    sparse = False
    for param, grad in zip(params, grads, strict=True):
        if grad is not None:
            if isinstance(grad, DTensor):
                grad = grad._local_tensor  # what to_local() returns, without its overhead
            if grad.is_sparse:
                sparse = True
                grad = _coalesced_(param, grad)._values()
        local.append(grad)
    return local, sparse


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds, for reading (norms, locating overflows).

    A DTensor's local shard; a sparse gradient's coalesced values (coalesced into a copy if it
    is not yet: duplicates sum only then, and that sum is what may overflow); else `grad`.
    `local_grads` walks the same way, coalescing in place.
    """
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    if grad.is_sparse:
        grad = (grad if grad.is_coalesced() else grad.coalesce())._values()
    return grad


def grads_device(params: Iterable[torch.Tensor]) -> torch.device:
    """Where the local gradients of `params` live: the first gradient's (local) device.

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
    """How many ranks hold the same local gradient elements as this rank does for `param`.

    * DTensor: read from its own `device_mesh` and `placements`: the product of the mesh
      sizes of its `Replicate` dimensions (HSDP's replicate dimension, a TP `Replicate`).
      Ranks outside its mesh hold other parameters (another pipeline stage, other experts)
      or other shards, so disjoint stages and expert shards add up.
    * Plain tensor: `plain_replicas`, the ranks the caller says replicate it (DDP: the whole
      group; a pipeline stage: its data-parallel group; pure pipeline: 1).
    * FSDP1 flat parameter: `plain_replicas` ranks hold it, in as many shards as it has.
    * A parameter FSDP1 flattened (`use_orig_params=True`): taken as fully sharded, 1.
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
    """`(name, local gradient elements)` per original parameter held in `param`'s gradient.

    One pair for most parameters; an FSDP1 flat parameter yields the slice of each original
    parameter that lies in this rank's shard, cut by the offsets FSDP records, named
    `<module prefix>.<original name>`. Nothing when `param` has no gradient.
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
