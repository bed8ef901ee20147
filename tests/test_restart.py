"""Nothing lost across a restart (issue 69): every count that decides an error or an alarm rides
in the state dict, so a run resumed mid-streak raises, and warns, where the uninterrupted one
does.

The streaks: gradient overflows in a row at the floor (`max_overflows_at_floor` of them raise
`ShardScaleNonFiniteError`) and non-finite losses in a row (the loss streak's warning). Made by
fp16 itself, one process, autocast on the CPU: a model whose own backward makes NaN at every
scale (a masked `sqrt`, a classic bug: the forward is finite), and inputs beyond fp16's range
(a forward overflow). Each run resumed from a state dict taken mid-streak, into a fresh model,
optimizer and scaler, is compared with the run that never stopped; on the CPU's path and on
the CUDA path's (`shardscale.testing.cuda_path()`, where a fused step's streaks are read one
update late).
"""

from __future__ import annotations

import math
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler, ShardScaleNonFiniteError, ShardScaleWarning
from shardscale.testing import cuda_path


class _Model(nn.Module):
    """Two layers; with `masked_sqrt`, the bug `where(h > 0, sqrt(h), 0)` between them: a
    finite forward, whose backward through `sqrt` where `h <= 0` is `0 * NaN` or `0 * inf`:
    NaN in `first`'s gradients at every scale. Without, a ReLU."""

    def __init__(self, masked_sqrt: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 1)
        self.masked_sqrt = masked_sqrt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if not self.masked_sqrt:
            return self.second(torch.relu(h))
        return self.second(torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h)))


@dataclass
class _Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: ShardedGradScaler


def _build(fused: bool, masked_sqrt: bool = True, **options: Any) -> _Run:
    model = _Model(masked_sqrt)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3, fused=fused)
    return _Run(model, optimizer, ShardedGradScaler(**options))


def _batch(step: int, gain: float) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) * gain


def _steps(run: _Run, steps: range, gains: dict[int, float] | None = None) -> tuple[int, str]:
    """Train steps `steps` (1-based): the step whose update raised, and its message; (0, '')
    when none did. `gains`: a step's input gain (default 1)."""
    for step in steps:
        run.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = run.model(_batch(step, (gains or {}).get(step, 1.0))).float().mean()
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        try:
            run.scaler.update()
        except ShardScaleNonFiniteError as error:
            return step, str(error)
    return 0, ""


def _resumed(run: _Run, fused: bool, **options: Any) -> _Run:
    """A fresh model, optimizer and scaler, loaded with `run`'s state (as after a restart)."""
    fresh = _build(fused, **options)
    fresh.model.load_state_dict(run.model.state_dict())
    fresh.optimizer.load_state_dict(run.optimizer.state_dict())
    fresh.scaler.load_state_dict(run.scaler.state_dict())
    return fresh


def _path(name: str) -> AbstractContextManager[object]:
    return cuda_path() if name == "cuda_path" else nullcontext()


# The floor (2**-24) 4 halvings below the start: at it from step 4, the error at step 11.
_FLOOR = {"init_scale": 2.0**-20}


@pytest.mark.filterwarnings("ignore::shardscale.ShardScaleWarning")  # the floor's warning
@pytest.mark.parametrize("path", ["cpu", "cuda_path"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("stop", [2, 6, 10])
def test_restart_mid_floor_streak_raises_at_the_uninterrupted_runs_step(
    path: str, fused: bool, stop: int
) -> None:
    """Stopped before the floor (2), mid-streak (6) and one step short of the error (10)."""
    with _path(path):
        uninterrupted = _steps(_build(fused, **_FLOOR), range(1, 30))
        first = _build(fused, **_FLOOR)
        assert _steps(first, range(1, stop + 1)) == (0, "")
        saved = first.scaler.state_dict()
        resumed = _resumed(first, fused)
        assert resumed.scaler.state_dict() == saved
        raised = _steps(resumed, range(stop + 1, 30))
    assert uninterrupted[0] > stop
    assert "first.weight" in uninterrupted[1]
    assert raised == uninterrupted
    if stop > 4:  # the streak rode in the state dict
        assert saved["floor_streak"] == stop - 3


@pytest.mark.filterwarnings("ignore::shardscale.ShardScaleWarning")
def test_restart_from_format_4_starts_the_streaks_at_0() -> None:
    """docs/checkpoints.md: format 4 did not hold the streaks; they load as 0, so the error
    comes `max_overflows_at_floor` overflows after the load."""
    first = _build(False, **_FLOOR)
    _steps(first, range(1, 7))
    saved = first.scaler.state_dict()
    older = {k: v for k, v in saved.items() if k not in ("floor_streak", "loss_streak")}
    fresh = _build(False, **_FLOOR)
    fresh.scaler.load_state_dict({**older, "format_version": 4})
    assert fresh.scaler.state_dict() == {**saved, "floor_streak": 0}
    assert _steps(fresh, range(7, 30))[0] == 6 + 8


@pytest.mark.filterwarnings("ignore::shardscale.ShardScaleWarning")
def test_restart_with_a_lower_floor_passed_ends_the_floor_streak() -> None:
    """The streak counted overflows at the checkpoint's floor; a lower `min_scale` passed leaves
    the scale above the new floor, where it can back off again: no streak. Not passed, the
    checkpoint's floor and its streak are kept."""
    first = _build(False, init_scale=4.0, min_scale=1.0)
    _steps(first, range(1, 6))
    saved = first.scaler.state_dict()
    assert (saved["scale"], saved["floor_streak"]) == (1.0, 4)  # at 1.0 from step 2
    lower = ShardedGradScaler(min_scale=2.0**-24)
    lower.load_state_dict(saved)
    assert (lower.state_dict()["scale"], lower.state_dict()["floor_streak"]) == (1.0, 0)
    same = ShardedGradScaler()
    same.load_state_dict(saved)
    assert same.state_dict() == saved


def _loss_streak_warnings(run: _Run, steps: range) -> list[str]:
    """Steps 4 on overflow in the forward (inputs beyond fp16's range); the loss streak's
    warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(run, steps, gains=dict.fromkeys(range(4, 40), 1e6))
    return [str(w.message) for w in caught if issubclass(w.category, ShardScaleWarning)]


@pytest.mark.parametrize("path", ["cpu", "cuda_path"])
@pytest.mark.parametrize("stop", [3, 7, 10])
def test_restart_mid_loss_streak_warns_at_the_uninterrupted_runs_step(path: str, stop: int) -> None:
    """Losses non-finite from step 4 (a real fp16 forward overflow): the 8th in a row, step 11,
    warns, with or without a restart before it."""
    with _path(path):
        uninterrupted = _loss_streak_warnings(_build(True, masked_sqrt=False), range(1, 15))
        first = _build(True, masked_sqrt=False)
        assert _loss_streak_warnings(first, range(1, stop + 1)) == []
        assert first.scaler.state_dict()["loss_streak"] == max(stop - 3, 0)
        resumed = _resumed(first, True, masked_sqrt=False)
        told = _loss_streak_warnings(resumed, range(stop + 1, 15))
    assert len(uninterrupted) == 1
    assert uninterrupted[0].startswith("step 11: the loss itself was non-finite")
    assert told == uninterrupted
    assert math.isinf(_batch(4, 1e6).half().abs().max().item())  # beyond fp16's range
