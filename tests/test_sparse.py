"""Gradients the kernel cannot take as they come: sparse ones (checked after coalescing, as the
sum of duplicates may overflow) and integer ones (refused)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler


def test_sparse_fp16_duplicates_that_overflow_when_coalesced_are_caught() -> None:
    """Each value is finite; the coalesced sum of the duplicate index is not (fp16 max 65504)."""
    weight = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    weight.grad = torch.sparse_coo_tensor(
        torch.tensor([[1, 1, 2]]), torch.tensor([60000.0, 60000.0, 1.0], dtype=torch.float16), (4,)
    )
    scaler = ShardedGradScaler(init_scale=1.0)
    scaler.scale(torch.tensor(1.0))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler.step(optimizer)
    assert scaler.last_step_skipped
    assert weight.grad.is_coalesced()
    assert torch.equal(weight, torch.zeros(4, dtype=torch.float16))


def test_integer_gradient_raises_type_error() -> None:
    weight = torch.zeros(3, dtype=torch.int32)
    weight.grad = torch.ones(3, dtype=torch.int32)
    scaler = ShardedGradScaler()
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"gradients must be floating point .* got torch.int32"):
        scaler.step(_Holder([weight]))  # type: ignore[arg-type]


class _Holder:
    """The least an optimizer needs for the scaler: param_groups and step()."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]

    def step(self) -> None:
        return None
