"""`record_overflow()`: an overflow a framework's own check found counts as the scaler's own."""

from __future__ import annotations

import pytest
import torch

from shardscale import ShardedGradScaler


def _clean_step(scaler: ShardedGradScaler) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    return param


def test_record_overflow_after_a_clean_step_reads_skipped_and_backs_off() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=1)
    _clean_step(scaler)
    assert scaler.last_step_skipped is False
    scaler.record_overflow()
    assert scaler.last_step_skipped is True
    scaler.update()
    assert scaler.get_scale() == 4.0  # backed off, where a clean step would have grown to 16
    stats = scaler.stats
    assert (stats.steps, stats.skipped_steps) == (1, 1)
    _clean_step(scaler)
    scaler.update()
    assert scaler.get_scale() == 8.0  # the next clean step grows again


def test_record_overflow_without_a_step_raises() -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    with pytest.raises(RuntimeError, match=r"record_overflow\(\) must follow step\(\)"):
        scaler.record_overflow()
