"""Knowing what happened: stats, hooks, the skip log, the skip limit, LR schedulers, autograd."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

import shardscale._report
from shardscale import ScalerStats, ShardedGradScaler, ShardScaleSkipError
from tests.harness import RankFailure, run_ranks
from tests.setups import build, mlp, plant


def _run(scaler: ShardedGradScaler, pattern: list[bool], flavour: str = "for-loop") -> Any:
    setup = build("plain", flavour, 1)
    for step, overflow in enumerate(pattern):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, 0)).backward()
        if overflow:
            plant(setup.optimizer, math.inf)
        scaler.step(setup.optimizer)
        scaler.update()
    return setup


@pytest.mark.parametrize("flavour", ["for-loop", "fused"])
def test_stats_count_steps_skips_and_last_overflow(flavour: str) -> None:
    scaler = ShardedGradScaler(init_scale=64.0, growth_interval=100)
    assert scaler.stats == ScalerStats(0, 0, 0, 64.0, 0)
    _run(scaler, [False, True, True, False, True, True, False], flavour)
    assert scaler.stats == ScalerStats(
        steps=7, skipped_steps=4, consecutive_skips=0, scale=4.0, last_overflow_step=6
    )
    assert not scaler.stats.last_step_skipped
    _run(scaler, [True], flavour)
    assert scaler.stats.last_step_skipped
    assert scaler.stats.consecutive_skips == 1
    # kept in the state dict
    restored = ShardedGradScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.stats == scaler.stats


def test_stats_hook_gets_every_step_and_can_be_removed() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=2)
    seen: list[ScalerStats] = []
    handle = scaler.register_stats_hook(seen.append)
    _run(scaler, [False, True, False])
    assert [(s.steps, s.last_step_skipped, s.scale) for s in seen] == [
        (1, False, 8.0),
        (2, True, 4.0),
        (3, False, 4.0),
    ]
    handle.remove()
    _run(scaler, [True])
    assert len(seen) == 3
    with pytest.raises(TypeError, match="hook must be callable, got int"):
        scaler.register_stats_hook(3)  # type: ignore[arg-type]


def test_skipped_steps_are_logged_rate_limited(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    scaler = ShardedGradScaler(init_scale=64.0)
    with caplog.at_level(logging.INFO, logger="shardscale"):
        monkeypatch.setattr(shardscale._report, "LOG_INTERVAL_S", 3600.0)
        _run(scaler, [True, False, True, True])
        monkeypatch.setattr(shardscale._report, "LOG_INTERVAL_S", 0.0)
        _run(scaler, [True])
    messages = [r.getMessage() for r in caplog.records if r.name == "shardscale"]
    assert messages == [
        "step 1 skipped: inf/NaN gradients on some rank; scale now 32, 1 consecutive skip(s), "
        "1 of 1 steps skipped",
        "step 5 skipped: inf/NaN gradients on some rank; scale now 4, 3 consecutive skip(s), "
        "4 of 5 steps skipped (2 more skipped step(s) since the last message)",
    ]


def test_nothing_logged_for_clean_steps(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="shardscale"):
        _run(ShardedGradScaler(), [False, False])
    assert caplog.records == []


def test_max_consecutive_skips_raises_naming_step_and_scale() -> None:
    scaler = ShardedGradScaler(init_scale=256.0, max_consecutive_skips=2)
    _run(scaler, [True, True, False, True, True])  # never more than 2 in a row
    with pytest.raises(
        ShardScaleSkipError,
        match=r"step 6: 3 consecutive steps skipped .* "
        r"more than max_consecutive_skips=2; the scale is 8\b",
    ):
        _run(scaler, [True])


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, r"max_consecutive_skips must be >= 1 \(None: no limit\), got 0"),
        (2.0, TypeError, r"max_consecutive_skips must be an int or None, got float"),
    ],
)
def test_max_consecutive_skips_bad_value_raises(
    value: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ShardedGradScaler(max_consecutive_skips=value)


def _rank_skip_limit(rank: int, world_size: int) -> None:
    setup = build("fsdp2", "fused", world_size)
    scaler = ShardedGradScaler(init_scale=4.0, max_consecutive_skips=1)
    for step in range(3):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, rank)).backward()
        if rank == 1:
            plant(setup.optimizer, math.nan)
        scaler.step(setup.optimizer)
        scaler.update()


def test_max_consecutive_skips_raises_on_every_rank_together() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_rank_skip_limit, 2)
    assert str(failure.value).count("step 2: 2 consecutive steps skipped") == 2


def test_lr_scheduler_pattern_advances_only_on_taken_steps(
    recwarn: pytest.WarningsRecorder,
) -> None:
    """The documented pattern: step the scheduler only when the optimizer stepped."""
    setup = build("plain", "fused", 1)
    scheduler = torch.optim.lr_scheduler.StepLR(setup.optimizer, step_size=1, gamma=0.5)
    scaler = ShardedGradScaler(init_scale=8.0)
    for step, overflow in enumerate([True, False, True, False]):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, 0)).backward()
        if overflow:
            plant(setup.optimizer, math.inf)
        scaler.step(setup.optimizer)
        scaler.update()
        if not scaler.last_step_skipped:
            scheduler.step()
    assert scheduler.last_epoch == 2
    assert setup.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 4)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_update_never_modifies_a_scale_autograd_holds() -> None:
    """Two losses scaled before one update: torch's in-place update breaks the second backward."""
    for scaler, breaks in (
        (torch.amp.GradScaler("cpu", init_scale=8.0), True),
        (ShardedGradScaler(init_scale=8.0), False),
    ):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        first = scaler.scale(model(torch.ones(2, 16)).sum())
        second = scaler.scale(model(torch.ones(2, 16)).sum())
        first.backward()
        model[0].weight.grad[0, 0] = math.inf  # an overflow: update() backs the scale off
        scaler.step(optimizer)
        scaler.update()
        if breaks:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                second.backward()
        else:
            optimizer.zero_grad()
            second.backward()  # multiplied by the scale it was given: 8, not the new 4
            assert model[2].bias.grad.tolist() == [16.0] * 8  # 2 rows x 8
