"""The underflow meter (`underflow_every`, `stats.underflow`) and `find_underflowing_grads`.

Gradients are planted (a parameter `w` and the loss `(w * g).sum()`, whose float32 gradient is
exactly `g` times the scale), so the meter is checked against a count taken here, in float64,
of the same scaled values: of the non-zero elements, those below fp16's smallest normal 2^-14.
The planted magnitudes sit mid-binade (1.5 x a power of two), so no count depends on rounding.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import pytest
import torch

from shardscale import (
    AsyncShardedGradScaler,
    NonFiniteGrad,
    ShardedGradScaler,
    UnderflowingGrad,
    find_nonfinite_grads,
    find_underflowing_grads,
)
from tests.harness import run_ranks
from tests.setups import build, local_grad_values, mlp
from tests.test_fit import Planted, counted_steps

TINY = 2.0**-14  # fp16's smallest normal
TARGET = 1e-3  # the meter's: at most 0.1% below TINY


def _spread(size: int = 4096, low: int = -50, high: int = 4, seed: int = 0) -> torch.Tensor:
    """Magnitudes 1.5 x 2^k, k uniform in [low, high), random signs, one element in 16 zero."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(low, high, (size,), generator=generator).double()
    signs = torch.randint(0, 2, (size,), generator=generator).double() * 2 - 1
    values = 1.5 * torch.exp2(exponents) * signs
    values[::16] = 0.0
    return values.float()


def _expected(scaled: torch.Tensor) -> tuple[float, float]:
    """By hand: the fraction of the non-zero `scaled` elements below 2^-14, and the lowest
    power-of-two multiple of the scale (as a factor) from which at most 0.1% are."""
    nonzero = scaled[scaled != 0].double().abs()
    fraction = float((nonzero < TINY).double().mean())
    factors = [
        2.0**k for k in range(-80, 81) if float((nonzero * 2.0**k < TINY).double().mean()) <= TARGET
    ]
    return fraction, min(factors)


def _run(scaler: ShardedGradScaler, grads: list[torch.Tensor], how: str = "step") -> list[Any]:
    """Steps with the planted gradients; for each, the scale it ran at, the scaled gradient the
    scaler saw, and the stats after its update."""
    model = Planted(grads[0].numel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    for grad in grads:
        optimizer.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(model.loss(grad)).backward()
        assert model.w.grad is not None
        scaled = model.w.grad.clone()
        if how in ("unscale_", "unscale_ + clip"):
            scaler.unscale_(optimizer)
        if how in ("clip", "unscale_ + clip"):
            scaler.clip_grad_norm_(model.parameters(), max_norm=1e30)
        if how == "clip inf-norm":
            scaler.clip_grad_norm_(model.parameters(), max_norm=1e30, norm_type=math.inf)
        scaler.step(optimizer)
        scaler.update()
        seen.append((scale, scaled, scaler.stats))
    return seen


@pytest.mark.parametrize("how", ["step", "unscale_", "clip", "unscale_ + clip"])
def test_meter_matches_an_fp32_count_of_the_scaled_gradients(how: str) -> None:
    scaler = ShardedGradScaler(init_scale=2.0**10, underflow_every=1, growth_interval=10**6)
    # two steps: the first agrees unscale_ at once, later ones defer it to the step
    for scale, scaled, stats in _run(scaler, [_spread(seed=0), _spread(seed=1)], how):
        fraction, factor = _expected(scaled)
        assert 0.05 < fraction < 0.95  # a real mix on both sides of 2^-14
        assert stats.underflow == pytest.approx(fraction, abs=1e-6)
        assert stats.underflow_scale == scale * factor
        assert stats.underflow_step == stats.steps


def test_meter_reads_the_async_scalers_steps_as_the_synchronous_ones() -> None:
    """`AsyncShardedGradScaler`'s iterations (here on one thread) meter through the same
    ballot: the same readings, step for step, as the synchronous scaler's."""
    grads = [_spread(seed=0), _spread(seed=1)]
    settings: dict[str, Any] = {"init_scale": 2.0**10, "underflow_every": 1}
    ours = _run(AsyncShardedGradScaler(**settings), grads)
    for (scale, scaled, stats), (*_, sync) in zip(
        ours, _run(ShardedGradScaler(**settings), grads), strict=True
    ):
        fraction, factor = _expected(scaled)
        assert stats.underflow == pytest.approx(fraction, abs=1e-6)
        assert stats.underflow_scale == scale * factor
        assert stats == sync


def test_meter_finds_the_scale_for_the_target_up_and_down() -> None:
    """All above 2^-14 by far: a lower scale would do; all below: a higher one is needed."""
    for grad_exponents, scale_exponent in (((-8, -4), 10), ((-60, -50), 10)):
        scaler = ShardedGradScaler(init_scale=2.0**scale_exponent, underflow_every=1)
        [(scale, scaled, stats)] = _run(scaler, [_spread(1024, *grad_exponents)])
        fraction, factor = _expected(scaled)
        assert stats.underflow == pytest.approx(fraction, abs=1e-6)
        assert stats.underflow_scale == scale * factor
    assert factor > 1  # the last case: a higher scale needed


def test_meter_reads_every_k_steps_and_zero_turns_it_off() -> None:
    assert ShardedGradScaler()._config.underflow_every == 100  # the default
    grads = [_spread(256, seed=s) for s in range(6)]
    steps = [
        stats.underflow_step for *_, stats in _run(ShardedGradScaler(underflow_every=3), grads)
    ]
    assert steps == [None, None, 3, 3, 3, 6]
    off = _run(ShardedGradScaler(underflow_every=0), grads)
    assert [(s.underflow_step, s.underflow, s.underflow_scale) for *_, s in off] == [
        (None, None, None)  # never measured: None, never a 0 that reads like a measurement
    ] * 6


def test_meter_reads_a_step_with_an_inf_norm_clip() -> None:
    """The ballot always reduces by a SUM (an inf-norm's shares travel one slot per rank, its
    max taken after): the meter's counts travel beside an inf-norm clip too."""
    scaler = ShardedGradScaler(underflow_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step it could not read
        [(*_, stats)] = _run(scaler, [_spread(256)], "clip inf-norm")
    assert stats.underflow_step == 1
    assert stats.underflow is not None


def test_meter_bad_arguments_say_the_rule() -> None:
    with pytest.raises(ValueError, match=r"underflow_every must be >= 0, got -1"):
        ShardedGradScaler(underflow_every=-1)
    for bad in (1.5, True, "10"):
        with pytest.raises(TypeError, match=r"underflow_every must be an int"):
            ShardedGradScaler(underflow_every=bad)  # type: ignore[arg-type]


def test_meter_logs_a_reading_above_the_target_and_nothing_below(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="shardscale"):
        _run(ShardedGradScaler(init_scale=1.0, underflow_every=2), [_spread(256)] * 3)
        _run(ShardedGradScaler(init_scale=2.0**30, underflow_every=1), [_spread(256, -10, 0)])
    messages = [r.getMessage() for r in caplog.records if r.name == "shardscale"]
    assert len(messages) == 1, messages
    assert messages[0].startswith("step 2: ")
    assert "of the non-zero gradient elements were below fp16's normal range" in messages[0]


def test_meter_leaves_the_fit_as_it_was() -> None:
    """On the meter's steps the fit reads its bound from the counts: the same scales."""
    grads = [_spread(512, -30, -20, seed=s) for s in range(4)] + [_spread(512, -40, -30)]
    runs = []
    for every in (0, 1):
        scaler = ShardedGradScaler(scale_policy="fit", underflow_every=every)
        runs.append([scale for scale, *_ in _run(scaler, grads, "unscale_")] + [scaler.get_scale()])
    assert runs[0] == runs[1]


def _ranks_meter(rank: int, world_size: int, clip: bool) -> dict[str, Any]:
    """Rank 0's gradients all lie below 2^-14 (times the scale), rank 1's all above."""
    scaler = ShardedGradScaler(init_scale=1.0, underflow_every=1)
    model = Planted(64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grad = torch.full((64,), 1e-6 if rank == 0 else 1.0)
    counts = counted_steps(scaler, model, optimizer, grad, 2, clip)
    return {"stats": scaler.stats, "collectives": counts}


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip 2-norm"])
def test_meter_counts_every_ranks_elements_in_the_one_collective(clip: bool) -> None:
    rank0, rank1 = run_ranks(_ranks_meter, 2, clip)
    assert rank0["stats"] == rank1["stats"]
    assert rank0["stats"].underflow == 0.5  # half the group's elements: rank 0's
    assert rank0["stats"].underflow_scale == 2.0**6  # 1e-6 x 2^6 >= 2^-14 > 1e-6 x 2^5
    assert rank0["collectives"] == rank1["collectives"] == ([2, 1] if clip else [1, 1])


@pytest.mark.parametrize(
    ("unscale_first", "clip"), [(False, False), (False, True), (True, False), (True, True)]
)
def test_meter_fused_step_adds_no_host_read_on_the_device_path(
    unscale_first: bool, clip: bool
) -> None:
    """On the meta device (every non-CPU branch), counted as the suite counts torch's."""
    from tests.devicepath import Case, measure

    case = Case("fused", {"underflow_every": 1}, unscale_first=unscale_first, clip=clip)
    counts = measure(case)
    default = measure(Case("fused", unscale_first=unscale_first, clip=clip))  # the watch's copy
    assert (counts.host_reads, counts.d2h_blocking, counts.d2h_async) == (0, 0, default.d2h_async)


def test_find_underflowing_grads_names_the_layers_and_takes_a_scale() -> None:
    model = mlp()
    model(torch.ones(2, 16)).sum().backward()
    with torch.no_grad():
        for param in model.parameters():
            param.grad.fill_(1.0)
        model[0].weight.grad.fill_(1e-6)
        model[0].weight.grad[0] = 0.0  # zeros are not counted
    (record,) = find_underflowing_grads(model)
    nonzero = model[0].weight.numel() - model[0].weight.shape[1]
    assert record == UnderflowingGrad(0, "0.weight", nonzero, nonzero)
    assert record.fraction == 1.0
    assert find_underflowing_grads(model, scale=2.0**7) == []  # 1e-6 x 128 > 2^-14
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module, got list"):
        find_underflowing_grads([model])  # type: ignore[arg-type]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"scale must be a finite number > 0, got"):
            find_underflowing_grads(model, scale=bad)
    with pytest.raises(TypeError, match=r"scale must be a float, got str"):
        find_underflowing_grads(model, scale="1")  # type: ignore[arg-type]


def _rank_underflowing(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """Every local element set below 2^-14, then to inf: both finders must name the same
    (rank, parameter) pieces, with the same counts."""
    setup = build(kind, "for-loop", world_size)
    setup.loss(0, rank).backward()
    held = [v for p in setup.model.parameters() if (v := local_grad_values(p)) is not None]
    for values in held:
        values.fill_(1e-6)
    underflowing = find_underflowing_grads(setup.model)
    for values in held:
        values.fill_(math.inf)
    return {"underflowing": underflowing, "nonfinite": find_nonfinite_grads(setup.model)}


@pytest.mark.parametrize("kind", ["ddp", "fsdp1", "fsdp2"])
def test_find_underflowing_grads_names_original_params_on_every_rank(kind: str) -> None:
    results = run_ranks(_rank_underflowing, 2, kind)
    for result in results:
        assert result["underflowing"] == results[0]["underflowing"]  # identical on every rank
        nonfinite: list[NonFiniteGrad] = result["nonfinite"]
        assert {r.rank for r in nonfinite} == {0, 1}
        assert [
            (r.rank, r.name, r.num_underflowing, r.num_nonzero) for r in result["underflowing"]
        ] == [(r.rank, r.name, r.num_inf, r.num_inf) for r in nonfinite]
