"""Multi-rank behaviour beyond the kind x flavour matrix: equivalence, empty ranks, costs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardscale import ShardedGradScaler, count_collectives
from tests.harness import RankFailure, run_ranks
from tests.setups import build, full_params, mlp, plant, step_and_report

STEPS = 6
INF_STEP = 3


def _train(setup: Any, scaler: Any, rank: int, planted_rank: int | None) -> list[float]:
    scales = []
    for step in range(STEPS):
        setup.optimizer.zero_grad(set_to_none=True)
        scaler.scale(setup.loss(step, rank, same_data=True)).backward()
        if step == INF_STEP and planted_rank in (rank, -1):
            plant(setup.optimizer, math.inf)
        scaler.step(setup.optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _rank_matches_single_process(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "growth_interval": 2}
    sharded = build(kind, "for-loop", world_size)
    ours = _train(sharded, ShardedGradScaler(**kwargs), rank, planted_rank=1)
    reference = build("plain", "for-loop", world_size)
    # the single-process reference sees the inf wherever it was planted: plant it here too
    theirs = _train(reference, torch.amp.GradScaler("cpu", **kwargs), rank, planted_rank=-1)
    return {
        "ours": ours,
        "theirs": theirs,
        "params": full_params(sharded.model),
        "reference": full_params(reference.model),
    }


@pytest.mark.parametrize("kind", ["plain", "ddp", "fsdp1", "fsdp2"])
def test_clean_and_skipped_steps_match_single_process_torch(kind: str) -> None:
    for result in run_ranks(_rank_matches_single_process, 2, kind):
        assert result["ours"] == result["theirs"]
        exact = kind in ("plain", "ddp")  # sharded reductions sum in another order
        for ours, theirs in zip(result["params"], result["reference"], strict=True):
            if exact:
                assert ours == theirs
            else:
                assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


def _rank_without_gradients_joins(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 never runs backward; rank 0 overflows. Both must skip, and neither hang."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=8.0)
    loss = scaler.scale(model(torch.ones(2, 16)).sum())
    if rank == 0:
        loss.backward()
        plant(optimizer, math.inf)
    return step_and_report(scaler, optimizer)


def test_rank_without_gradients_still_joins_and_skips() -> None:
    results = run_ranks(_rank_without_gradients_joins, 2)
    assert results == [{"skipped": True, "scale": 4.0, "collectives": 1}] * 2


def _rank_with_empty_shards(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP1 use_orig_params: a 1-element parameter lives on rank 0 only; rank 1's view is empty."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Linear(1, 1, bias=False), device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(model(torch.ones(2, 1)).sum()).backward()
    (param,) = model.parameters()
    held = param.grad is not None and param.grad.numel() > 0
    if held:
        plant(optimizer, math.nan)
    scaler.step(optimizer)
    scaler.update()
    return {"held": held, "skipped": scaler.last_step_skipped, "scale": scaler.get_scale()}


def test_rank_with_empty_shard_joins_and_skips() -> None:
    results = run_ranks(_rank_with_empty_shards, 2)
    assert [r["held"] for r in results] == [True, False]
    assert all(r["skipped"] and r["scale"] == 4.0 for r in results)


def _rank_no_gradients_anywhere(rank: int, world_size: int) -> None:
    scaler = ShardedGradScaler()
    scaler.scale(torch.tensor(1.0))
    scaler.step(torch.optim.SGD(mlp().parameters(), lr=0.1))


def test_no_gradient_on_any_rank_raises_on_every_rank() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_rank_no_gradients_anywhere, 2, timeout_s=60)
    report = str(failure.value)
    assert report.count("none of its parameters has a gradient on any of the 2 rank(s)") == 2
    assert "never answered" not in report


def _rank_two_optimizers(rank: int, world_size: int) -> dict[str, Any]:
    model = mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.AdamW(model[2].parameters(), lr=0.1, fused=True)
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    if rank == 1:
        plant(second, math.inf)
    skipped = []
    with count_collectives() as counts:
        for optimizer in (first, second):
            scaler.step(optimizer)
            skipped.append(scaler.last_step_skipped)
        scaler.update()
    return {"skipped": skipped, "scale": scaler.get_scale(), "collectives": sum(counts.values())}


def test_two_optimizers_one_collective_each_and_agree() -> None:
    results = run_ranks(_rank_two_optimizers, 2)
    assert results == [{"skipped": [False, True], "scale": 4.0, "collectives": 2}] * 2


def _rank_three_way_collective_count(rank: int, world_size: int, scaler_name: str) -> int:
    setup = build("fsdp2_mixed_dtype", "for-loop", world_size)
    if scaler_name == "shardscale":
        scaler: Any = ShardedGradScaler(init_scale=1.0)
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

        scaler = TorchScaler("cpu", init_scale=1.0)
    scaler.scale(setup.loss(0, rank)).backward()
    with count_collectives() as counts:
        scaler.step(setup.optimizer)
        scaler.update()
    return sum(counts.values())


def test_fsdp2_two_dtypes_cost_one_collective_where_torch_pays_more() -> None:
    assert run_ranks(_rank_three_way_collective_count, 2, "shardscale") == [1, 1]
    # torch's ShardedGradScaler: one reduction per dtype group inside DTensor, plus its own
    torch_counts = run_ranks(_rank_three_way_collective_count, 2, "torch")
    assert min(torch_counts) > 1


def _rank_process_group_subset(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks {0, 1} and {2, 3} are separate replicas: each pair agrees only within itself."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=8.0, process_group=groups[rank // 2])
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    if rank == 1:
        plant(optimizer, math.inf)
    scaler.step(optimizer)
    scaler.update()
    return {"skipped": scaler.last_step_skipped, "scale": scaler.get_scale()}


def test_process_group_limits_agreement_to_its_ranks() -> None:
    results = run_ranks(_rank_process_group_subset, 4)
    assert [r["skipped"] for r in results] == [True, True, False, False]
    assert [r["scale"] for r in results] == [4.0, 4.0, 8.0, 8.0]
