"""verl's real FSDP engine (FSDP2 and FSDP1) with shardscale, on 2 gloo ranks.

The engine is built the way verl builds it (``FSDPEngineWithLMHead`` from its configs, a tiny
randomly initialised Qwen2), on CPU through ``launch/demos/verl_engine.py``'s CPU platform; the
steps are verl's own ``forward_backward_batch`` and ``optimizer_step``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("frameworks")]

DEMOS = str(Path(__file__).resolve().parent.parent / "launch" / "demos")
# The engine tests and the Megatron tests import verl in their processes: without it they skip
# (`-k megatron` on an install without the verl extra); the sequence tests need torch alone.
needs_verl = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None, reason="needs shardscale[verl]"
)


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


def _check(results: list[dict[str, Any]], collectives: list[int]) -> None:
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
        assert [s["collectives"] for s in run["steps"]] == collectives
        assert run["restored"]  # the checkpoint carried the scaler's state, counters included
        assert run["saved_skipped"] == 1


@needs_verl
def test_verl_fsdp2_engine_every_rank_skips_and_checkpoints_the_scaler(tmp_path: Path) -> None:
    """verl's clipping kept: the scaler's one all-reduce plus verl's FSDP2 clip's one."""
    results = run_ranks(_rank_verl, 2, "fsdp2", str(tmp_path), "use", False, timeout_s=600)
    _check(results, collectives=[2, 2, 2])


@needs_verl
def test_verl_fsdp2_fold_clip_one_collective_a_step_after_the_first(tmp_path: Path) -> None:
    results = run_ranks(_rank_verl, 2, "fsdp2", str(tmp_path), "use", True, timeout_s=600)
    # the optimizer's first step after the clip checks the rest at a collective of its own (the
    # clip could not know its parameters); after, the clip's one a step
    _check(results, collectives=[2, 1, 1])


@needs_verl
def test_verl_fsdp1_engine_installed_globally_skips_and_checkpoints(tmp_path: Path) -> None:
    """install(): verl builds shardscale's scaler itself (FSDP1: flat parameters; verl's
    FSDP1 clip is one all-reduce)."""
    results = run_ranks(_rank_verl, 2, "fsdp", str(tmp_path), "install", False, timeout_s=600)
    _check(results, collectives=[2, 2, 2])


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


# verl's Megatron engine on megatron-core's own optimizers (tests/megatron_setup.py: CPU
# tensors for Megatron's CUDA-only calls; its sources unpacked by tests/megatron_sources.py)


def _megatron(world: Any) -> Any:
    """megatron-core's modules, or a skip (a failure where the run requires them)."""
    import os

    from tests import megatron_setup, megatron_sources

    found = megatron_sources.folder()
    if found is None:
        if os.environ.get(megatron_sources.REQUIRE) == "1":
            pytest.fail(megatron_sources.missing_reason())
        pytest.skip(megatron_sources.missing_reason())
    return megatron_setup.import_megatron(str(found))


def _verl_fp16_optim_config(**override: Any) -> Any:
    from omegaconf import OmegaConf

    settings = {"optimizer": "adam", "lr": 0.1, "min_lr": 0.0, "clip_grad": 0.0}
    settings |= {"weight_decay": 0.0, "override_optimizer_config": override}
    return OmegaConf.create(settings)


def _engine_step(engine: Any, groups: Any, inputs: Any, value: float | None = None) -> Any:
    """verl's train_batch around Megatron's calls: zero, one scaled micro-batch (the DDP hook's
    accumulation), an optional planted value, verl's `optimizer_step`."""
    from tests import megatron_setup as setup

    setup.zero_grad(engine.optimizer, groups)
    setup.backward(engine.optimizer, groups, inputs)
    if value is not None:
        groups[-1].params[0].main_grad[0] = value
    return engine.optimizer_step()


@needs_verl
@pytest.mark.filterwarnings("ignore::UserWarning")  # Megatron's fallbacks (no TE, no apex)
def test_verl_megatron_fp16_precision_aware_skipped_step_returns_and_training_goes_on(
    world_of_one: Any,
) -> None:
    """verl's fp16 Megatron optimizer config turns the precision-aware optimizer on (its main
    gradients in `decoupled_grad`), and verl's `MegatronEngine.optimizer_step` raises on any
    skipped step. With `use_shardscale_megatron`, verl's own `optimizer_step` runs: a clean
    step returns Megatron's norm, an overflow returns `inf` with the weights untouched, and the
    next step trains. (The precision-aware sub-optimizers are tests/megatron_setup's stand-in:
    Transformer Engine's `FusedAdam` does not run on a CPU; verl's config is built with
    `optimizer_cpu_offload`, which skips Megatron's check that it is installed.)"""
    import torch

    from shardscale.integrations.verl import use_shardscale_megatron
    from tests import megatron_setup as setup

    mg = _megatron(world_of_one)
    from verl.utils.megatron.optimizer import init_megatron_optim_config
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    verl_config = init_megatron_optim_config(
        _verl_fp16_optim_config(optimizer_cpu_offload=True), fp16=True, bf16=False
    )
    assert verl_config.fp16
    assert verl_config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    inputs = [[torch.ones(3), torch.full((2,), 2.0)], [torch.full((4,), 3.0)]]
    with setup.cuda_on_cpu():
        results = {}
        for convert in (False, True):
            groups = [
                setup.group([3, 2], world_of_one, world_of_one, expert=False, seed=1),
                setup.group([4], world_of_one, world_of_one, expert=True, seed=2),
            ]
            engine = MegatronEngine.__new__(MegatronEngine)  # verl's class, its optimizer_step
            engine.optimizer, engine.module = setup.decoupled_optimizer(mg, groups), []
            if not convert:
                assert _engine_step(engine, groups, inputs) == pytest.approx(math.sqrt(47))
                with pytest.raises(NotImplementedError, match="step failed"):
                    _engine_step(engine, groups, inputs, math.inf)
                continue
            scaler = use_shardscale_megatron(engine, init_scale=1024.0)
            before = setup.main_params(engine.optimizer)
            norms = [_engine_step(engine, groups, inputs, v) for v in (None, math.inf)]
            skipped_weights = setup.main_params(engine.optimizer)
            norms.append(_engine_step(engine, groups, inputs))
            results = {"norms": norms, "skipped": scaler.stats.skipped_steps}
            results["moved"] = [
                [a - b for a, b in zip(old, new, strict=True)]
                for old, new in zip(before, skipped_weights, strict=True)
            ]
    true_norm = pytest.approx(math.sqrt(3 + 8 + 36))
    assert results["norms"] == [true_norm, math.inf, true_norm]
    assert results["skipped"] == 1
    assert results["moved"] == [[1.0] * 3 + [2.0] * 2, [3.0] * 4]  # step 1 only (SGD, lr 1)


@needs_verl
@pytest.mark.filterwarnings("ignore::UserWarning")  # Megatron's fallbacks (no TE, no apex)
def test_verl_install_converts_megatron_engines_optimizer_as_verl_builds_it(
    world_of_one: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`install()` patches verl's `MegatronEngine`: its own `_build_optimizer` (verl's config,
    megatron-core's `get_megatron_optimizer` over its DDP, verl's training hooks) returns the
    optimizer converted, with the model config's `grad_scale_func` the converted `scale_loss`;
    its `optimizer_step` returns `inf` on a skipped step. (verl's fp16 config without the
    precision-aware optimizer, through verl's own override: TE's Adam is not on a CPU.)"""
    import types

    import torch
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from shardscale.integrations import verl as integration
    from tests import megatron_setup as setup

    mg = _megatron(world_of_one)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.utils import get_model_config

    from shardscale.integrations.megatron import scaler_of

    for cls, names in (
        (MegatronEngine, ("_build_optimizer", "optimizer_step")),
        (FSDPEngine, ("_build_fsdp_module", "save_checkpoint", "load_checkpoint")),
    ):
        for name in names:
            monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the test
        monkeypatch.setattr(cls, integration._PATCHED, False, raising=False)
    integration.install()
    with setup.cuda_on_cpu():
        mg.parallel_state.initialize_model_parallel()
        try:
            config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
            config.fp16, config.params_dtype = True, torch.float16
            torch.manual_seed(0)
            layer = torch.nn.Linear(4, 2, bias=False).half()
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True
            )
            engine = MegatronEngine.__new__(MegatronEngine)
            engine.module = [DistributedDataParallel(config, ddp_config, layer)]
            engine.optimizer_config = _verl_fp16_optim_config(use_precision_aware_optimizer=False)
            engine.engine_config = types.SimpleNamespace(use_distributed_optimizer=True)
            engine.param_dtype = torch.float16
            engine.optimizer = engine._build_optimizer()
            scaler = scaler_of(engine.optimizer)
            scale_loss = get_model_config(engine.module[0]).grad_scale_func
            assert scale_loss == engine.optimizer.scale_loss
            norms = []
            for value in (None, math.inf, None):
                engine.module[0].zero_grad_buffer()
                engine.optimizer.zero_grad()
                scale_loss(layer(torch.ones(1, 4).half()).float().sum()).backward()
                if value is not None:
                    layer.weight.main_grad.view(-1)[0] = value
                norms.append(engine.optimizer_step())
        finally:
            mg.parallel_state.destroy_model_parallel()
    assert [math.isfinite(norm) for norm in norms] == [True, False, True]
    assert (scaler.stats.steps, scaler.stats.skipped_steps) == (3, 1)
