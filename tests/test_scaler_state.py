"""The scaler's state: state dicts that load both ways with torch's, versioned, validated whole
before anything changes; pickling and the setters."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import pytest
import torch

from shardscale import ShardedGradScaler
from tests.setups import overflow_steps, scaled_backward


def test_state_dict_ours_loads_into_torch() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3)
    overflow_steps(scaler, [False, False, True, False])
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(scaler.state_dict())
    assert theirs.state_dict() == {k: scaler.state_dict()[k] for k in theirs.state_dict()}
    assert theirs.get_scale() == 4.0


def test_state_dict_torch_loads_into_ours_with_our_settings_kept() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    overflow_steps(theirs, [False, True, False])  # type: ignore[arg-type]
    scaler = ShardedGradScaler(hysteresis=2, min_scale=0.5)
    scaler.load_state_dict(theirs.state_dict())
    state = scaler.state_dict()
    assert {k: state[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert (state["hysteresis"], state["_hysteresis_tracker"], state["min_scale"]) == (2, 2, 0.5)
    assert state["steps"] == 0


def test_state_dict_round_trip_keeps_counters_and_trackers() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=5, hysteresis=3)
    overflow_steps(scaler, [False, True, False])
    restored = ShardedGradScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    assert restored.state_dict()["_hysteresis_tracker"] == 2


def test_state_dict_with_a_tracker_past_a_lowered_interval_loads_and_grows_as_torchs() -> None:
    """`set_growth_interval()` below the growth tracker leaves a state torch's scaler saves and
    loads: the tracker counts on without growing, as torch's kernel counts it, until an
    overflow; ours saves it, loads it (into itself, a new scaler, and torch's), and moves it
    bit for bit as torch's does."""
    ours, theirs = ShardedGradScaler(init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=8.0)
    for scaler in (ours, theirs):
        overflow_steps(scaler, [False, False, False])  # type: ignore[arg-type]
        scaler.set_growth_interval(2)  # the tracker is 3 now
    for load in (ours, ShardedGradScaler(), theirs):
        load.load_state_dict(ours.state_dict())
    assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"] == 3
    for overflows in ([False, False], [True, False, False]):
        overflow_steps(ours, overflows)
        overflow_steps(theirs, overflows)  # type: ignore[arg-type]
        assert (ours.get_scale(), ours._get_growth_tracker()) == (
            theirs.get_scale(),
            theirs._get_growth_tracker(),
        )


def test_load_state_dict_before_first_scale_is_used_by_it() -> None:
    scaler = ShardedGradScaler()
    scaler.load_state_dict({**ShardedGradScaler(init_scale=32.0).state_dict()})
    assert scaler.scale(torch.tensor(1.0)).item() == 32.0


_GOOD = ShardedGradScaler(init_scale=8.0, growth_interval=4, hysteresis=2).state_dict()
_ALARM_KEYS = ("floor_streak", "loss_streak")  # what format 4 lacks
_STREAK_KEY = "_fit_streak"  # what format 3 lacks, with those
_FIT_KEYS = ("scale_policy", "_fit_margin", "_fit_window", _STREAK_KEY)  # what format 2 lacks
_V2_KEYS = ("format_version", "forward_overflows", "retries", *_FIT_KEYS)  # format 0 lacks


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({}, RuntimeError, r"The source state dict is empty"),
        (
            {k: v for k, v in _GOOD.items() if k != "scale"},
            ValueError,
            r"missing required key\(s\) \['scale'\]",
        ),
        ({**_GOOD, "extra": 1}, ValueError, r"unknown key\(s\) \['extra'\]"),
        (
            {k: v for k, v in _GOOD.items() if k != "steps"},
            ValueError,
            r"some of shardscale's keys but not \['steps'\]",
        ),
        ({**_GOOD, "scale": "8"}, TypeError, r"state_dict\['scale'\] must be a float, got str"),
        (
            {**_GOOD, "scale": math.nan},
            ValueError,
            r"state_dict\['scale'\] must be finite and > 0, got nan",
        ),
        ({**_GOOD, "scale": 0.0}, ValueError, r"must be finite and > 0, got 0.0"),
        ({**_GOOD, "scale": -2.0}, ValueError, r"got -2.0"),
        ({**_GOOD, "scale": math.inf}, ValueError, r"got inf"),
        ({**_GOOD, "scale": 1e-9}, ValueError, r"scale must be in \[min_scale, max_scale\]"),
        (
            {**_GOOD, "_growth_tracker": -1},
            ValueError,
            r"_growth_tracker must be in \[0, 2\*\*30\), got -1",
        ),
        ({**_GOOD, "_growth_tracker": 1.5}, TypeError, r"must be an int, got float: 1.5"),
        (
            {**_GOOD, "_hysteresis_tracker": 3},
            ValueError,
            r"_hysteresis_tracker must be in \[1, hysteresis\] = \[1, 2\], got 3",
        ),
        (
            {**_GOOD, "growth_factor": 0.5},
            ValueError,
            r"growth_factor must be a finite number > 1.0, got 0.5",
        ),
        ({**_GOOD, "dynamic": "yes"}, TypeError, r"state_dict\['dynamic'\] must be a bool"),
        ({**_GOOD, "steps": True}, TypeError, r"state_dict\['steps'\] must be an int, got bool"),
        (
            {**_GOOD, "skipped_steps": 3, "steps": 2},
            ValueError,
            r"consecutive_skips <= skipped_steps <= steps",
        ),
        (
            {**_GOOD, "last_overflow_step": 1},
            ValueError,
            r"last_overflow_step'\] must be 0 when no step was skipped.*got last_overflow_step=1",
        ),
        ([("scale", 1.0)], TypeError, r"state_dict must be a mapping, got list"),
        (
            {**_GOOD, "format_version": 6},
            ValueError,
            r"format_version'\] must be one of \[0, 1, 2, 3, 4, 5\], got 6: a newer shardscale "
            r"saved it",
        ),
        (
            {**_GOOD, "forward_overflows": 1},
            ValueError,
            r"0 <= forward_overflows <= skipped_steps.*got forward_overflows=1, skipped_steps=0",
        ),
        (
            {k: v for k, v in _GOOD.items() if k not in {*_V2_KEYS, *_ALARM_KEYS}} | {"new_key": 1},
            ValueError,
            r"unknown key\(s\) \['new_key'\] for format version 0",
        ),
        (
            {k: v for k, v in _GOOD.items() if k != "format_version"},
            ValueError,
            r"format version 5's key\(s\) \['_fit_margin', '_fit_streak', '_fit_window', "
            r"'floor_streak', 'forward_overflows', 'loss_streak', 'retries', 'scale_policy'\] "
            r"but no 'format_version'",
        ),
        (
            {**_GOOD, "loss_streak": 1},
            ValueError,
            r"floor_streak >= 0, 0 <= loss_streak <= forward_overflows and floor_streak \+ "
            r"loss_streak <= consecutive_skips \(each streak counts skipped steps in a row, of "
            r"other kinds\), got floor_streak=0, loss_streak=1, forward_overflows=0, "
            r"consecutive_skips=0",
        ),
        (
            {**_GOOD, "floor_streak": -1},
            ValueError,
            r"got floor_streak=-1, loss_streak=0",
        ),
        (
            {**_GOOD, "steps": 3, "skipped_steps": 2, "consecutive_skips": 1, "floor_streak": 2}
            | {"last_overflow_step": 3},
            ValueError,
            r"got floor_streak=2, loss_streak=0, forward_overflows=0, consecutive_skips=1",
        ),
        (
            {k: v for k, v in _GOOD.items() if k != "hysteresis"},
            ValueError,
            r"some of shardscale's keys but not \['hysteresis'\]",
        ),
    ],
)
def test_load_bad_state_dict_raises_and_leaves_scaler_unchanged(
    state: Any, error: type[Exception], match: str
) -> None:
    scaler = ShardedGradScaler(init_scale=16.0, growth_interval=3)
    overflow_steps(scaler, [False, True])
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before
    assert scaler.get_growth_interval() == 3


# The keys each format lacks that the next one added.
_ADDED_AFTER = {
    1: ("forward_overflows", "retries"),
    2: _FIT_KEYS[:3],
    3: (_STREAK_KEY,),
    4: _ALARM_KEYS,
}


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4])
def test_state_dict_is_versioned_and_older_formats_still_load(version: int) -> None:
    """shardscale 0.1 saved no format_version (format 0), format 1 no forward-overflow and
    retry counters, format 2 no fit state, format 3 no fit streak, format 4 no alarm streaks:
    their checkpoints keep loading, those counters starting at 0, the fit margin, window and
    streak afresh."""
    scaler = ShardedGradScaler(init_scale=16.0, growth_interval=3, hysteresis=2)
    overflow_steps(scaler, [False, True, False])
    saved = scaler.state_dict()
    assert saved["format_version"] == 5
    assert (saved["forward_overflows"], saved["retries"]) == (0, 0)
    lacks = {key for added, keys in _ADDED_AFTER.items() if added >= version for key in keys}
    old = {k: v for k, v in saved.items() if k not in lacks | {"format_version"}}
    if version:
        old["format_version"] = version
    loaded = ShardedGradScaler(hysteresis=2)
    loaded.load_state_dict(old)
    assert loaded.state_dict() == saved


def test_pickle_and_deepcopy_keep_state() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3, hysteresis=2)
    overflow_steps(scaler, [False, True])
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == scaler.state_dict()
        assert clone.scale(torch.tensor(1.0)).item() == 8.0


def test_pickle_mid_iteration_raises() -> None:
    scaler = ShardedGradScaler()
    _, optimizer = scaled_backward(scaler)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"may only be pickled at the beginning"):
        pickle.dumps(scaler)


def test_setters_validate_and_apply() -> None:
    scaler = ShardedGradScaler()
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert scaler.get_growth_interval() == 7
    with pytest.raises(ValueError, match=r"growth_factor must be a finite number > 1.0, got 0.9"):
        scaler.set_growth_factor(0.9)
    assert scaler.get_growth_factor() == 3.0
