"""No silent results: misuse and edge cases answer loudly, never with a value that reads measured.

An API used in a way that cannot mean anything raises, naming the rule; one that might warns; a
value never measured is None, not 0 or []; a count adds up over micro-batches. One process, the
public API, as a user meets it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import (
    AsyncShardedGradScaler,
    ShardedGradScaler,
    ShardScaleWarning,
    find_nonfinite_grads,
    find_underflowing_grads,
    watch_activations,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
    )


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    with torch.autocast("cpu", dtype=torch.float16):
        return model(inputs).float().pow(2).mean()


# ---------------------------------------------------------------- the activation watch


def test_watch_entered_after_the_forward_raises_naming_the_rule() -> None:
    model = _model()
    loss = _loss(model, 0)
    refused = pytest.raises(RuntimeError, match=r"no forward ran inside the watch.*Enter it before")
    with refused, watch_activations(model):
        (loss * 2.0**8).backward()


def test_watch_with_a_forward_and_no_backward_warns_and_reads_none() -> None:
    model = _model()
    said = pytest.warns(ShardScaleWarning, match=r"no backward reached .* records is None")
    with said, watch_activations(model) as watch:
        _loss(model, 0)
    assert watch.records is None


def _watched_counts(model: nn.Module, passes: int, watch: Any = None) -> dict[str, int]:
    watch = watch if watch is not None else watch_activations(model)
    with watch:
        for seed in range(passes):  # micro-batches: each its own forward and backward
            (_loss(model, seed) * 2.0**8).backward()
    return {r.name: r.num_nonzero + r.num_zeros for r in watch.records}


def test_watch_over_micro_batches_counts_every_pass() -> None:
    """Each pass's outputs are counted, even where CPython gives a new output the id of a freed
    one (the watch used to take it for one it had hooked)."""
    model = _model()
    one = _watched_counts(model, 1)
    four = _watched_counts(model, 4)
    assert one  # something was watched
    assert four == {name: 4 * elements for name, elements in one.items()}


def test_watch_entered_twice_starts_each_reading_from_zero() -> None:
    model = _model()
    watch = watch_activations(model)
    first = _watched_counts(model, 1, watch)
    second = _watched_counts(model, 1, watch)
    assert second == first  # not doubled


# ---------------------------------------------------------------- a checkpoint against arguments


def _trained_state(**options: Any) -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler(**options)
    for seed in range(3):
        optimizer.zero_grad()
        scaler.scale(_loss(model, seed)).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler.state_dict()


def test_load_keeps_the_settings_this_scaler_was_given_and_says_so() -> None:
    saved = _trained_state()  # the interval rule, hysteresis 1, the default floor
    scaler = ShardedGradScaler(scale_policy="fit", hysteresis=2, min_scale=1.0)
    with pytest.warns(ShardScaleWarning) as caught:
        scaler.load_state_dict(saved)
    message = str(caught[0].message)
    assert "scale_policy='fit' (passed) is kept over the checkpoint's 'interval'" in message
    assert "hysteresis=2 (passed) is kept over the checkpoint's 1" in message
    assert "min_scale=1.0 (passed) is kept over the checkpoint's 5.96" in message
    state = scaler.state_dict()
    assert (state["scale_policy"], state["hysteresis"], state["min_scale"]) == ("fit", 2, 1.0)
    assert state["scale"] == saved["scale"]  # the state is the checkpoint's
    assert state["steps"] == saved["steps"] == 3


def test_load_into_defaults_takes_the_checkpoints_settings_and_says_so() -> None:
    saved = _trained_state(hysteresis=3, scale_policy="fit")
    scaler = ShardedGradScaler()
    with pytest.warns(ShardScaleWarning, match=r"the checkpoint's hysteresis=3 replaces this "):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == saved  # a scaler built with defaults resumes as saved


def test_load_raises_the_scale_to_a_floor_this_scaler_was_given() -> None:
    saved = _trained_state()
    scaler = ShardedGradScaler(init_scale=2.0**20, min_scale=2.0**18)
    with pytest.warns(ShardScaleWarning, match=r"scale 65536 becomes 262144, within them"):
        scaler.load_state_dict(saved)
    assert scaler.get_scale() == 2.0**18


def test_load_of_the_same_settings_says_nothing() -> None:
    saved = _trained_state(hysteresis=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedGradScaler(hysteresis=2).load_state_dict(saved)


# ---------------------------------------------------------------- the fit's settings


def test_fit_with_the_interval_rules_settings_warns_they_move_nothing() -> None:
    with pytest.warns(ShardScaleWarning, match=r"growth_interval=10 is not used by .*'fit'"):
        scaler = ShardedGradScaler(scale_policy="fit", growth_interval=10)
    with pytest.warns(ShardScaleWarning, match=r"growth_interval=5 is not used"):
        scaler.set_growth_interval(5)
    with pytest.warns(ShardScaleWarning, match=r"growth_factor=4.0 is not used"):
        scaler.set_growth_factor(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedGradScaler(growth_interval=10).set_growth_interval(5)  # the interval rule's own
        ShardedGradScaler(scale_policy="fit")  # defaults: nothing said


# ---------------------------------------------------------------- last_overflow


def test_last_overflow_is_none_where_nothing_was_located() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.01)
    for locate in (False, True):
        scaler = ShardedGradScaler(locate_overflow=locate)
        assert scaler.last_overflow is None  # no overflow step yet
        scaler.scale(_loss(model, 0)).backward()
        model[2].weight.grad[0, 0] = math.inf  # type: ignore[index]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        assert scaler.last_step_skipped
        if locate:
            assert [str(r) for r in scaler.last_overflow or []] == [
                "rank 0: 2.weight (1 inf, 0 NaN)"
            ]
        else:
            assert scaler.last_overflow is None  # nothing was looked for: not "nowhere"


# ---------------------------------------------------------------- the fit and a NaN


def _fit_margins(plant: float) -> list[int]:
    """The fit's learned margin over 12 steps, `plant` in one gradient at step 6."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler(scale_policy="fit", max_overflows_at_floor=None)
    margins = []
    for step in range(12):
        optimizer.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        if step == 6:
            model[2].weight.grad[0, 0] = plant  # type: ignore[index]
        scaler.step(optimizer)
        scaler.update()
        margins.append(scaler.state_dict()["_fit_margin"])
    return margins


def test_fit_nan_among_clean_steps_widens_the_margin_as_an_inf_does() -> None:
    """A NaN teaches the fit what an inf does: fp16's real overflows mostly reach the gradients
    as NaN (an inf in the backward, then inf - inf in the next matmul), so a NaN is evidence of
    fp16's range; a bug is told from an overflow by persistence (the alarm at the floor), not
    by NaN. Holding the margin for a NaN kept the fit skipping every other step on a loss that
    spiked every third batch."""
    assert _fit_margins(math.nan) == [1] * 6 + [2] * 6


def test_fit_inf_among_clean_steps_widens_the_margin() -> None:
    """The contrast: an inf the window said could not happen teaches the fit more room."""
    assert _fit_margins(math.inf) == [1] * 6 + [2] * 6


# ---------------------------------------------------------------- the meter


def test_meter_reads_none_until_it_has_measured() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler(underflow_every=2)
    seen = []
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
        stats = scaler.stats
        seen.append((stats.underflow_step, stats.underflow is None))
    assert seen == [(None, True), (2, False), (2, False)]


# ---------------------------------------------------------------- the rest of the class (the hunt)


def test_find_grads_without_any_gradient_raises_instead_of_reading_clean() -> None:
    model = _model()  # no backward yet: nothing to look at
    with pytest.raises(RuntimeError, match=r"no parameter holds a gradient element on any rank"):
        find_nonfinite_grads(model)
    with pytest.raises(RuntimeError, match=r"no parameter holds a gradient element on any rank"):
        find_underflowing_grads(model)
    (_loss(model, 0) * 2.0**8).backward()
    assert find_nonfinite_grads(model) == []  # looked: all finite


def test_last_step_skipped_is_none_before_the_first_step() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler()
    assert scaler.last_step_skipped is None  # no step to tell of
    scaler.scale(_loss(model, 0)).backward()
    scaler.step(optimizer)
    assert scaler.last_step_skipped is False


def test_settings_a_fixed_scale_cannot_use_warn() -> None:
    with pytest.warns(ShardScaleWarning, match=r"growth_interval=5: not used with dynamic=False"):
        ShardedGradScaler(dynamic=False, init_scale=1.0, growth_interval=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedGradScaler(scale_policy="fit", hysteresis=2, backoff_factor=0.25)  # the fit's own


def test_a_hook_on_a_disabled_scaler_warns_it_never_runs() -> None:
    with pytest.warns(ShardScaleWarning, match=r"disabled scaler: .* the hook never runs"):
        ShardedGradScaler(enabled=False).register_stats_hook(lambda stats: None)


def test_async_scaler_says_it_does_not_use_max_retries() -> None:
    with pytest.warns(ShardScaleWarning, match=r"does not use max_retries"):
        AsyncShardedGradScaler(max_retries=5)
