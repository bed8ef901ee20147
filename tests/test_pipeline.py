"""Pipeline and 3-D parallel jobs: every stage agrees, clipping is global, one collective.

Only the last stage computes a loss (``loss_fn`` scales it), so the other stages never call
``scaler.scale()``; they still check, step and update with the rest, in the same one collective.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardscale import ShardedGradScaler, count_collectives
from tests import pipelines
from tests.harness import run_ranks
from tests.setups import plant_in

SCALE = 2.0**10
OPTIMIZERS = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def _rank_step(
    rank: int,
    world_size: int,
    layout: str,
    schedule: str,
    flavour: str,
    plant_on: int | None,
    value: float,
    clip: bool,
) -> dict[str, Any]:
    """Two iterations: a clean one, then one where rank ``plant_on`` (if any) overflows."""
    scaler = ShardedGradScaler(init_scale=SCALE, growth_interval=1000)
    pipeline = pipelines.build(layout, schedule, scaler, rank, world_size)
    optimizer = torch.optim.AdamW(pipeline.parameters(), lr=0.01, **OPTIMIZERS[flavour])
    replica_group: Any = None
    if layout == "pp":
        replica_group = 1
    elif layout == "pp_ddp":
        replica_group = pipeline.dp_group
    results = []
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        pipeline.run(step, scaler)
        expected = pipelines.global_norm(pipeline, scaler.get_scale())
        if step == 1 and plant_on == rank:
            plant_in(pipeline.parameters(), value)
        before = [p.detach().clone() for p in pipeline.parameters()]
        with count_collectives() as counts:
            norm = (
                scaler.clip_grad_norm_(pipeline.parameters(), 1e-3, replica_group=replica_group)
                if clip
                else None
            )
            scaler.step(optimizer)
            scaler.update()
        moved = [
            not torch.equal(b, p.detach())
            for b, p in zip(before, pipeline.parameters(), strict=True)
        ]
        results.append(
            {
                "skipped": scaler.last_step_skipped,
                "scale": scaler.get_scale(),
                "collectives": sum(counts.values()),
                "norm": None if norm is None else norm.item(),
                "expected_norm": expected,
                "all_moved": all(moved),
                "none_moved": not any(moved),
            }
        )
    return {"steps": results, "last": pipeline.last, "stats": scaler.stats}


def _check_agreement(results: list[dict[str, Any]], overflow: bool, clip: bool) -> None:
    for clean, second in (r["steps"] for r in results):
        assert not clean["skipped"]
        assert clean["all_moved"]
        # an optimizer's first step after a clip agrees at a collective of its own
        assert clean["collectives"] == (2 if clip else 1)
        assert second["skipped"] is overflow
        assert second["none_moved"] if overflow else second["all_moved"]
        assert second["collectives"] == 1
        assert second["scale"] == (SCALE / 2 if overflow else SCALE)
        if clip:
            assert clean["norm"] == pytest.approx(clean["expected_norm"], rel=1e-4)
            assert math.isfinite(second["norm"]) is not overflow
    # every rank: the same decisions, scales, norms and counters, whichever stage it holds
    assert len({repr(r["steps"][1]["norm"]) for r in results}) == 1
    assert len({r["stats"] for r in results}) == 1
    assert any(r["last"] for r in results)
    assert not all(r["last"] for r in results)


@pytest.mark.parametrize("schedule", pipelines.SCHEDULES)
def test_pipeline_non_last_stage_overflow_skips_every_stage(schedule: str) -> None:
    results = run_ranks(_rank_step, 2, "pp", schedule, "foreach", 0, math.inf, True)
    _check_agreement(results, overflow=True, clip=True)


@pytest.mark.parametrize("flavour", list(OPTIMIZERS))
@pytest.mark.parametrize(("plant_on", "value"), [(0, math.inf), (1, math.nan), (None, 0.0)])
def test_pipeline_every_flavour_agrees_wherever_the_overflow_is(
    flavour: str, plant_on: int | None, value: float
) -> None:
    results = run_ranks(_rank_step, 2, "pp", "1f1b", flavour, plant_on, value, False)
    _check_agreement(results, overflow=plant_on is not None, clip=False)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("flavour", ["foreach", "fused"])
def test_pipeline_fsdp2_one_shard_overflows_all_skip_and_norm_is_global(
    world_size: int, flavour: str
) -> None:
    results = run_ranks(
        _rank_step, world_size, "pp_fsdp2", "gpipe", flavour, 0, math.inf, True, timeout_s=180
    )
    _check_agreement(results, overflow=True, clip=True)


@pytest.mark.parametrize("layout", ["pp_ddp", "pp_tp"])
def test_pipeline_2d_layouts_agree_and_norm_is_global(layout: str) -> None:
    results = run_ranks(_rank_step, 4, layout, "1f1b", "foreach", 3, math.inf, True, timeout_s=180)
    _check_agreement(results, overflow=True, clip=True)


def _rank_nobody_scales(rank: int, world_size: int) -> dict[str, Any]:
    """No rank ever calls scale(): every rank raises torch's error, gradients untouched."""
    model = torch.nn.Linear(4, 4)
    model(torch.ones(2, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler()
    try:
        scaler.step(optimizer)
    except RuntimeError as error:
        untouched = all(
            torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True)
        )
        return {"error": str(error), "untouched": untouched}
    return {"error": None}


def test_no_rank_scaling_raises_torch_error_on_every_rank_and_modifies_nothing() -> None:
    for result in run_ranks(_rank_nobody_scales, 2):
        assert result["error"].startswith("Attempted step but _scale is None")
        assert result["untouched"]


def _rank_plain_pipeline_default_replicas_warns(rank: int, world_size: int) -> list[str]:
    scaler = ShardedGradScaler(init_scale=SCALE)
    pipeline = pipelines.build("pp", "gpipe", scaler, rank, world_size)
    pipeline.run(0, scaler)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.clip_grad_norm_(pipeline.parameters(), 1.0)
    return [str(w.message) for w in caught]


def test_clip_plain_gradients_on_a_stage_without_loss_warns_about_replica_group() -> None:
    first, last = run_ranks(_rank_plain_pipeline_default_replicas_warns, 2)
    assert len(first) == 1
    assert "pass replica_group=" in first[0]
    assert last == []  # the last stage called scale(): nothing suggests a pipeline there


def _rank_replica_group_bad(rank: int, world_size: int, value: Any) -> str:
    scaler = ShardedGradScaler()
    model = torch.nn.Linear(2, 2)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    try:
        scaler.clip_grad_norm_(model.parameters(), 1.0, replica_group=value)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, r"ValueError: replica_group must be in \[1, 2\] .* got 3"),
        (0, r"ValueError: replica_group must be in \[1, 2\] .* got 0"),
        ("dp", r"TypeError: replica_group must be a ProcessGroup, a 1-D DeviceMesh, an int"),
    ],
)
def test_clip_bad_replica_group_raises_rule_and_value(value: Any, expected: str) -> None:
    import re

    for message in run_ranks(_rank_replica_group_bad, 2, value):
        assert re.match(expected, message), message


def _rank_stage_without_scale_loads_and_verifies(rank: int, world_size: int) -> dict[str, Any]:
    """A non-last stage's scaler: state_dict, stats and verify_agreement match the last's."""
    scaler = ShardedGradScaler(init_scale=SCALE, growth_interval=2)
    pipeline = pipelines.build("pp", "gpipe", scaler, rank, world_size)
    optimizer = torch.optim.SGD(pipeline.parameters(), lr=0.01)
    for step in range(3):
        optimizer.zero_grad()
        pipeline.run(step, scaler)
        scaler.step(optimizer)
        scaler.update()
    scaler.verify_agreement()
    state = scaler.state_dict()
    fresh = ShardedGradScaler()
    fresh.load_state_dict(state)
    fresh.verify_agreement()
    return {"state": state, "stats": scaler.stats, "fresh": fresh.state_dict()}


def test_stage_without_scale_has_the_same_state_stats_and_verifies() -> None:
    first, last = run_ranks(_rank_stage_without_scale_loads_and_verifies, 2)
    assert first == last
    assert first["state"]["scale"] == SCALE * 2  # grew after two clean steps, on both stages
    assert first["fresh"] == first["state"]


def test_world_of_one_without_scale_raises_before_touching_gradients() -> None:
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()  # type: ignore[union-attr]
    scaler = ShardedGradScaler()
    with pytest.raises(RuntimeError, match=r"Attempted step but _scale is None"):
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.equal(model.weight.grad, before)  # type: ignore[arg-type]


def _rank_torch_order_in_a_pipeline(rank: int, world_size: int) -> list[dict[str, Any]]:
    """unscale_ -> clip_grad_norm_ -> step on every stage, from the first step on: the stage
    that never scaled and the last stage issue the same collectives (else they would hang)."""
    scaler = ShardedGradScaler(init_scale=SCALE)
    pipeline = pipelines.build("pp", "1f1b", scaler, rank, world_size)
    optimizer = torch.optim.SGD(pipeline.parameters(), lr=0.01)
    steps = []
    for step in range(3):
        optimizer.zero_grad()
        pipeline.run(step, scaler)
        with count_collectives() as counts:
            scaler.unscale_(optimizer)
            norm = scaler.clip_grad_norm_(pipeline.parameters(), 1e-3, replica_group=1)
            scaler.step(optimizer)
            scaler.update()
        steps.append({"collectives": dict(counts), "norm": norm.item()})
    return steps


def test_pipeline_torch_order_issues_the_same_collectives_on_every_stage() -> None:
    first, last = run_ranks(_rank_torch_order_in_a_pipeline, 2, timeout_s=120)
    assert first == last  # same collectives, same norms
    # the first step agrees inside unscale_ (a stage that never scaled must), later ones not
    assert [sum(s["collectives"].values()) for s in first] == [2, 1, 1]
