"""Pipeline-parallel setups for rank functions: stages, meshes, schedules, and reference norms.

A four-block MLP is split into pipeline stages (``torch.distributed.pipelining``), each stage
optionally data-parallel (DDP, FSDP2) or tensor-parallel inside its own ranks. Only the last
stage computes a loss (through the scaler), as in real pipeline jobs; the other stages never call
``scaler.scale()``. Parameter names are the full model's (``blocks.2.0.weight``) on every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BLOCKS = 4
WIDTH = 16
MICROBATCHES = 4
BATCH = 8
SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs")
LAYOUTS = ("pp", "pp_ddp", "pp_fsdp2", "pp_tp")
"""pp: stages only; pp_ddp/pp_fsdp2/pp_tp: 2 stages, each over its own data/tensor-parallel
ranks (4 ranks: 2 x 2; ``pp_fsdp2`` also runs on 2 ranks as 2 x 1)."""


class Stage(nn.Module):
    """Some of the model's blocks, under their names in the full model."""

    def __init__(self, block_ids: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        every = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
        self.blocks = nn.ModuleDict({str(i): every[i] for i in block_ids})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


@dataclass
class Pipeline:
    """One rank's part of a pipeline job."""

    modules: list[nn.Module]
    """This rank's stage modules (two under the interleaved and looped schedules)."""
    schedule: Any
    first: bool
    """Whether this rank holds the first stage (it feeds the inputs)."""
    last: bool
    """Whether this rank holds the last stage (it computes the loss)."""
    stage_ranks: int
    """How many ranks hold each stage (its data- or tensor-parallel size)."""
    dp_rank: int
    """This rank's index among its stage's ranks."""
    dp_group: dist.ProcessGroup | None
    """The stage's data-parallel group (pp_ddp), for plain-tensor norms."""

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules for p in module.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [pair for module in self.modules for pair in module.named_parameters()]

    def run(self, step: int, scaler: Any) -> None:
        """One schedule step: forward and backward over every microbatch."""
        generator = torch.Generator().manual_seed(100 * step + self.dp_rank)
        inputs = torch.randn(BATCH, WIDTH, generator=generator)
        targets = torch.randn(BATCH, WIDTH, generator=generator)
        args = (inputs,) if self.first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)


def build(layout: str, schedule: str, scaler: Any, rank: int, world_size: int) -> Pipeline:
    """This rank's stages of ``layout`` under ``schedule``, losses scaled by ``scaler``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
    )

    multi = schedule in ("interleaved", "looped_bfs")
    if layout == "pp":
        stages_per_rank, stage_ranks = (2 if multi else 1), 1
        pp_size, pp_rank, pp_group = world_size, rank, None
    else:
        if multi:
            raise ValueError("the 2-D layouts run one stage per rank")
        stages_per_rank, stage_ranks = 1, world_size // 2
        names = ("pp", "tp" if layout == "pp_tp" else "dp")
        mesh = init_device_mesh("cpu", (2, stage_ranks), mesh_dim_names=names)
        pp_size, pp_rank = 2, mesh.get_local_rank("pp")
        pp_group = mesh.get_group("pp")
        inner_mesh = mesh[names[1]]
    n_stages = pp_size * stages_per_rank
    stage_ids = [pp_rank + k * pp_size for k in range(stages_per_rank)]
    per_stage = BLOCKS // n_stages
    modules: list[nn.Module] = []
    stages = []
    dp_group = None
    for stage_id in stage_ids:
        module: nn.Module = Stage(list(range(stage_id * per_stage, (stage_id + 1) * per_stage)))
        if layout == "pp_ddp":
            dp_group = inner_mesh.get_group()
            module = nn.parallel.DistributedDataParallel(module, process_group=dp_group)
        elif layout == "pp_fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=inner_mesh)
        elif layout == "pp_tp":
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            plan: dict[str, Any] = {}
            for k, block_id in enumerate(sorted(module.blocks, key=int)):  # type: ignore[arg-type]
                style = ColwiseParallel() if k % 2 == 0 else RowwiseParallel()
                plan[f"blocks.{block_id}.0"] = style
            parallelize_module(module, inner_mesh, plan)
        modules.append(module)
        stages.append(
            PipelineStage(module, stage_id, n_stages, torch.device("cpu"), group=pp_group)
        )

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scaler.scale(nn.functional.mse_loss(output, target))

    kinds = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved": ScheduleInterleaved1F1B,
        "looped_bfs": ScheduleLoopedBFS,
    }
    arg = stages if multi else stages[0]
    built = kinds[schedule](arg, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    return Pipeline(
        modules=modules,
        schedule=built,
        first=0 in stage_ids,
        last=n_stages - 1 in stage_ids,
        stage_ranks=stage_ranks,
        dp_rank=rank % stage_ranks if layout != "pp" else 0,
        dp_group=dp_group,
    )


def global_norm(pipeline: Pipeline, scale: float, norm_type: float = 2.0) -> float:
    """The norm of every stage's full, unscaled gradients, computed without the scaler.

    Each rank gathers its stage's full gradients (DTensor ``full_tensor()``; DDP replicas are
    equal), and the stages' p-th powers add up over the world, each stage counted once.
    """
    power = torch.zeros((), dtype=torch.float64)
    for param in pipeline.parameters():
        grad = param.grad
        if grad is None:
            continue
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(full.double() / scale, norm_type)
        power = torch.maximum(power, norm) if norm_type == float("inf") else power + norm**norm_type
    if norm_type == float("inf"):
        dist.all_reduce(power, op=dist.ReduceOp.MAX)
        return power.item()
    power /= pipeline.stage_ranks
    dist.all_reduce(power)
    return power.item() ** (1.0 / norm_type)
