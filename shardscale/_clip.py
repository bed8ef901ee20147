"""Gradient clipping whose norm is global over shards, stages and replicas, in two passes.

The global p-norm is `(sum over distinct elements |g|^p)^(1/p)`. Each rank adds
`|local grad|_p^p / r` per gradient, `r` being how many ranks hold those same elements
(`_grads.replica_count`: DTensors say it themselves, plain tensors are replicated over the
`replica_group` the caller names), so the sum over the group counts every element once. That
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
2. read+write: multiply by `inv_scale * clip_coef`, after the agreement.

Both passes take FSDP2's flat gradient buffers whole where the gradients tile them
(`_walk.GradWalk.norm_groups`): per-tensor norms cost ~8 us each on a CPU.

Nothing is modified before the ranks have agreed.
"""

from __future__ import annotations

import functools
import math

import torch

from shardscale._check import Flags, multiply_, ones
from shardscale._devices import move
from shardscale._walk import GradGroups, NormKey

__all__ = ["NormGroups", "apply_", "by_device_dtype", "check_clip_args", "local_norms"]

NormGroups = dict[NormKey, list[torch.Tensor]]
"""Local gradients (flat buffers where they tile one) by (device, dtype, replica count)."""

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


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


def norm_flags_exact(groups: NormGroups, norm_type: float) -> bool:
    """Whether a non-finite norm means a non-finite element, and nothing else.

    True for `p <= 2` and the inf-norm over gradients of at most float32 range: their float64
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


def _norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Per-tensor p-norms in float64, never overflowing for finite elements (module docstring).

    On an accelerator a list of 0-dim tensors (one `_foreach_norm`, stacked later with the
    other groups' in one kernel); on the CPU one 1-D tensor.
    """
    if grads[0].device.type != "cpu":
        return list(torch._foreach_norm(grads, norm_type, dtype=torch.float64))
    norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    finite = norms.isfinite()
    if math.isinf(norm_type) or bool(finite.all()):  # a host read: free on the CPU
        return [norms.double()]
    redo = [i for i, ok in enumerate(finite.tolist()) if not ok]
    again = torch._foreach_norm([grads[i] for i in redo], norm_type, dtype=torch.float64)
    norms = norms.double()
    norms[redo] = torch.stack(again)
    return [norms]


def local_norms(
    groups: NormGroups,
    norm_type: float,
    inv_scale: torch.Tensor,
    device: torch.device,
    flags: Flags | None = None,
) -> tuple[torch.Tensor, Flags]:
    """Pass 1 (read only): this rank's share of the unscaled global norm, and overflow flags.

    The per-tensor norms of every group with the same replica count are moved to `device`
    (a non-blocking copy from the CPU: CPU-offloaded gradients cost no device-to-host copy
    here), stacked in one kernel, then unscaled and checked in one more (the check kernel,
    which raises the flag of `device` where a norm is non-finite), then reduced in one (two
    for p other than 1, 2 and inf). So the kernels per step grow with the number of
    (device, dtype) groups (one `_foreach_norm` each), never with the number of tensors.

    Args:
        inv_scale: float32 scalar the gradients are still to be multiplied by.
        device: where the share is returned, and where the flag is raised.
        flags: flags to raise (the ballot's, so that the norms' check costs no kernel of its
            own); new zero flags when None.

    Returns:
        `(share, flags)`: `share` is `sum |g * inv_scale|_p^p / r` (the max for the
        inf-norm) as a float64 scalar on `device` (zero without gradient elements), non-finite
        where a norm was; `flags` holds a float32 scalar for `device`, 1.0 where a norm was
        non-finite.
    """
    flags = {} if flags is None else flags
    if device not in flags:
        flags[device] = torch.zeros((), dtype=torch.float32, device=device)
    pieces: dict[int, list[torch.Tensor]] = {}
    for (_device, _dtype, replicas), grads in groups.items():
        for norms in _norms(grads, norm_type):
            pieces.setdefault(replicas, []).append(move(norms, device).reshape(-1))
    share: torch.Tensor | None = None
    inv = move(inv_scale, device)
    for replicas, parts in pieces.items():
        norms = torch.cat(parts) if len(parts) > 1 else parts[0]
        torch._amp_foreach_non_finite_check_and_unscale_([norms], flags[device], inv)
        if math.isinf(norm_type):  # a max: replicas need no weight
            part = norms.amax()
        else:
            if norm_type == 2.0:
                part = torch.dot(norms, norms)
            elif norm_type == 1.0:
                part = norms.sum()
            else:
                part = norms.pow(norm_type).sum()
            if replicas != 1:
                part = part / replicas
        if share is None:
            share = part
        else:
            share = torch.maximum(share, part) if math.isinf(norm_type) else share + part
    if share is None:
        share = torch.zeros((), dtype=torch.float64, device=device)
    return share, flags


def apply_(
    groups: NormGroups,
    max_norm: float,
    total_norm: torch.Tensor,
    inv_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
) -> None:
    """Pass 2: multiply every gradient by `inv_scale * min(1, max_norm / (total + 1e-6))`.

    On the device, without a host synchronisation, in five scalar kernels and one per
    (device, dtype) group. On an overflow (`found_inf` 1.0: the step will be skipped) it only
    unscales, where torch would turn the gradients to NaN, so that locating the overflow still
    sees the infs. A norm that is non-finite without an overflow (p-th powers beyond float32's
    range, p > 2) clips to zero, as torch does.
    """
    coef = torch.div(_constant(max_norm, total_norm.device), total_norm + _CLIP_EPS)
    # fmin/fmax ignore a NaN (a NaN norm: an overflow), so an overflow gives exactly 1.
    factor = torch.fmax(torch.fmin(coef, ones(coef.device)), found_inf)
    if inv_scale is not None:
        factor = factor * move(inv_scale, factor.device)
    multiply_(by_device_dtype(groups), factor)


@functools.lru_cache(maxsize=64)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float32 scalar `value` on `device`, made once (`max_norm` rarely changes)."""
    return torch.full((), value, dtype=torch.float32, device=device)
