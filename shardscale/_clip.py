"""Gradient clipping whose norm is global over shards, stages and replicas, in two passes.

The global p-norm is ``(sum over distinct elements |g|^p)^(1/p)``. Each rank adds
``|local grad|_p^p / r`` per gradient, ``r`` being how many ranks hold those same elements
(``_grads.replica_count``: DTensors say it themselves, plain tensors are replicated over the
``replica_group`` the caller names), so the sum over the group counts every element once. That
sum travels in the scaler's one agreement collective, next to the overflow flag. The inf-norm
needs no weights: its reduction is a max.

Two passes over the gradients, whatever the layout:

1. read: the per-tensor norms of the still-scaled gradients. A non-finite element makes its
   tensor's norm non-finite, so this pass is also the overflow check (for p <= 2 and the
   inf-norm; a larger p takes one extra check pass). Scaled fp32 gradients can be large enough
   that their squares overflow float32, so a finite gradient must never be taken for an
   overflow: on the CPU the norms that come out non-finite are taken again in float64 (deciding
   that is a host read, free there; float64 norms cost 8x there), on an accelerator every norm
   accumulates in float64 (a memory-bound pass either way).
2. read+write: multiply by ``inv_scale * clip_coef``, after the agreement.

Both passes take FSDP2's flat gradient buffers whole where the gradients tile them
(``_walk.GradWalk.norm_groups``): per-tensor norms cost ~8 us each on a CPU.

Nothing is modified before the ranks have agreed.
"""

from __future__ import annotations

import math

import torch

from shardscale._check import Flags
from shardscale._devices import move
from shardscale._walk import GradGroups, NormKey

__all__ = ["NormGroups", "apply_", "by_device_dtype", "check_clip_args", "local_norms"]

NormGroups = dict[NormKey, list[torch.Tensor]]
"""Local gradients (flat buffers where they tile one) by (device, dtype, replica count)."""

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


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


def norm_flags_exact(groups: NormGroups, norm_type: float) -> bool:
    """Whether a non-finite norm means a non-finite element, and nothing else.

    True for ``p <= 2`` and the inf-norm over gradients of at most float32 range: their float64
    sums cannot overflow. Otherwise the caller checks the elements in an extra pass.
    """
    small_p = norm_type <= 2.0 or math.isinf(norm_type)
    return small_p and all(dtype != torch.float64 for _, dtype, _ in groups)


def by_device_dtype(groups: NormGroups) -> GradGroups:
    """The same tensors keyed by (device, dtype) only, as the check kernel takes them."""
    merged: GradGroups = {}
    for (device, dtype, _replicas), grads in groups.items():
        merged.setdefault((device, dtype), []).extend(grads)
    return merged


def _norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per-tensor p-norms in float64, never overflowing for finite elements (module docstring)."""
    if grads[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float64))
    norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    finite = norms.isfinite()
    if math.isinf(norm_type) or bool(finite.all()):  # a host read: free on the CPU
        return norms.double()
    redo = [i for i, ok in enumerate(finite.tolist()) if not ok]
    again = torch._foreach_norm([grads[i] for i in redo], norm_type, dtype=torch.float64)
    norms = norms.double()
    norms[redo] = torch.stack(again)
    return norms


def local_norms(
    groups: NormGroups, norm_type: float, inv_scale: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, Flags]:
    """Pass 1 (read only): this rank's share of the unscaled global norm, and overflow flags.

    Args:
        inv_scale: float32 scalar the gradients are still to be multiplied by.
        device: where the share is returned.

    Returns:
        ``(share, flags)``: ``share`` is ``sum |g * inv_scale|_p^p / r`` (the max for the
        inf-norm) as a float32 scalar on ``device``, zero without gradient elements; ``flags``
        holds a float32 scalar per device, 1.0 where a norm was non-finite.
    """
    share = torch.zeros((), dtype=torch.float64, device=device)
    flags: Flags = {}
    for (grad_device, _dtype, replicas), grads in groups.items():
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
    groups: NormGroups,
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
    for (device, _dtype, _replicas), grads in groups.items():
        if device not in factors:
            factors[device] = move(factor, device)
        torch._foreach_mul_(grads, factors[device])
