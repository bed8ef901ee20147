"""Gradient clipping whose norm is global over shards, stages and replicas, in two passes.

The global p-norm is ``(sum over distinct elements |g|^p)^(1/p)``. Each rank adds
``|local grad|_p^p / r`` per gradient, ``r`` being how many ranks hold those same elements
(``_grads.replica_count``: DTensors say it themselves, plain tensors are replicated over the
``replica_group`` the caller names), so the sum over the group counts every element once. That
sum travels in the scaler's one agreement collective, next to the overflow flag. The inf-norm
needs no weights: its reduction is a max.

Two passes over the gradients, whatever the layout:

1. read: the per-tensor norms of the still-scaled gradients. A non-finite element makes its
   tensor's norm non-finite, so this pass is also the overflow check (for p in {1, 2, inf};
   other p take one extra check pass). Scaled fp32 gradients can be large enough that their
   squares overflow float32: norms that come out non-finite are taken again in float64
   (free to decide on the CPU; on an accelerator every norm accumulates in float64, which costs
   nothing there), so a finite gradient is never mistaken for an overflow.
2. read+write: multiply by ``inv_scale * clip_coef``, after the agreement.

Nothing is modified before the ranks have agreed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from shardscale._devices import move
from shardscale._grads import local_grad, replica_count

__all__ = ["NormGroups", "apply_", "check_clip_args", "collect_for_norm", "local_norms"]

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@dataclass(slots=True)
class NormGroups:
    """Local gradients grouped by (device, dtype, replica count), for one norm and one clip."""

    groups: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]]
    plain: bool
    """Whether any gradient is a plain tensor (its replica count came from the caller)."""

    def holds_elements(self) -> bool:
        return any(g.numel() > 0 for grads in self.groups.values() for g in grads)

    def norm_flags_exact(self, norm_type: float) -> bool:
        """Whether a non-finite norm means a non-finite element, and nothing else.

        True for ``p <= 2`` and the inf-norm over gradients of at most float32 range: their
        float64 sums cannot overflow. Otherwise the caller checks the elements in an extra pass.
        """
        small_p = norm_type <= 2.0 or math.isinf(norm_type)
        return small_p and all(dtype != torch.float64 for _, dtype, _ in self.groups)

    def by_device_dtype(self) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
        """The same tensors keyed by (device, dtype) only, as the check kernel takes them."""
        merged: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for (device, dtype, _replicas), grads in self.groups.items():
            merged.setdefault((device, dtype), []).extend(grads)
        return merged


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


def collect_for_norm(params: Iterable[torch.Tensor], plain_replicas: int) -> NormGroups:
    """This rank's gradients of ``params``, grouped for :func:`local_norms` and :func:`apply_`.

    Uncoalesced sparse gradients are coalesced in place first (duplicates sum only then).

    Raises:
        TypeError: a gradient is not floating point.
    """
    groups: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
    plain = False
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse and not grad.is_coalesced():
            param.grad = grad = grad.coalesce()
        local = local_grad(grad)
        if not local.is_floating_point():
            raise TypeError(
                f"gradients must be floating point to be checked for inf/NaN, got {local.dtype}"
            )
        replicas = replica_count(param, plain_replicas)
        plain = plain or not (
            isinstance(grad, DTensor)
            or getattr(param, "_is_flat_param", False)
            or getattr(param, "_fsdp_flattened", False)
        )
        groups.setdefault((local.device, local.dtype, replicas), []).append(local)
    return NormGroups(groups=groups, plain=plain)


def _norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per-tensor p-norms, never overflowing for finite elements (module docstring)."""
    device = grads[0].device
    if device.type != "cpu":
        return torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float64))
    norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    if math.isinf(norm_type) or bool(norms.isfinite().all()):  # a host read: free on the CPU
        return norms.double()
    redo = [i for i, finite in enumerate(norms.isfinite().tolist()) if not finite]
    again = torch._foreach_norm([grads[i] for i in redo], norm_type, dtype=torch.float64)
    norms = norms.double()
    norms[redo] = torch.stack(again)
    return norms


def local_norms(
    norm_groups: NormGroups, norm_type: float, inv_scale: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, dict[torch.device, torch.Tensor]]:
    """Pass 1: this rank's share of the unscaled global norm, and its overflow flags.

    Args:
        inv_scale: float32 scalar the gradients are still to be multiplied by.
        device: where the share is returned.

    Returns:
        ``(share, flags)``: ``share`` is ``sum |g * inv_scale|_p^p / r`` (the max for the
        inf-norm) as a float32 scalar on ``device``, zero without gradient elements; ``flags``
        holds a float32 scalar per device, 1.0 where a norm was non-finite.
    """
    share = torch.zeros((), dtype=torch.float64, device=device)
    flags: dict[torch.device, torch.Tensor] = {}
    for (grad_device, _dtype, replicas), grads in norm_groups.groups.items():
        norms = _norms(grads, norm_type)
        flag = (~norms.isfinite()).any().float()
        flags[grad_device] = (
            flag if grad_device not in flags else torch.maximum(flags[grad_device], flag)
        )
        unscaled = norms * move(inv_scale, grad_device).double()
        if math.isinf(norm_type):
            share = torch.maximum(share, move(unscaled.amax(), device))
        else:
            share = share + move(unscaled.pow(norm_type).sum() / replicas, device)
    return share.float(), flags


def apply_(
    norm_groups: NormGroups,
    max_norm: float,
    total_norm: torch.Tensor,
    inv_scale: torch.Tensor | None,
) -> None:
    """Pass 2: multiply every gradient by ``inv_scale * min(1, max_norm / (total + 1e-6))``.

    On the device, without a host synchronisation. A non-finite norm (an overflow: the step will
    be skipped) only unscales, where torch would turn the gradients to NaN, so that locating the
    overflow still sees the infs.
    """
    coef = (max_norm / (total_norm + _CLIP_EPS)).clamp_(max=1.0)
    factor = torch.where(total_norm.isfinite(), coef, torch.ones_like(coef))
    if inv_scale is not None:
        factor = factor * move(inv_scale, factor.device)
    factors: dict[torch.device, torch.Tensor] = {}
    for (device, _dtype, _replicas), grads in norm_groups.groups.items():
        if device not in factors:
            factors[device] = move(factor, device)
        torch._foreach_mul_(grads, factors[device])
