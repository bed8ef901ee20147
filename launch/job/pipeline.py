"""Pipeline parallelism for the example job: the GPT split into stages, each maybe FSDP2-sharded.

``--parallel pp`` puts one stage on each rank; ``--parallel pp_fsdp2`` makes 2 stages, each
sharded with FSDP2 over its half of the ranks (2 x 2 on 4 ranks). ``torch.distributed.pipelining``
runs the microbatches (1F1B). Only the last stage computes the loss, through the scaler; the
other stages never call ``scaler.scale()``, and yet check, step and update with the rest in the
scaler's one collective, so every rank skips or steps together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from lm_model import GPT, GPTConfig, lm_loss

from shardscale import ShardedGradScaler

LAYOUTS = ("pp", "pp_fsdp2")


class Pipeline:
    """This rank's stage of the GPT, its schedule, and where it sits in the pipeline x DP grid."""

    def __init__(
        self,
        layout: str,
        config: GPTConfig,
        device: torch.device,
        scaler: ShardedGradScaler,
        microbatches: int,
        loss_divisor: float,
        autocast: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        world_size = dist.get_world_size()
        stages = world_size if layout == "pp" else 2
        if world_size < 2 or world_size % stages:
            raise SystemExit(
                f"--parallel {layout} needs a world size that is a multiple of {stages} (its "
                f"stages) and at least 2, got {world_size}"
            )
        if config.n_layers < stages:
            raise SystemExit(f"--layers must be >= {stages} (the stages), got {config.n_layers}")
        self.dp_size = world_size // stages
        mesh = init_device_mesh(device.type, (stages, self.dp_size), mesh_dim_names=("pp", "dp"))
        self.stage = mesh.get_local_rank("pp")
        self.stages = stages
        self.dp_rank = mesh.get_local_rank("dp")
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        model = GPT(config)  # every rank builds the whole model alike, then keeps its stage
        model.keep_stage(self.stage, stages)
        model.to(device)
        if layout == "pp_fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        self.module = model
        self.layout = layout
        self._scaler = scaler
        self._loss_divisor = loss_divisor
        self._autocast = autocast
        self._training = True
        self.inf_loss = False
        """Make this rank's loss inf (a forward overflow, injected by the job)."""
        self._losses: list[torch.Tensor] = []
        self._microbatches = microbatches
        stage = PipelineStage(model, self.stage, stages, device, group=mesh.get_group("pp"))
        self.schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=self._loss)
        # Plain stage parameters live on this stage's ranks only: the clip norm must know.
        self.replica_group: Any = 1 if layout == "pp" else None

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, targets)
        if self.inf_loss and self._training:
            loss = loss * math.inf
        self._losses.append(loss.detach())
        return self._scaler.scale(loss / self._loss_divisor) if self._training else loss

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One schedule step over every microbatch; the mean loss (a float64 scalar) on every
        rank of the pipeline."""
        return self._run(self.schedule.step, inputs, targets, training=True)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of a forward pass only (no scaling), on every rank."""
        return self._run(self.schedule.eval, inputs, targets, training=False)

    def _run(
        self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor, training: bool
    ) -> torch.Tensor:
        self._training, self._losses = training, []
        args = (inputs,) if self.first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": []} if self.last else {}
        with self._autocast():
            run(*args, **kwargs)
        # The last stage's ranks hold the losses: share their mean with every stage.
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        if self.last:
            # The last `microbatches` calls: on its first step a schedule also calls the loss
            # once on placeholder tensors, to infer the shapes backward will send.
            losses = self._losses[-self._microbatches :]
            total += torch.stack(losses).double().mean() / self.dp_size
        dist.all_reduce(total)
        return total
