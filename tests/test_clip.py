"""clip_grad_norm_: a global norm over shards, replicas counted once, in the step's collective."""

from __future__ import annotations

import math
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardscale import ShardedGradScaler, count_collectives
from tests.harness import run_ranks
from tests.setups import build, mlp, plant

CLIP_KINDS = ("plain", "ddp", "fsdp1", "fsdp1_orig", "fsdp2", "hsdp_replicated", "tp")
SCALE = 2.0**10


def _build(kind: str, flavour: str, world_size: int) -> Any:
    if kind != "hsdp_replicated":
        return build(kind, flavour, world_size)
    # HSDP with every rank a replica (mesh replicate=world_size, shard=1): a norm that summed
    # the shards of every rank would count each gradient world_size times.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    setup = build("plain", flavour, world_size)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(setup.model, mesh=mesh)
    options = {
        "for-loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }
    setup.optimizer = torch.optim.AdamW(setup.model.parameters(), lr=0.05, **options[flavour])
    setup.kind = "hsdp"
    return setup


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    """Every original parameter's whole gradient, gathered from the shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        if any(getattr(p, "_is_flat_param", False) for p in model.parameters()):
            # summon_full_params cannot bring flat gradients: gather the shards (zero padding
            # changes no norm)
            return [_gathered(p.grad) for p in model.parameters() if p.grad is not None]
        with FSDP.summon_full_params(model, with_grads=True):
            return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    grads = []
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads.append(grad.detach().clone())
    return grads


def _gathered(shard: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard.contiguous())
    return torch.cat(parts)


def _warm_up(scaler: ShardedGradScaler, setup: Any, rank: int) -> None:
    """One clean iteration of scale, clip and step: an optimizer's first step after a clip
    agrees at a collective of its own (none stepped before is known to the clip); the next
    ones cost the clip's one collective."""
    scaler.scale(setup.loss(0, rank)).backward()
    scaler.clip_grad_norm_(setup.model.parameters(), 1.0)
    scaler.step(setup.optimizer)
    scaler.update()
    setup.optimizer.zero_grad()


def _rank_clip(
    rank: int, world_size: int, kind: str, flavour: str, max_norm: float, norm_type: float
) -> dict[str, Any]:
    setup = _build(kind, flavour, world_size)
    scaler = ShardedGradScaler(init_scale=SCALE)
    _warm_up(scaler, setup, rank)  # the optimizer's first step after a clip agrees again
    scaler.scale(setup.loss(1, rank)).backward()
    expected = torch.linalg.vector_norm(
        torch.stack(
            [
                torch.linalg.vector_norm(g.float() / SCALE, norm_type)
                for g in _full_grads(setup.model)
            ]
        ),
        norm_type,
    ).item()
    with count_collectives() as counts:
        norm = scaler.clip_grad_norm_(setup.model.parameters(), max_norm, norm_type)
        scaler.step(setup.optimizer)
        scaler.update()
    return {
        "norm": norm.item(),
        "expected": expected,
        "collectives": sum(counts.values()),
        "skipped": scaler.last_step_skipped,
    }


def _rank_clipped_grads(rank: int, world_size: int, kind: str, max_norm: float) -> dict[str, Any]:
    """After the clip, the full gradient equals the unscaled one times max_norm / norm."""
    setup = _build(kind, "for-loop", world_size)
    scaler = ShardedGradScaler(init_scale=SCALE)
    scaler.scale(setup.loss(0, rank)).backward()
    before = [g / SCALE for g in _full_grads(setup.model)]
    norm = scaler.clip_grad_norm_(setup.model.parameters(), max_norm).item()
    after = _full_grads(setup.model)
    factor = min(1.0, max_norm / (norm + 1e-6))
    return {
        "factor": factor,
        "max_error": max(
            (a - b * factor).abs().max().item() for a, b in zip(after, before, strict=True)
        ),
    }


@pytest.mark.parametrize("kind", CLIP_KINDS)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_norm_is_global_over_shards_and_costs_one_collective(
    kind: str, norm_type: float
) -> None:
    results = run_ranks(_rank_clip, 2, kind, "foreach", 1e-3, norm_type)
    for result in results:
        assert result["norm"] == pytest.approx(result["expected"], rel=1e-5)
        assert result["collectives"] == 1
        assert not result["skipped"]
    assert results[0]["norm"] == results[1]["norm"]  # bit-identical on every rank


@pytest.mark.parametrize("kind", ["ddp", "fsdp1", "fsdp2", "hsdp_replicated"])
def test_clip_scales_every_shard_by_the_global_factor(kind: str) -> None:
    for result in run_ranks(_rank_clipped_grads, 2, kind, 1e-3):
        assert result["factor"] < 1.0  # it did clip
        assert result["max_error"] < 1e-7


@pytest.mark.parametrize("flavour", ["for-loop", "fused"])
def test_clip_world_of_one_matches_torch(flavour: str, world_of_one: Any) -> None:
    ours, theirs = build("plain", flavour, 1), build("plain", flavour, 1)
    scaler = ShardedGradScaler(init_scale=SCALE)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for step in range(3):
        for setup, s in ((ours, scaler), (theirs, torch_scaler)):
            setup.optimizer.zero_grad()
            s.scale(setup.loss(step, 0)).backward()
        with count_collectives() as counts:
            norm = scaler.clip_grad_norm_(ours.model.parameters(), 0.01)
            scaler.step(ours.optimizer)
            scaler.update()
        torch_scaler.unscale_(theirs.optimizer)
        torch_norm = torch.nn.utils.clip_grad_norm_(theirs.model.parameters(), 0.01)
        torch_scaler.step(theirs.optimizer)
        torch_scaler.update()
        assert norm.item() == pytest.approx(torch_norm.item(), rel=1e-6)
        assert sum(counts.values()) == 0  # world size 1: no collective
    for a, b in zip(ours.model.parameters(), theirs.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_clip_multiplies_in_float32_on_the_cpu(dtype: torch.dtype, world_of_one: Any) -> None:
    """The clip's one multiply (by 1/scale times the clip coefficient) is taken in float32 and
    rounded once to the gradient's dtype, whichever kernel runs it: a factor rounded to fp16
    first would be far off (here about 4.6e-8, where fp16's subnormals step by 6e-8)."""
    torch.manual_seed(0)
    scaled = (torch.randn(3, 1000) * 4.0).to(dtype)
    params = [nn.Parameter(torch.zeros(1000, dtype=dtype)) for _ in range(3)]
    for param, grad in zip(params, scaled, strict=True):
        param.grad = grad.clone()
    scaler = ShardedGradScaler(init_scale=2.0**16)
    scaler.scale(torch.ones(()))
    norm = scaler.clip_grad_norm_(params, 1e-5)
    coef = torch.tensor(1e-5) / (norm + 1e-6)
    factor = torch.fmin(coef, torch.ones(())) * torch.tensor(2.0**-16)
    assert factor.item() < 2.0**-14  # it did clip, to a factor below fp16's smallest normal
    for param, grad in zip(params, scaled, strict=True):
        assert torch.equal(cast(torch.Tensor, param.grad), (grad.float() * factor).to(dtype))


def _rank_clip_overflow(rank: int, world_size: int, kind: str, flavour: str) -> dict[str, Any]:
    setup = build(kind, flavour, world_size)
    scaler = ShardedGradScaler(init_scale=SCALE)
    _warm_up(scaler, setup, rank)
    scaler.scale(setup.loss(1, rank)).backward()
    if rank == 1:
        plant(setup.optimizer, math.nan)
    before = [p.detach().clone() for p in setup.model.parameters()]
    with count_collectives() as counts:
        norm = scaler.clip_grad_norm_(setup.model.parameters(), 1.0)
        scaler.step(setup.optimizer)
        scaler.update()
    unchanged = all(
        torch.equal(a, b.detach()) for a, b in zip(before, setup.model.parameters(), strict=True)
    )
    return {
        "finite": math.isfinite(norm.item()),
        "skipped": scaler.last_step_skipped,
        "unchanged": unchanged,
        "scale": scaler.get_scale(),
        "collectives": sum(counts.values()),
    }


@pytest.mark.parametrize("kind", ["ddp", "fsdp1", "fsdp2"])
@pytest.mark.parametrize("flavour", ["for-loop", "fused"])
def test_clip_overflow_on_one_rank_is_nonfinite_and_skipped_everywhere(
    kind: str, flavour: str
) -> None:
    results = run_ranks(_rank_clip_overflow, 2, kind, flavour)
    expected = {
        "finite": False,
        "skipped": True,
        "unchanged": True,
        "scale": SCALE / 2,
        "collectives": 1,
    }
    assert results == [expected, expected]


def _rank_unscale_then_clip(rank: int, world_size: int, planted: bool) -> dict[str, Any]:
    """Two steps in torch's order: unscale_, clip, step, update; the second may overflow.

    The first step's unscale_ agrees at once (a scaler's first agreement is never deferred),
    so it costs 2; from then on unscale_ checks locally and its check rides in the clip's
    collective, so a step costs 1.
    """
    setup = build("fsdp2", "for-loop", world_size)
    scaler = ShardedGradScaler(init_scale=SCALE)
    collectives = []
    for step in range(2):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, rank)).backward()
        if planted and step == 1 and rank == 1:
            plant(setup.optimizer, math.inf)
        expected = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g / SCALE) for g in _full_grads(setup.model)])
        ).item()
        with count_collectives() as counts:
            scaler.unscale_(setup.optimizer)
            norm = scaler.clip_grad_norm_(setup.model.parameters(), 1e-3)  # must not unscale again
            scaler.step(setup.optimizer)
            scaler.update()
        collectives.append(sum(counts.values()))
    return {
        "norm": norm.item(),
        "expected": expected,
        "collectives": collectives,
        "skipped": scaler.last_step_skipped,
        "scale": scaler.get_scale(),
    }


def test_clip_after_unscale_costs_one_collective_in_torchs_order() -> None:
    for result in run_ranks(_rank_unscale_then_clip, 2, False):
        assert result["norm"] == pytest.approx(result["expected"], rel=1e-5)
        assert result["collectives"] == [2, 1]
        assert not result["skipped"]


def test_clip_after_unscale_overflow_on_one_rank_skips_everywhere() -> None:
    for result in run_ranks(_rank_unscale_then_clip, 2, True):
        assert not math.isfinite(result["norm"])
        assert result["skipped"]
        assert result["scale"] == SCALE / 2
        assert result["collectives"] == [2, 1]


def _rank_unscale_then_update(rank: int, world_size: int) -> dict[str, Any]:
    """unscale_() without step(): update() agrees on unscale_'s check and backs off."""
    setup = build("ddp", "foreach", world_size)
    scaler = ShardedGradScaler(init_scale=SCALE)
    scaler.scale(setup.loss(0, rank)).backward()
    if rank == 0:
        plant(setup.optimizer, math.nan)
    with count_collectives() as counts:
        scaler.unscale_(setup.optimizer)
        scaler.update()
    return {"scale": scaler.get_scale(), "collectives": sum(counts.values())}


def test_unscale_without_step_is_agreed_at_update() -> None:
    assert run_ranks(_rank_unscale_then_update, 2) == [{"scale": SCALE / 2, "collectives": 1}] * 2


def _clip_setup() -> tuple[ShardedGradScaler, nn.Module, torch.optim.Optimizer]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=SCALE)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    return scaler, model, optimizer


def test_clip_twice_raises() -> None:
    scaler, model, _ = _clip_setup()
    scaler.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) has already been called"):
        scaler.clip_grad_norm_(model.parameters(), 1.0)


def test_clip_part_of_an_optimizers_params_then_step_unscales_the_rest_once() -> None:
    """An MoE model's dense part clipped, its experts not, one optimizer: the step keeps the
    clip's unscale for the part it clipped and unscales the rest itself, each exactly once."""
    scaler, model, optimizer = _clip_setup()
    scaled = [cast(torch.Tensor, p.grad).clone() for p in model.parameters()]
    clipped = list(model[0].parameters())
    scaler.clip_grad_norm_(clipped, 1e9)  # a norm never reached: unscaled only
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    for param, grad, old in zip(model.parameters(), scaled, before, strict=True):
        assert torch.equal(cast(torch.Tensor, param.grad), grad / SCALE)
        assert torch.equal(param.detach(), old.add(grad / SCALE, alpha=-0.1))  # stepped once


def test_clip_of_every_parameter_with_a_gradient_is_taken_by_step() -> None:
    """An optimizer that also holds a parameter the clip never saw, one without a gradient
    (frozen), still takes the clip's unscale: its gradients are divided by the scale once."""
    scaler, model, _ = _clip_setup()
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    scaled = [cast(torch.Tensor, p.grad).clone() for p in model.parameters()]
    scaler.clip_grad_norm_(model.parameters(), 1e9)  # a norm never reached: unscaled only
    scaler.step(optimizer)
    for param, grad in zip(model.parameters(), scaled, strict=True):
        assert torch.equal(cast(torch.Tensor, param.grad), grad / SCALE)


def test_clip_before_scale_raises() -> None:
    scaler = ShardedGradScaler()
    with pytest.raises(RuntimeError, match="Attempted clip_grad_norm_ but _scale is None"):
        scaler.clip_grad_norm_(mlp().parameters(), 1.0)


@pytest.mark.parametrize(
    ("max_norm", "norm_type", "error", "match"),
    [
        (0.0, 2.0, ValueError, r"max_norm must be a finite number > 0, got 0.0"),
        (math.inf, 2.0, ValueError, r"max_norm must be a finite number > 0, got inf"),
        (1.0, -1.0, ValueError, r"norm_type must be > 0 \(or math.inf\), got -1.0"),
        ("1", 2.0, TypeError, r"max_norm must be a number, got str"),
    ],
)
def test_clip_bad_arguments_raise(
    max_norm: Any, norm_type: Any, error: type[Exception], match: str
) -> None:
    scaler, model, _ = _clip_setup()
    with pytest.raises(error, match=match):
        scaler.clip_grad_norm_(model.parameters(), max_norm, norm_type)


def test_clip_disabled_scaler_clips_like_torch() -> None:
    model, reference = mlp(), mlp()
    for m in (model, reference):
        m(torch.ones(2, 16)).sum().backward()
    norm = ShardedGradScaler(enabled=False).clip_grad_norm_(model.parameters(), 0.1)
    torch_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    assert norm.item() == pytest.approx(torch_norm.item(), rel=1e-6)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def _rank_clip_fsdp2_tp(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 x TP on a (dp=2, tp=2) mesh: 2-D DTensor gradients, some replicated over tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = mlp()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    scaler = ShardedGradScaler(init_scale=SCALE)
    # tensor-parallel ranks share their inputs; data-parallel ranks differ
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))
    scaler.scale(model(inputs).pow(2).mean()).backward()
    return _norm_against_full_grads(scaler, list(model.parameters()))


def _norm_against_full_grads(
    scaler: ShardedGradScaler, params: list[torch.Tensor]
) -> dict[str, Any]:
    """Our clip norm, and the norm of the gathered full gradients."""
    power = torch.zeros((), dtype=torch.float64)
    for param in params:
        grad = param.grad
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        power += torch.linalg.vector_norm(full.double() / SCALE) ** 2
    with count_collectives() as counts:
        norm = scaler.clip_grad_norm_(params, 1e-3)
    return {"norm": norm.item(), "expected": math.sqrt(power.item()), "collectives": counts}


def test_clip_fsdp2_tp_norm_is_global() -> None:
    for result in run_ranks(_rank_clip_fsdp2_tp, 4, timeout_s=180):
        assert result["norm"] == pytest.approx(result["expected"], rel=1e-5)
        assert result["collectives"] == {"c10d::allreduce_": 1}


def _rank_clip_experts(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    """Expert-parallel weights: ``Shard(0)`` over the ep dimension of a (dp=2, ep=2) mesh.

    ``replicated``: the experts are a DTensor on the whole mesh, replicated over dp (each
    expert shard on two ranks: counted once). ``disjoint``: each dp row holds its OWN experts,
    a DTensor on its row's ep sub-mesh (like two pipeline stages: their norms add up). A plain
    dense layer, identical on every rank, sits in front.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    row = mesh.get_local_rank("dp")
    torch.manual_seed(0 if layout == "replicated" else 1 + row)
    experts_full = torch.randn(4, 8, 8)
    if layout == "replicated":
        experts = nn.Parameter(distribute_tensor(experts_full, mesh, [Replicate(), Shard(0)]))
    else:
        experts = nn.Parameter(distribute_tensor(experts_full, mesh["ep"], [Shard(0)]))
    torch.manual_seed(1234)
    dense = nn.Linear(8, 8)
    scaler = ShardedGradScaler(init_scale=SCALE)
    hidden = dense(torch.randn(2, 8, generator=torch.Generator().manual_seed(7)))
    output = torch.einsum("bi,eij->bj", hidden, experts.to_local())
    scaler.scale(output.pow(2).mean()).backward()
    for param in dense.parameters():  # data parallelism's job: the dense replicas agree
        dist.all_reduce(param.grad)  # type: ignore[arg-type]
    expert_power = torch.linalg.vector_norm(experts.grad.full_tensor().double() / SCALE) ** 2
    if layout == "disjoint":  # each row's own experts: sum the rows (2 ranks per row)
        expert_power = expert_power / 2
        dist.all_reduce(expert_power)
    dense_power = sum(
        torch.linalg.vector_norm(p.grad.double() / SCALE) ** 2 for p in dense.parameters()
    )
    with count_collectives() as counts:
        norm = scaler.clip_grad_norm_([experts, *dense.parameters()], 1e-3)
    return {
        "norm": norm.item(),
        "expected": math.sqrt((expert_power + dense_power).item()),
        "collectives": counts,
    }


@pytest.mark.parametrize("layout", ["replicated", "disjoint"])
def test_clip_expert_shards_on_a_sub_mesh_sum_and_replicas_count_once(layout: str) -> None:
    for result in run_ranks(_rank_clip_experts, 4, layout, timeout_s=180):
        assert result["norm"] == pytest.approx(result["expected"], rel=1e-5)
        assert result["collectives"] == {"c10d::allreduce_": 1}
