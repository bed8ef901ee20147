"""The fit against fp16 itself: overflows made by CPU autocast fp16, not written by hand.

A real fp16 overflow usually reaches the gradients as NaN (once an inf enters the backward, the
next matmul sums inf·x and -inf·y), so a rule that treats NaN apart from inf is tested here on
the overflows fp16 makes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardscale import ShardedGradScaler


class _GeluMLP(nn.Module):
    """Four GELU layers and a head, every Linear under CPU autocast fp16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())]
        self.layers = nn.Sequential(*layers, nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return self.layers(x).float()


def _spiking_run(policy: str, steps: int = 60) -> tuple[list[bool], list[bool], float]:
    """`steps` steps on the same weights (lr 0), every third batch's loss 64x (a summed,
    longer batch): per step whether it was skipped and whether a gradient held a NaN, and the
    final scale's exponent."""
    model = _GeluMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ShardedGradScaler(scale_policy=policy)
    skipped, nan = [], []
    for step in range(steps):
        optimizer.zero_grad()
        inputs = torch.randn(32, 64, generator=torch.Generator().manual_seed(step % 3))
        loss = model(inputs).pow(2).mean() * (64.0 if step % 3 == 2 else 1.0)
        scaler.scale(loss).backward()
        nan.append(any(bool(p.grad.isnan().any()) for p in model.parameters()))  # type: ignore[union-attr]
        scaler.step(optimizer)
        scaler.update()
        skipped.append(bool(scaler.last_step_skipped))
    return skipped, nan, math.log2(scaler.get_scale())


def test_fit_learns_from_overflows_that_show_as_nan_and_stops_skipping() -> None:
    """Before the fit took a NaN as an overflow it skipped every spike, 20 of 60, for ever
    (fit, skip, fit, skip: the NaN held its margin); now it widens the margin and settles."""
    skipped, nan, exponent = _spiking_run("fit")
    nan_skips = [n and s for n, s in zip(nan, skipped, strict=True)]
    assert any(nan_skips), "fp16 made no NaN overflow: the test is void"
    assert sum(skipped) <= 6, skipped
    assert not any(skipped[30:]), f"the fit still skips in the second half: {skipped}"
    assert 1 <= exponent <= 16, exponent
    interval_skipped, _nan, _exponent = _spiking_run("interval")
    assert sum(interval_skipped) <= 3, interval_skipped
