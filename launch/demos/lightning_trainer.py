"""The Lightning Trainer in fp16 with shardscale's precision plugin, FSDP2 or DDP, resumable.

    torchrun --standalone --nproc-per-node 2 launch/demos/lightning_trainer.py --inject-inf-at 3

``plugins=TrainerPrecision(...)`` (``shardscale.integrations.lightning``), with
``gradient_clip_val``: after each backward the gradients are unscaled, ``on_before_optimizer_step``
sees them unscaled, the Trainer's clipping takes the global norm, and the step is skipped on every
rank if any overflowed, in one collective. The module holds its LR schedule on skipped steps
(``lr_scheduler_step``). ``--inject-inf-at K`` writes an inf into rank 1's local gradient at step
K; every rank prints one JSON line per step. ``--save PATH`` saves a checkpoint at the end;
``--resume PATH`` continues from one.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import lightning as L
import torch
from _common import leave, local_shard, plant
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from shardscale import count_collectives
from shardscale.integrations.lightning import TrainerPrecision


class CountingPrecision(TrainerPrecision):
    """TrainerPrecision, counting the collectives from the end of backward to the step's end."""

    last_collectives = 0

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        counter: dict[str, Any] = {}

        def counted_closure() -> Any:
            result = closure()
            counter["context"] = count_collectives()
            counter["counts"] = counter["context"].__enter__()
            return result

        output = super().optimizer_step(optimizer, model, counted_closure, **kwargs)
        counter["context"].__exit__(None, None, None)
        self.last_collectives = sum(counter["counts"].values())
        return output


class Module(L.LightningModule):
    def __init__(self, inject_at: int, sharded: bool) -> None:
        super().__init__()
        self.inject_at, self.sharded = inject_at, sharded
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.seen: dict[str, Any] = {}
        self.net[0].register_forward_hook(
            lambda module, args, output: self.seen.update(dtype=str(output.dtype))
        )

    def configure_model(self) -> None:
        if not self.sharded:
            return
        data_parallel = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=data_parallel)
        fully_shard(self.net, mesh=data_parallel)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (inputs,) = batch
        return self.net(inputs).float().pow(2).mean()

    def on_after_backward(self) -> None:
        if self.global_step + 1 == self.inject_at and self.global_rank == 1:
            plant(self.net[0].parameters())  # in rank 1's shard alone

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        local = local_shard(self.net[2].weight.grad)
        self.seen["grad_absmax"] = float(local.abs().max())

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if not self.trainer.precision_plugin.scaler.last_step_skipped:
            scheduler.step()  # the Trainer would step it after skipped steps too

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        plugin = self.trainer.precision_plugin
        print(
            json.dumps(
                {
                    "rank": self.global_rank,
                    "step": self.global_step,
                    "compute_dtype": self.seen["dtype"],
                    "skipped": plugin.scaler.last_step_skipped,
                    "scale": plugin.scaler.get_scale(),
                    "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
                    "grad_absmax_in_hook": self.seen["grad_absmax"],
                    "collectives": plugin.last_collectives,
                }
            ),
            flush=True,
        )

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("fsdp2", "ddp"), default="fsdp2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--inject-inf-at", type=int, default=0, help="0: never")
    parser.add_argument("--save", help="save a checkpoint here at the end")
    parser.add_argument("--resume", help="resume from this checkpoint")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    strategy: Any = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if args.strategy == "fsdp2"
        else DDPStrategy()
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=strategy,
        plugins=[CountingPrecision(args.accelerator, init_scale=2.0**10)],
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    module = Module(args.inject_inf_at, sharded=args.strategy == "fsdp2")
    data = DataLoader(TensorDataset(torch.randn(8 * (args.steps + 2), 16)), batch_size=4)
    trainer.fit(module, data, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    state = trainer.precision_plugin.scaler.state_dict()
    print(json.dumps({"rank": trainer.global_rank, "final": state}), flush=True)


if __name__ == "__main__":
    main()
    leave()  # past torch's C++ teardown, which may abort at exit (_common.py)
