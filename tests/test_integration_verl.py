"""verl's real FSDP engine (FSDP2 and FSDP1) with shardscale, on 2 gloo ranks.

The engine is built the way verl builds it (``FSDPEngineWithLMHead`` from its configs, a tiny
randomly initialised Qwen2), on CPU through ``launch/demos/verl_engine.py``'s CPU platform; the
steps are verl's own ``forward_backward_batch`` and ``optimizer_step``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("frameworks")]

DEMOS = str(Path(__file__).resolve().parent.parent / "launch" / "demos")


def _run_steps(engine: Any, verl_engine: Any) -> list[dict[str, Any]]:
    """A clean step, a step where rank 1 alone overflows, a clean step: verl's own calls."""
    import torch.distributed as dist

    from shardscale import count_collectives

    steps = []
    with engine.train_mode():
        for step, planted in ((0, False), (1, True), (2, False)):
            verl_engine.forward_backward(engine, step)
            if planted and dist.get_rank() == 1:
                verl_engine.plant(engine, math.inf)
            before = verl_engine.local_params(engine)
            with count_collectives() as counts:
                grad_norm = engine.optimizer_step()
            after = verl_engine.local_params(engine)
            steps.append(
                {
                    "moved": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                    "skipped": engine.scaler.last_step_skipped,
                    "scale": engine.scaler.get_scale(),
                    "finite_norm": math.isfinite(grad_norm),
                    "collectives": sum(counts.values()),
                }
            )
    return steps


def _rank_verl(
    rank: int, world_size: int, strategy: str, folder: str, how: str, fold_clip: bool
) -> dict[str, Any]:
    sys.path.insert(0, DEMOS)
    import verl_engine

    verl_engine.prepare_verl_on_cpu()
    from shardscale import ShardedGradScaler
    from shardscale.integrations.verl import install, use_shardscale

    model = verl_engine.tiny_model(folder)
    results: dict[str, Any] = {}
    for fused in (True, False):
        if how == "install":
            install()
            engine = verl_engine.build_engine(model, strategy, fused)
            assert isinstance(engine.scaler, ShardedGradScaler)  # verl built ours
            engine.scaler.load_state_dict({**engine.scaler.state_dict(), "scale": 1024.0})
        else:
            engine = verl_engine.build_engine(model, strategy, fused)
            use_shardscale(engine, init_scale=1024.0, fold_clip=fold_clip)
        steps = _run_steps(engine, verl_engine)
        checkpoint = str(Path(folder) / f"checkpoint_{strategy}_{fused}")
        engine.save_checkpoint(checkpoint, global_step=3)
        saved = engine.scaler.state_dict()
        resumed = verl_engine.build_engine(model, strategy, fused)
        if how != "install":
            use_shardscale(resumed)
        resumed.load_checkpoint(checkpoint, del_local_after_load=False)
        results["fused" if fused else "for-loop"] = {
            "steps": steps,
            "restored": resumed.scaler.state_dict() == saved,
            "saved_skipped": saved["skipped_steps"],
        }
    return results


def _check(results: list[dict[str, Any]], collectives: int) -> None:
    assert results[0] == results[1]  # every rank: the same decisions, scales and counts
    for flavour in ("fused", "for-loop"):
        run = results[0][flavour]
        clean, overflow, after = run["steps"]
        assert (clean["moved"], clean["skipped"], clean["finite_norm"]) == (True, False, True)
        assert (overflow["moved"], overflow["skipped"], overflow["finite_norm"]) == (
            False,
            True,
            False,
        )
        assert overflow["scale"] == clean["scale"] / 2
        assert after["moved"]
        assert not after["skipped"]
        assert [s["collectives"] for s in run["steps"]] == [collectives] * 3
        assert run["restored"]  # the checkpoint carried the scaler's state, counters included
        assert run["saved_skipped"] == 1


def test_verl_fsdp2_engine_every_rank_skips_and_checkpoints_the_scaler(tmp_path: Path) -> None:
    """verl's clipping kept: the scaler's one all-reduce plus verl's FSDP2 clip's one."""
    results = run_ranks(_rank_verl, 2, "fsdp2", str(tmp_path), "use", False, timeout_s=600)
    _check(results, collectives=2)


def test_verl_fsdp2_fold_clip_costs_one_collective(tmp_path: Path) -> None:
    results = run_ranks(_rank_verl, 2, "fsdp2", str(tmp_path), "use", True, timeout_s=600)
    _check(results, collectives=1)


def test_verl_fsdp1_engine_installed_globally_skips_and_checkpoints(tmp_path: Path) -> None:
    """install(): verl builds shardscale's scaler itself (FSDP1: flat parameters; verl's
    FSDP1 clip is one all-reduce)."""
    results = run_ranks(_rank_verl, 2, "fsdp", str(tmp_path), "install", False, timeout_s=600)
    _check(results, collectives=2)


def _rank_verl_sequence(rank: int, world_size: int, fused: bool, both: bool) -> dict[str, Any]:
    """verl's FSDP2 step as plain torch calls: scale(loss).backward(); unscale_(opt);
    torch.nn.utils.clip_grad_norm_; step; update. torch's ShardedGradScaler crashes here with
    a fused Adam (after the kernel wrote NaN into a parameter) and costs two collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale import ShardedGradScaler, count_collectives
    from tests.setups import mlp, plant

    model = mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = ShardedGradScaler(init_scale=1024.0)
    outcomes = []
    for step in range(3):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        scaler.scale(model(inputs).pow(2).mean()).backward()
        if step == 1 and (rank == 1 or both):
            plant(optimizer, math.inf)
        before = [p.to_local().detach().clone() for p in model.parameters()]
        with count_collectives() as scaler_counts:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with count_collectives() as step_counts:
            scaler.step(optimizer)
            scaler.update()
        after = [p.to_local().detach() for p in model.parameters()]
        outcomes.append(
            {
                "moved": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                "nan_param": any(not bool(torch.isfinite(p).all()) for p in after),
                "finite_norm": math.isfinite(norm.full_tensor().item()),
                "scale": scaler.get_scale(),
                "scaler_collectives": sum(scaler_counts.values()) + sum(step_counts.values()),
            }
        )
    return {"steps": outcomes}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("both", [False, True])
def test_verl_sequence_fsdp2_every_rank_skips_without_nan_in_one_collective(
    fused: bool, both: bool
) -> None:
    results = run_ranks(_rank_verl_sequence, 2, fused, both)
    assert results[0] == results[1]
    clean, overflow, after = results[0]["steps"]
    assert clean["moved"]
    assert not overflow["moved"]  # skipped on every rank
    assert not overflow["finite_norm"]
    assert not any(s["nan_param"] for s in results[0]["steps"])
    assert overflow["scale"] == clean["scale"] / 2
    assert after["moved"]
    assert [s["scaler_collectives"] for s in results[0]["steps"]] == [1, 1, 1]
