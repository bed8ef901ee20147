"""What a `step()` call steps: one optimizer, a list of them, or a container of them.

torchtitan-style jobs build one optimizer per model part and step them through a container (an
`Optimizer` subclass holding them in `optimizers`); Megatron chains them
(`chained_optimizers`). The scaler must check the gradients of every optimizer underneath, agree
on them in ONE collective, and hand fused optimizers the scale and the agreed flag themselves:
that is what resolving a target into its *leaf* optimizers is for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

__all__ = ["OptimizerTarget", "Steppable", "optimizer_params", "steppables", "takes_scale"]

OptimizerTarget: TypeAlias = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
"""What `unscale_`/`step` accept: an optimizer (or a container of several), or a list."""

_CONTAINER_ATTRIBUTES = ("optimizers", "chained_optimizers")


@dataclass(frozen=True, slots=True)
class Steppable:
    """One thing whose `step()` is called, and the optimizers it steps (itself, if a leaf)."""

    target: Any
    leaves: tuple[torch.optim.Optimizer, ...]


def _is_optimizer(value: object) -> bool:
    return isinstance(value, torch.optim.Optimizer) or (
        hasattr(value, "param_groups") and callable(getattr(value, "step", None))
    )


def _inner(optimizer: object) -> Sequence[Any] | None:
    """The optimizers a container holds, or None for a plain optimizer."""
    for attribute in _CONTAINER_ATTRIBUTES:
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, (list, tuple)) and inner and all(map(_is_optimizer, inner)):
            return inner
    return None


def _leaves(optimizer: object) -> Iterator[torch.optim.Optimizer]:
    inner = _inner(optimizer)
    if inner is None:
        yield optimizer  # type: ignore[misc]
        return
    for item in inner:
        yield from _leaves(item)


def steppables(target: object) -> list[Steppable]:
    """Resolve `target` into what to step and the leaf optimizers under each.

    Raises:
        TypeError: `target` is not an optimizer, a container of them, or a list of those.
        ValueError: the list is empty, or names one optimizer twice.
    """
    items = list(target) if isinstance(target, (list, tuple)) else [target]
    if not items:
        raise ValueError("the list of optimizers must not be empty, got []")
    resolved = []
    seen: set[int] = set()
    for item in items:
        if not _is_optimizer(item):
            raise TypeError(
                "expected a torch.optim.Optimizer (or a container of optimizers, or a list of "
                f"them), got {type(item).__name__}"
            )
        leaves = tuple(_leaves(item))
        for leaf in leaves:
            if id(leaf) in seen:
                raise ValueError(
                    f"the optimizer {type(leaf).__name__} at {id(leaf):#x} appears twice in the "
                    "optimizers given: each must be stepped once per iteration"
                )
            seen.add(id(leaf))
        resolved.append(Steppable(target=item, leaves=leaves))
    return resolved


def takes_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` reads `grad_scale`/`found_inf` itself (fused, capturable
    with amp support): it unscales and skips on the device, with no host synchronisation."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every param group of `optimizer`, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]
