"""Collect the gradient bytes this rank holds for an optimizer, grouped by (device, dtype).

Whatever the parallelism, the local gradient an optimizer sees is one of: a plain tensor (single
process, DDP, FSDP1 flat parameters and their ``use_orig_params`` views), a DTensor (FSDP2, HSDP,
tensor parallel: we take its local shard and never rely on DTensor's own reductions), or a sparse
tensor (we check its coalesced values). Shards with no elements are dropped here; the rank still
joins the agreement collective, which is what keeps ranks with empty shards from hanging.

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["GradGroups", "collect_local_grads"]

GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
"""Local gradient tensors keyed by (device, dtype): one fused kernel call per key."""


_HALF_DTYPES = (torch.float16, torch.bfloat16)


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


def _local_values(param: torch.Tensor) -> torch.Tensor | None:
    grad = param.grad
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        grad = grad.to_local()
    if grad.is_sparse:
        grad = _coalesced_(param, grad)._values()
    return grad


def collect_local_grads(params: Iterable[torch.Tensor]) -> GradGroups:
    """Group this rank's non-empty local gradient tensors of ``params`` by (device, dtype).

    Raises:
        TypeError: a gradient is not floating point (it could not hold an inf or a NaN).
    """
    groups: GradGroups = defaultdict(list)
    for param in params:
        values = _local_values(param)
        if values is None or values.numel() == 0:
            continue
        if not values.is_floating_point():
            raise TypeError(
                f"gradients must be floating point to be checked for inf/NaN, got {values.dtype} "
                f"for a parameter of shape {tuple(param.shape)}"
            )
        groups[(values.device, values.dtype)].append(values)
    return dict(groups)


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """Every parameter of every param group of ``optimizer``, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]
