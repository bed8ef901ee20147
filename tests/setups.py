"""Training setups for every kind of sharded gradient and every optimizer flavour.

Used inside rank functions (an initialised gloo group is assumed). Each setup is a small MLP
wrapped the way real jobs wrap it, and an optimizer of the asked flavour.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardscale import ShardedGradScaler

KINDS = (
    "plain",  # every rank holds the whole model, nothing wraps it
    "ddp",
    "fsdp1",  # flat parameters, use_orig_params=False
    "fsdp1_orig",  # use_orig_params=True: views into the flat shard, some empty
    "fsdp2",  # fully_shard: DTensor Shard(0) gradients
    "fsdp2_mixed_dtype",  # fully_shard groups of fp32 and fp16 parameters
    "hsdp",  # fully_shard on a 2-D mesh: DTensor (Replicate, Shard(0)) gradients
    "tp",  # tensor parallel: Shard(0), Shard(1) and Replicate gradients mixed
    "sparse",  # nn.Embedding(sparse=True): sparse COO gradients
    "mixed_dtype",  # fp16 and fp32 gradients side by side
)
GPU_KINDS = ("fsdp1_offload",)  # CPUOffload(offload_params=True): torch needs an accelerator
FLAVOURS = ("for-loop", "foreach", "fused")
REPLICATED_KINDS = ("plain", "ddp", "sparse", "mixed_dtype")
"""Kinds where every rank holds every parameter in full: their checksums must match."""


@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    kind: str

    def loss(self, step: int, rank: int, same_data: bool = False) -> torch.Tensor:
        """A deterministic loss for this step.

        Each rank gets its own data, except where nothing synchronises the replicas' gradients
        (the unwrapped kinds) or ``same_data`` asks for it.
        """
        same_data = same_data or (self.kind in REPLICATED_KINDS and self.kind != "ddp")
        generator = torch.Generator().manual_seed(1000 * step + (0 if same_data else rank))
        if self.kind == "sparse":
            indices = torch.randint(0, 20, (6,), generator=generator)
            return self.model(indices).pow(2).mean()
        inputs = torch.randn(4, 16, generator=generator)
        return self.model(inputs).float().pow(2).mean()


class _SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 16, sparse=True)
        self.head = nn.Linear(16, 8)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(indices))


class _MixedDtypeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8).half()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(inputs)).half())


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def scaled_backward(scaler: ShardedGradScaler) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process: an `mlp`, SGD and one scaled backward, ready for unscale_/step."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    return model, optimizer


def overflow_steps(scaler: ShardedGradScaler, pattern: list[bool]) -> list[float]:
    """One process: a step per entry of ``pattern``, an inf planted where True; the scales."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = []
    for overflow in pattern:
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).mean()).backward()
        if overflow:
            model[0].weight.grad[0, 0] = math.inf
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _wrap(kind: str, world_size: int) -> nn.Module:
    if kind == "sparse":
        torch.manual_seed(0)
        return _SparseModel()
    if kind == "mixed_dtype":
        torch.manual_seed(0)
        return _MixedDtypeModel()
    model = mlp()
    if kind == "plain":
        return model
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import CPUOffload
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(
            model,
            device_id=torch.device("cuda" if kind == "fsdp1_offload" else "cpu"),
            use_orig_params=kind == "fsdp1_orig",
            cpu_offload=CPUOffload(offload_params=kind == "fsdp1_offload"),
        )
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "fsdp2_mixed_dtype":
        model[2].half()
        model.register_forward_hook(lambda module, args, output: output.float())
        model[2].register_forward_pre_hook(lambda module, args: (args[0].half(),))
    if kind.startswith("fsdp2") or kind == "hsdp":
        from torch.distributed.fsdp import fully_shard

        shape, names = (
            ((1, world_size), ("replicate", "shard"))
            if kind == "hsdp"
            else (
                (world_size,),
                ("shard",),
            )
        )
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if kind == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world_size,))
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def build(kind: str, flavour: str, world_size: int, lr: float = 0.05) -> Setup:
    """The model of ``kind`` and an optimizer of ``flavour``.

    AdamW; SGD with momentum for sparse gradients. Where parameters are fp16, AdamW's eps is
    1e-4: the default 1e-8 underflows to 0 in fp16 and the for-loop update divides 0 by 0, a
    known misuse that NaNs without any scaler.
    """
    model = _wrap(kind, world_size)
    options: dict[str, Any] = {
        "for-loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }[flavour]
    optimizer: torch.optim.Optimizer
    if kind == "sparse":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, **options)
    else:
        eps = 1e-4 if "mixed_dtype" in kind else 1e-8
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, **options)
    return Setup(model=model, optimizer=optimizer, kind=kind)


def step_and_report(scaler: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Run step+update; report whether it skipped, the new scale and the collectives it cost."""
    from shardscale import count_collectives

    with count_collectives() as counts:
        scaler.step(optimizer)
        scaler.update()
    return {
        "skipped": scaler.last_step_skipped,
        "scale": scaler.get_scale(),
        "collectives": sum(counts.values()),
    }


def local_grad_values(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient elements this rank holds for ``param``, writable in place (None if none).

    Not :func:`shardscale._grads.local_grad`: that coalesces an uncoalesced sparse gradient
    into a copy, and a value planted in a copy would never reach the scaler.
    """
    grad = param.grad
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        grad = grad.to_local()
    if grad.is_sparse:
        grad = grad._values()
    return grad if grad.numel() > 0 else None


@torch.no_grad()
def plant(optimizer: torch.optim.Optimizer, value: float, *, last: bool = False) -> None:
    """Write ``value`` into one element of this rank's local gradient shard."""
    plant_in([p for group in optimizer.param_groups for p in group["params"]], value, last=last)


@torch.no_grad()
def plant_in(params: Iterable[torch.Tensor], value: float, *, last: bool = False) -> None:
    """Write ``value`` into one element of the first (``last``: the last) of ``params`` whose
    gradient has an element on this rank."""
    params = list(params)
    for param in reversed(params) if last else params:
        values = local_grad_values(param)
        if values is not None:
            values.view(-1)[0] = value
            return
    raise AssertionError("this rank holds no gradient element to plant a value in")


def local_checksum(model: nn.Module) -> str:
    """A digest of the parameter bytes this rank holds."""
    digest = hashlib.sha256()
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(bytes(local.detach().contiguous().view(torch.uint8).reshape(-1).tolist()))
    return digest.hexdigest()


def full_params(model: nn.Module) -> list[list[float]]:
    """Every original parameter in full (gathered from shards where needed), as lists."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return [p.detach().reshape(-1).tolist() for p in model.parameters()]
    full = []
    for param in model.parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        full.append(value.detach().float().reshape(-1).tolist())
    return full
