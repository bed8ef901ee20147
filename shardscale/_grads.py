"""Collect the gradient bytes this rank holds for an optimizer, grouped by (device, dtype).

Whatever the parallelism, the local gradient an optimizer sees is one of: a plain tensor (single
process, DDP, FSDP1 flat parameters and their ``use_orig_params`` views), a DTensor (FSDP2, HSDP,
tensor parallel: we take its local shard and never rely on DTensor's own reductions), or a sparse
tensor (we check its coalesced values). A rank whose shards are all empty still joins the
agreement collective, which is what keeps ranks with empty shards from hanging.

The tensors returned alias the gradients: unscaling them in place unscales the gradients, with no
copy. The one exception is an uncoalesced sparse gradient, which is replaced by its coalesced form
(as torch's scalers do), because duplicate indices are summed only then, and that sum can overflow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

__all__ = [
    "GradGroups",
    "collect_local_grads",
    "holds_elements",
    "local_values",
    "optimizer_params",
]

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


def collect_local_grads(params: Iterable[torch.Tensor]) -> GradGroups:
    """Group this rank's local gradient tensors of ``params`` by (device, dtype).

    Empty shards stay in their group (the kernel passes over them); whether this rank holds any
    gradient element at all is :func:`holds_elements`'s question.

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


def local_values(grad: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds, for reading (clipping norms, locating overflows).

    A DTensor's local shard; a sparse gradient's coalesced values (coalesced into a copy if it
    is not yet: duplicates sum only then, and that sum is what may overflow); else ``grad``.
    ``collect_local_grads`` inlines the same walk (it runs every step, and coalesces in place).
    """
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    if grad.is_sparse:
        grad = (grad if grad.is_coalesced() else grad.coalesce())._values()
    return grad


def holds_elements(groups: GradGroups) -> bool:
    """Whether any gradient in ``groups`` has an element (empty shards do not count)."""
    return any(grad.numel() > 0 for grads in groups.values() for grad in grads)


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """Every parameter of every param group of ``optimizer``, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]
