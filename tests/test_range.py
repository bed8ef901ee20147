"""fp16's whole range, both ways: never stuck where torch's scaler trains, never silent on a bug.

The runs users meet (fp16 autocast on the CPU, an MLP, Adam, one process unless said): a loss
summed over tokens, whose gradients overflow fp16 at scale 1 (the scale must go below 1, as
torch's does); a NaN that is a bug (every scale overflows: an error on every rank, naming the
parameter, before anything reaches the weights); infs now and then (never an error); a streak of
non-finite losses (a warning, once a streak, and the run recovers). Each beside
`torch.amp.GradScaler` on the same batches.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import (
    ShardedGradScaler,
    ShardScaleNonFiniteError,
    ShardScaleSkipError,
    ShardScaleWarning,
)
from shardscale.testing import cuda_path
from tests.devicepath import META, DeviceCounter, Fused, meta_params
from tests.harness import run_ranks

Make = Callable[[float], Any]
TORCH: Make = lambda init: torch.amp.GradScaler("cpu", init_scale=init)  # noqa: E731
OURS: Make = lambda init: ShardedGradScaler(init_scale=init)  # noqa: E731
FIT: Make = lambda init: ShardedGradScaler(init_scale=init, scale_policy="fit")  # noqa: E731


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
    )


def _train(
    make: Make,
    steps: int,
    *,
    init: float = 2.0**16,
    gain: float = 1.0,
    summed: bool = False,
    plant: Callable[[nn.Module, int], None] | None = None,
) -> dict[str, Any]:
    """`steps` iterations on fixed batches; what was skipped (by the optimizer's own step count),
    the scales, and the error that ended the run, if any."""
    model = _model()
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    scaler = make(init)
    taken, scales, error = [], [], None
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(32, 64, generator=generator), torch.randn(32, 1)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            outputs = model(inputs).float()
        errors = (outputs - targets) ** 2
        scaler.scale((errors.sum() if summed else errors.mean()) * gain).backward()
        if plant is not None:
            plant(model, step)
        before = _steps_taken(optimizer)
        try:
            scaler.step(optimizer)
            scaler.update()
        except ShardScaleSkipError as caught:
            error = (step + 1, caught)
            break
        taken.append(_steps_taken(optimizer) > before)
        scales.append(scaler.get_scale())
    finite = all(bool(p.isfinite().all()) for p in model.parameters())
    return {"taken": taken, "skips": taken.count(False), "scales": scales, "error": error,
            "finite": finite}  # fmt: skip


def _steps_taken(optimizer: torch.optim.Optimizer) -> float:
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return float(state.get("step", 0))


def _plant_nan(model: nn.Module, step: int) -> None:
    model[2].weight.grad[0, 0] = math.nan  # type: ignore[index]


def _plant_inf_every_37th(model: nn.Module, step: int) -> None:
    if step % 37 == 36:
        model[2].weight.grad[1, 1] = math.inf  # type: ignore[index]


@pytest.mark.filterwarnings("ignore::shardscale.ShardScaleWarning")
def test_range_summed_loss_trains_below_1_as_torchs_and_the_fit_in_a_few_skips() -> None:
    """A loss summed over the batch times 2**20: at scale 1 the fp16 gradients overflow."""
    torchs, ours, fit = (
        _train(make, 300, gain=2.0**20, summed=True) for make in (TORCH, OURS, FIT)
    )
    assert torchs["error"] is None
    assert sum(torchs["taken"][-100:]) >= 95
    assert ours["error"] is None
    assert ours["skips"] <= torchs["skips"]
    assert sum(ours["taken"][-100:]) >= 95
    assert ours["scales"][-1] < 1.0  # below 1, where these gradients need it
    assert fit["error"] is None
    assert fit["skips"] <= 8  # torch's halves once per skipped step: 26 here
    assert sum(fit["taken"][-100:]) >= 95


@pytest.mark.parametrize("make", [OURS, FIT], ids=["default", "fit"])
def test_range_nan_at_every_scale_raises_naming_the_parameter_weights_untouched(make: Make) -> None:
    run = _train(make, 100, plant=_plant_nan)
    assert run["error"] is not None
    step, error = run["error"]
    assert step <= 64
    assert isinstance(error, ShardScaleNonFiniteError)
    message = str(error)
    assert "rank 0: 2.weight (0 inf, 1 NaN)" in message  # named as the model names it
    assert "NaN" in message
    assert "bug" in message
    assert "at 8 consecutive steps at min_scale=5.96" in message
    assert run["finite"]  # every step it stood on was skipped


def test_range_nan_at_every_scale_torchs_collapses_to_zero_ours_never() -> None:
    """What the error replaces: torch's scale halves to 0 and it skips forever."""
    torchs = _train(TORCH, 200, plant=_plant_nan)
    assert torchs["error"] is None
    assert torchs["scales"][-1] == 0.0
    assert torchs["skips"] == 200
    skipping = _train(
        lambda init: ShardedGradScaler(init_scale=init, max_overflows_at_floor=None),
        100,
        plant=_plant_nan,
    )
    assert skipping["error"] is None  # torch's behaviour, asked for
    assert skipping["skips"] == 100
    assert min(skipping["scales"]) == 2.0**-24


@pytest.mark.filterwarnings("error::shardscale.ShardScaleWarning")
def test_range_an_inf_now_and_then_never_raises_and_skips_as_torchs() -> None:
    torchs, ours = (_train(make, 600, plant=_plant_inf_every_37th) for make in (TORCH, OURS))
    assert ours["error"] is None
    assert ours["skips"] == torchs["skips"] == 16
    assert ours["scales"] == torchs["scales"]
    fit = _train(FIT, 600, plant=_plant_inf_every_37th)
    assert fit["error"] is None


def test_range_a_streak_of_nonfinite_losses_warns_once_and_the_run_recovers() -> None:
    """200 NaN losses, then healthy ones: skipped with the scale held, one warning naming the
    rank, no error; then the run trains. A second streak warns again."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = ShardedGradScaler()
    pattern = [True] * 200 + [False] * 20 + [True] * 10 + [False] * 5
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, bad in enumerate(pattern):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step)))
            scaler.scale(loss.float().mean() * (math.nan if bad else 1.0)).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
    assert scales[:200] == [2.0**16] * 200  # held: no scale fixes a forward overflow
    assert min(scales) > 0
    told = [w for w in caught if issubclass(w.category, ShardScaleWarning)]
    assert len(told) == 2
    assert "step 8: the loss itself was non-finite" in str(told[0].message)
    assert "on rank(s) [0]" in str(told[0].message)
    assert "step 228: " in str(told[1].message)
    stats = scaler.stats
    assert stats.forward_overflows == 210
    assert stats.consecutive_skips == 0  # training again


def _overflowing_steps(
    scaler: ShardedGradScaler, model: nn.Linear, optimizer: Any, steps: int, value: float
) -> None:
    """`steps` iterations whose weight gradient holds `value` (a finite loss)."""
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        model.weight.grad[0, 0] = value  # type: ignore[index]
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize(
    ("value", "said"),
    [(math.nan, r"are NaN: no overflow at a scale this low explains"), (math.inf, r"are inf")],
    ids=["nan", "inf"],
)
def test_range_floor_warning_tells_a_nan_from_an_inf(value: float, said: str) -> None:
    scaler = ShardedGradScaler(init_scale=4.0, min_scale=1.0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1)
    with pytest.warns(ShardScaleWarning, match=r"step 2: the loss scale has backed off") as told:
        _overflowing_steps(scaler, model, optimizer, 3, value)
    message = str(told[0].message)
    assert re.search(said, message)
    assert "weight (" in message
    if value == math.inf:  # a floor above 2**-24: the range is the cause, and the remedy
        assert "exceed fp16's range even at this scale. Lower min_scale" in message


def test_range_static_scale_raises_after_the_limit_without_the_floor_warning() -> None:
    """`dynamic=False` (the bf16 guard): the scale cannot move, so a streak of overflows is
    the error's case at once (no floor to back off to, nothing to warn of first)."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(dynamic=False, max_overflows_at_floor=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardScaleWarning)
        with pytest.raises(ShardScaleNonFiniteError, match=r"step 3: .*fixed \(dynamic=False\)"):
            _overflowing_steps(scaler, model, optimizer, 5, math.inf)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, r"max_overflows_at_floor must be >= 1 \(None: no limit\), got 0"),
        (2.0, TypeError, r"max_overflows_at_floor must be an int or None, got float"),
    ],
)
def test_range_bad_limit_says_the_rule(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedGradScaler(max_overflows_at_floor=value)  # type: ignore[arg-type]


def _rank_nan_on_one_rank(rank: int, world_size: int, policy: str) -> dict[str, Any]:
    """DDP-style: gradients all-reduced by hand; rank 1 plants a NaN after, on its copy only
    (a bug on one rank). Every rank must raise the same error at the same step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3, fused=True)
    scaler = ShardedGradScaler(scale_policy=policy, sync_timeout=20.0)
    for step in range(100):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
        scaler.scale(loss.float().mean()).backward()
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)  # type: ignore[arg-type]
        if rank == 1:
            model[2].weight.grad[0, 3] = math.nan  # type: ignore[index]
        try:
            scaler.step(optimizer)
            scaler.update()
        except ShardScaleNonFiniteError as error:
            weights = [p.detach().flatten().tolist() for p in model.parameters()]
            return {"step": step + 1, "message": str(error), "weights": weights}
    return {"step": None}


@pytest.mark.parametrize("policy", ["interval", "fit"])
def test_range_nan_on_one_rank_raises_on_every_rank_at_the_same_step(policy: str) -> None:
    rank0, rank1 = run_ranks(_rank_nan_on_one_rank, 2, policy)
    assert rank0["step"] is not None
    assert rank0["step"] == rank1["step"] <= 64
    assert rank0["message"] == rank1["message"]
    assert "rank 1: 2.weight (0 inf, 1 NaN)" in rank0["message"]
    assert "rank 0:" not in rank0["message"]
    assert rank0["weights"] == rank1["weights"]  # the replicas never parted
    assert all(math.isfinite(v) for values in rank0["weights"] for v in values)


def _fused_meta_steps(
    scaler: ShardedGradScaler, optimizer: Fused, counter: DeviceCounter, landings: list[float]
) -> list[int]:
    """A fused step + update on meta per entry: the alarms' non-blocking copy lands as it says
    (the streaks as the device counted them); the host syncs each update cost."""
    syncs = []
    for landing in landings:
        counter.landing = counter.value = landing
        scaler.scale(torch.ones((), device=META))
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        before = counter.syncs
        scaler.step(optimizer)
        scaler.update()
        syncs.append(counter.syncs - before)
    return syncs


def test_range_alarm_on_a_gpu_reads_nothing_while_quiet_and_sounds_one_update_late() -> None:
    """On the device path (meta, `shardscale.testing.cuda_path()`): a fused step's streaks are
    copied without waiting and read at the next update; only once that copy shows a streak does
    an update read them (a sync), and then the alarm sounds on what it read."""
    optimizer = Fused(meta_params())
    scaler = ShardedGradScaler()
    with cuda_path(), DeviceCounter() as counter:
        assert _fused_meta_steps(scaler, optimizer, counter, [0.0] * 4) == [0, 0, 0, 0]
        # step 5's streaks (as copied) are at the limit; its own update has not read them
        assert _fused_meta_steps(scaler, optimizer, counter, [8.0]) == [0]
        with pytest.raises(ShardScaleNonFiniteError, match=r"step 6: .* at 8 consecutive steps"):
            _fused_meta_steps(scaler, optimizer, counter, [8.0])  # read, at update 6: sounded
    assert ("to_cpu", None) in counter.log  # the update that sounded read the streaks
