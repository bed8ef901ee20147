"""Resume keeps what the user passed, defaults included (issue 56; docs/checkpoints.md).

Of shardscale's settings (`hysteresis`, `min_scale`, `max_scale`, `dynamic`, `scale_policy`), one
passed to the resuming scaler's constructor is kept over the checkpoint's, even at its default's
value; one not passed is the checkpoint's. torch's three (`growth_factor`, `backoff_factor`,
`growth_interval`) are the checkpoint's, as torch's scalers load them. The state is always the
checkpoint's. A load in the middle of an iteration is refused. Single process (the state dict
path), but for one 2-rank resume through `torch.distributed.checkpoint`.
"""

from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardscale import ShardedGradScaler, ShardScaleWarning
from shardscale._policy import FIT_MARGIN, FIT_WINDOW
from tests.harness import run_ranks


class _Planted(nn.Module):
    """One parameter whose gradient is `g` times the scale, for a loss `(w * g).sum()`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def loss(self, grad: float) -> torch.Tensor:
        return (self.w * grad).sum()


def _train(scaler: ShardedGradScaler, grads: list[float]) -> ShardedGradScaler:
    """One iteration per entry: a gradient of that value (inf: a gradient overflow)."""
    model = _Planted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for grad in grads:
        optimizer.zero_grad()
        scaler.scale(model.loss(0.0 if math.isinf(grad) else grad)).backward()
        if math.isinf(grad):
            assert model.w.grad is not None
            model.w.grad[0] = math.inf
        scaler.step(optimizer)
        scaler.update()
    return scaler


def _saved(grads: list[float] | None = None, **options: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the floor's warning, where a test plants overflows
        return _train(ShardedGradScaler(**options), grads or [0.3, math.inf, 0.3]).state_dict()


def _load(scaler: ShardedGradScaler, saved: dict[str, Any]) -> str:
    """Load `saved`; the one warning's message ('' when none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.load_state_dict(saved)
    ours = [w for w in caught if issubclass(w.category, ShardScaleWarning)]
    assert len(ours) <= 1, [str(w.message) for w in ours]  # every difference in one warning
    return str(ours[0].message) if ours else ""


def test_resume_fit_checkpoint_with_interval_passed_keeps_interval() -> None:
    """The explicit default: `scale_policy="interval"` passed is kept over a fit checkpoint."""
    saved = _saved(scale_policy="fit")
    assert saved["scale_policy"] == "fit"
    assert saved["_fit_margin"] == FIT_MARGIN + 1  # learned: not the fresh state
    scaler = ShardedGradScaler(scale_policy="interval")
    message = _load(scaler, saved)
    state = scaler.state_dict()
    assert state["scale_policy"] == "interval"
    assert "this scaler's scale_policy='interval' (passed) is kept over the checkpoint's 'fit'" in (
        message
    )
    assert "(its default)" not in message
    # the fit's state is dropped: it reads gradients of before the checkpoint
    assert "fit state, its margin and window, is dropped" in message
    assert (state["_fit_margin"], state["_fit_window"], state["_fit_streak"]) == (
        FIT_MARGIN,
        [0.0] * FIT_WINDOW,
        0,
    )
    assert (state["scale"], state["steps"]) == (saved["scale"], saved["steps"])  # the state


def test_resume_megatron_settings_with_torch_defaults_passed_keeps_them() -> None:
    """Megatron's floor, ceiling and hysteresis, resumed with the defaults passed explicitly:
    2**-24 is the floor the floor's own warning tells the user to pass."""
    saved = _saved(init_scale=2.0**10, min_scale=1.0, max_scale=2.0**20, hysteresis=2)
    assert saved["_hysteresis_tracker"] == 1  # one overflow tolerated: the allowance used
    scaler = ShardedGradScaler(min_scale=2.0**-24, max_scale=None, hysteresis=1)
    message = _load(scaler, saved)
    state = scaler.state_dict()
    assert (state["min_scale"], state["max_scale"], state["hysteresis"]) == (2.0**-24, math.inf, 1)
    assert state["_hysteresis_tracker"] == 1
    assert state["scale"] == saved["scale"] == 2.0**10
    for line in (
        "this scaler's hysteresis=1 (passed) is kept over the checkpoint's 2",
        "this scaler's min_scale=5.960464477539063e-08 (passed) is kept over the checkpoint's 1.0",
        "this scaler's max_scale=inf (passed) is kept over the checkpoint's 1048576.0",
    ):
        assert line in message
    # the same values left out are the checkpoint's
    defaults = ShardedGradScaler()
    message = _load(defaults, saved)
    assert "the checkpoint's min_scale=1.0 replaces this scaler's 5.96" in message
    assert "(not passed)" in message
    assert {k: defaults.state_dict()[k] for k in ("min_scale", "max_scale", "hysteresis")} == {
        "min_scale": 1.0,
        "max_scale": 2.0**20,
        "hysteresis": 2,
    }


def test_resume_static_checkpoint_with_dynamic_passed_moves_the_scale() -> None:
    """A bf16 guard's checkpoint (a fixed scale of 1.0) resumed for fp16 with `dynamic=True`."""
    saved = _saved(init_scale=1.0, dynamic=False)
    assert (saved["dynamic"], saved["scale"]) == (False, 1.0)
    scaler = ShardedGradScaler(dynamic=True)
    message = _load(scaler, saved)
    assert "this scaler's dynamic=True (passed) is kept over the checkpoint's False" in message
    assert scaler.state_dict()["dynamic"] is True
    assert scaler.get_scale() == 1.0  # the checkpoint's scale
    _train(scaler, [math.inf])
    assert scaler.get_scale() == 0.5  # it moves: backed off


@pytest.mark.parametrize(
    ("options", "forced"),
    [
        ({"dynamic": False, "scale_policy": "interval"}, None),
        ({"dynamic": False}, "scale_policy='interval' over the checkpoint's 'fit': dynamic=False"),
    ],
)
def test_resume_fit_checkpoint_into_a_static_scaler_loads_static(
    options: dict[str, Any], forced: str | None
) -> None:
    """Never "scale_policy='fit' ... needs dynamic=True", naming a setting the user turned off:
    the fixed scale passed wins, whether or not the interval rule was passed too."""
    saved = _saved(scale_policy="fit")
    scaler = ShardedGradScaler(**options)
    message = _load(scaler, saved)
    state = scaler.state_dict()
    assert (state["dynamic"], state["scale_policy"]) == (False, "interval")
    assert state["scale"] == saved["scale"]
    assert "this scaler's dynamic=False (passed) is kept over the checkpoint's True" in message
    if forced is not None:
        assert forced in message
    before = scaler.get_scale()
    _train(scaler, [math.inf, 0.3])
    assert scaler.get_scale() == before  # fixed


def test_resume_static_checkpoint_with_fit_passed_fits() -> None:
    """The other pairing: the fit passed over a fixed-scale checkpoint moves the scale."""
    saved = _saved(init_scale=1.0, dynamic=False)
    scaler = ShardedGradScaler(scale_policy="fit")
    message = _load(scaler, saved)
    assert "dynamic=True over the checkpoint's False: scale_policy='fit' was passed" in message
    state = scaler.state_dict()
    assert (state["dynamic"], state["scale_policy"]) == (True, "fit")
    _train(scaler, [2.0**-4])
    assert scaler.get_scale() == 2.0 ** (16 - FIT_MARGIN) * 2.0**3  # fitted at once


def test_resume_torch_settings_passed_are_the_checkpoints_as_torch_loads_them() -> None:
    """torch's keys: the checkpoint's, passed or not, as `torch.amp.GradScaler` loads them
    (torch's own test_grad_scaling_state_dict builds its scaler with other values and checks
    they are overwritten); set them after loading to change them."""
    saved = _saved(growth_interval=3)
    scaler = ShardedGradScaler(growth_factor=4.0, backoff_factor=0.25, growth_interval=10)
    message = _load(scaler, saved)
    factors = (scaler.get_growth_factor(), scaler.get_backoff_factor())
    assert (*factors, scaler.get_growth_interval()) == (2.0, 0.5, 3)
    for key, theirs, mine in (("growth_factor", 2.0, 4.0), ("growth_interval", 3, 10)):
        line = (
            f"the checkpoint's {key}={theirs!r} replaces this scaler's {mine!r} (torch's setting)"
        )
        assert line in message
    theirs = torch.amp.GradScaler("cpu", growth_factor=4.0, growth_interval=10)
    theirs.load_state_dict(saved)
    assert (theirs.get_growth_factor(), theirs.get_growth_interval()) == (2.0, 3)  # the same
    scaler.set_growth_interval(10)
    assert scaler.state_dict()["growth_interval"] == 10


def test_resume_one_warning_names_every_difference_both_values_and_who_won() -> None:
    saved = _saved(growth_interval=3, hysteresis=2, min_scale=1.0, scale_policy="fit")
    scaler = ShardedGradScaler(growth_interval=5, min_scale=2.0**-10)
    message = _load(scaler, saved)  # one warning (asserted there)
    assert "the checkpoint's growth_interval=3 replaces this scaler's 5 (torch's setting)" in (
        message
    )
    assert "the checkpoint's hysteresis=2 replaces this scaler's 1 (not passed)" in message
    assert "this scaler's min_scale=0.0009765625 (passed) is kept over the checkpoint's 1.0" in (
        message
    )
    assert "the checkpoint's scale_policy='fit' replaces this scaler's 'interval'" in message
    differences = message.split(". ")[0]
    assert differences.count(" replaces ") + differences.count(" is kept over ") == 4
    for setting in ("backoff_factor", "growth_factor", "max_scale", "dynamic"):
        assert setting not in differences  # agreed: not named


def test_resume_passed_settings_survive_pickling() -> None:
    scaler = pickle.loads(pickle.dumps(ShardedGradScaler(scale_policy="interval")))
    _load(scaler, _saved(scale_policy="fit"))
    assert scaler.state_dict()["scale_policy"] == "interval"


def test_resume_settings_that_break_a_rule_together_are_refused_naming_where_each_came_from() -> (
    None
):
    saved = _saved(min_scale=1.0)
    scaler = ShardedGradScaler(init_scale=0.25, max_scale=0.5)
    before = scaler.state_dict()
    rule = (
        r"max_scale must be >= min_scale, got max_scale=0.5 \(passed\) and min_scale=1.0 "
        r"\(the checkpoint's\)"
    )
    with pytest.raises(ValueError, match=rule):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == before


# ---------------------------------------------------------------- a load mid-iteration


_MID_ITERATION = r"A GradScaler state may only be loaded at the beginning of an iteration"


@pytest.mark.parametrize("after", ["backward", "unscale_", "clip_grad_norm_", "step"])
def test_resume_load_mid_iteration_is_refused_and_the_iteration_stays_exact(after: str) -> None:
    """The 64x case: loaded between backward and step, the gradients (which carry 2**16) were
    divided by the loaded 2**10. Refused, with the scaler unchanged; the iteration completes
    at the scale its loss had, and a load after update() then takes."""
    model = _Planted()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = ShardedGradScaler(init_scale=2.0**16)
    saved = {**scaler.state_dict(), "scale": 2.0**10}
    scaler.scale(model.loss(0.5)).backward()
    if after != "backward":
        getattr(scaler, after)(*((model.parameters(), 10.0) if after[0] == "c" else (optimizer,)))
    before = scaler.state_dict()
    with pytest.raises(RuntimeError, match=_MID_ITERATION):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == before
    if after != "step":
        scaler.step(optimizer)
    scaler.update()
    assert model.w.tolist() == [-0.5] * 4  # lr 1: the gradient exactly 0.5, not 64x
    scaler.load_state_dict(saved)
    assert scaler.get_scale() == 2.0**10


def test_resume_load_after_a_scale_without_grad_is_taken_by_the_next_loss() -> None:
    """torch's own test_grad_scaling_state_dict scales a tensor without grad (to place the
    scale on its device) before loading: nothing carries that scale, so the load is taken."""
    scaler = ShardedGradScaler(init_scale=2.0**16)
    scaler.scale(torch.tensor(1.0))
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**10})
    assert scaler.scale(torch.tensor(1.0, requires_grad=True)).item() == 2.0**10


def test_resume_load_after_an_abandoned_iteration_takes_the_way_out_its_error_names() -> None:
    """A job that rolls back on a NaN loss: scaled and backpropagated, never stepped. The load
    is refused (the gradients carry the old scale), and the way out the error names works:
    `update(new_scale=scaler.get_scale())` ends the iteration without counting a step, and the
    load then takes."""
    model = _Planted()
    scaler = ShardedGradScaler(init_scale=2.0**16)
    saved = {**scaler.state_dict(), "scale": 2.0**10}
    scaler.scale(model.loss(math.nan)).backward()
    with pytest.raises(RuntimeError, match=r"update\(new_scale=scaler.get_scale\(\)\)"):
        scaler.load_state_dict(saved)
    scaler.update(new_scale=scaler.get_scale())
    assert scaler.stats.steps == 0  # no step counted
    scaler.load_state_dict(saved)
    assert scaler.get_scale() == 2.0**10


def test_resume_load_after_loss_scale_tensor_is_refused() -> None:
    """`loss_scale_tensor()` hands out the scale a backward may carry (Megatron's auxiliary
    losses): the iteration is under way."""
    scaler = ShardedGradScaler()
    scaler.loss_scale_tensor("cpu")
    with pytest.raises(RuntimeError, match=_MID_ITERATION):
        scaler.load_state_dict(scaler.state_dict())


# ---------------------------------------------------------------- through DCP, on 2 ranks


def _rank_resume_with_passed_settings(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """A fit run saved through DCP, resumed with the interval rule and the default floor passed;
    a second scaler, built with defaults, resumes as saved."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saving = ShardedGradScaler(scale_policy="fit", min_scale=1.0, hysteresis=2)
        _train(saving, [0.3 * (rank + 1), math.inf, 0.3])
        dcp.save({"scaler": saving}, checkpoint_id=folder)
        passed = ShardedGradScaler(scale_policy="interval", min_scale=2.0**-24)
        dcp.load({"scaler": passed}, checkpoint_id=folder)
        defaults = ShardedGradScaler()
        dcp.load({"scaler": defaults}, checkpoint_id=folder)
    passed.verify_agreement()
    return {
        "saved": saving.state_dict(),
        "passed": passed.state_dict(),
        "defaults": defaults.state_dict(),
    }


def test_resume_through_dcp_on_two_ranks_keeps_what_was_passed(tmp_path: Path) -> None:
    results = run_ranks(_rank_resume_with_passed_settings, 2, str(tmp_path / "checkpoint"))
    assert results[0] == results[1]  # every rank alike
    saved, passed = results[0]["saved"], results[0]["passed"]
    assert (passed["scale_policy"], passed["min_scale"], passed["hysteresis"]) == (
        "interval",
        2.0**-24,
        2,
    )
    assert (passed["scale"], passed["steps"]) == (saved["scale"], saved["steps"])
    assert results[0]["defaults"] == saved
