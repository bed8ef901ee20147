"""Gradient clipping whose norm is global over shards, without counting replicas twice.

Each rank holds some gradient elements; some of them other ranks hold too (DDP replicas, HSDP's
replicate dimension, a DTensor's ``Replicate`` placements). The global p-norm is
``(sum over distinct elements |g|^p)^(1/p)``, so each rank adds ``|local grad|_p^p / r`` for
each gradient, where ``r`` is the number of ranks of the group holding that same local tensor,
and the sum over the group counts every element once. That sum travels in the scaler's one
agreement collective (``Agreement.agree_with_norm``), next to the overflow flag. The inf-norm
needs no weights: its reduction is a max.

How ``r`` is found, per gradient:

* DTensor (FSDP2, HSDP, TP): the group's size over the number of distinct shards, the product
  of the mesh sizes of its ``Shard`` placements;
* FSDP1 flat parameter: the group's size over its shard count (unsharded over sharded size);
* a parameter FSDP1 flattened (``use_orig_params=True``): taken as fully sharded, ``r = 1``;
* any other tensor: taken as replicated on every rank of the group (DDP, or no wrapper).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from shardscale._devices import move
from shardscale._grads import GradGroups, local_values

__all__ = ["check_clip_args", "clip_", "local_norm_power"]


def check_clip_args(max_norm: float, norm_type: float) -> tuple[float, float]:
    """Validate ``max_norm`` (finite, > 0) and ``norm_type`` (> 0, or inf)."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm}")
    if not (norm_type > 0 and not math.isnan(norm_type)):
        raise ValueError(f"norm_type must be > 0 (or math.inf), got {norm_type}")
    return float(max_norm), float(norm_type)


@functools.lru_cache(maxsize=256)
def _dtensor_replicas(mesh: DeviceMesh, placements: tuple[Placement, ...], world_size: int) -> int:
    """Cached per sharding layout: a model has few, and its parameters repeat them."""
    shards = math.prod(mesh.size(dim) for dim, p in enumerate(placements) if p.is_shard())
    return max(world_size // int(shards), 1)


def _replicas(param: torch.Tensor, world_size: int) -> int:
    """How many ranks of the group hold the same local gradient tensor as this one."""
    if isinstance(param, DTensor):
        spec = param._spec
        return _dtensor_replicas(spec.mesh, spec.placements, world_size)
    if getattr(param, "_is_flat_param", False):
        unsharded: int = param._padded_unsharded_size.numel()  # type: ignore[attr-defined]
        sharded: int = max(param._sharded_size.numel(), 1)  # type: ignore[attr-defined]
        return max(world_size // max(unsharded // sharded, 1), 1)
    if getattr(param, "_fsdp_flattened", False):
        return 1
    return world_size


def local_norm_power(
    params: Iterable[torch.Tensor], norm_type: float, world_size: int, device: torch.device
) -> torch.Tensor:
    """This rank's share of the global norm, as a float32 scalar on ``device``.

    ``sum |g|_p^p / r`` over the local gradients for a finite p (see the module docstring);
    ``max |g|_inf`` for the inf-norm. Zero when this rank holds no gradient element.
    """
    by_device: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[float]]] = {}
    for param in params:
        if param.grad is None:
            continue
        grad = local_values(param.grad)  # sparse: coalesced in place by the check before
        grads, weights = by_device.setdefault((grad.device, grad.dtype), ([], []))
        grads.append(grad)
        weights.append(1.0 / _replicas(param, world_size))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grads, weights in by_device.values():
        norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
        if math.isinf(norm_type):
            total = torch.maximum(total, move(norms.amax(), device))
        else:
            weight = torch.tensor(weights, dtype=torch.float32, device=norms.device)
            total = total + move((norms.pow(norm_type) * weight).sum(), device)
    return total


def clip_(groups: GradGroups, max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiply every gradient by ``min(1, max_norm / (total_norm + 1e-6))``, as torch does.

    On the device, without a host synchronisation (the factor is 1 when no clipping is needed).
    A non-finite norm (an overflow: the step will be skipped) leaves the gradients as they are,
    where torch would turn them to NaN, so that locating the overflow still sees the infs.
    """
    factor = (max_norm / (total_norm + 1e-6)).clamp_(max=1.0)
    factor = torch.where(total_norm.isfinite(), factor, torch.ones_like(factor))
    factors: dict[torch.device, torch.Tensor] = {}
    for (device, _dtype), grads in groups.items():
        if device not in factors:
            factors[device] = move(factor, device)
        torch._foreach_mul_(grads, factors[device])
