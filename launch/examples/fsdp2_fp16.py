"""fp16 training with FSDP2 and shardscale, with checkpoints: a file to copy and adapt.

    torchrun --standalone --nproc-per-node 2 launch/examples/fsdp2_fp16.py --steps 50
    torchrun --standalone --nproc-per-node 2 launch/examples/fsdp2_fp16.py --steps 100

The second run resumes from the first's checkpoint (in --checkpoint-dir) at step 50. One GPU per
rank over NCCL where CUDA is available, else the CPU over gloo. A tiny causal transformer learns
synthetic sequences (each token is the previous one plus one): swap in your model and data.
torch.distributed.checkpoint needs numpy.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardscale import ShardedGradScaler, load_whole

VOCAB, DIM, HEADS, BLOCKS, SEQ, BATCH = 64, 64, 4, 3, 32, 8


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, HEADS, -1)).transpose(1, 3).unbind(2)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position, (batch * sequence, vocabulary)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(0, 1))


class Training(Stateful):
    """Model and optimizer state for torch.distributed.checkpoint: sharded, saved by every rank."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        if not self.optimizer.state:  # every step so far skipped (docs/checkpoints.md)
            self.optimizer.zero_grad(set_to_none=True)
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        model, optim = state["model"], state["optimizer"]
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optim)


def batch(step: int, rank: int, device: torch.device) -> torch.Tensor:
    """This rank's batch for ``step``: the same after a resume."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    return ((start + torch.arange(SEQ + 1)) % VOCAB).to(device)


def latest_checkpoint(folder: str) -> tuple[int, str | None]:
    """The newest complete checkpoint in ``folder`` (DCP writes .metadata last) and its step."""
    steps = [
        int(name.removeprefix("step_"))
        for name in (os.listdir(folder) if os.path.isdir(folder) else [])
        if name.startswith("step_") and os.path.exists(os.path.join(folder, name, ".metadata"))
    ]
    return (max(steps), os.path.join(folder, f"step_{max(steps):06d}")) if steps else (0, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--checkpoint-dir", default="checkpoints", help="save and resume here")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="and at the last step")
    parser.add_argument("--growth-interval", type=int, default=2000, help="clean steps to double")
    args = parser.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=device.type == "cuda")
    scaler = ShardedGradScaler(growth_interval=args.growth_interval)  # all ranks skip together

    state = {"training": Training(model, optimizer), "scaler": scaler}
    start, checkpoint = latest_checkpoint(args.checkpoint_dir)
    if checkpoint is not None:
        load_whole(state, checkpoint_id=checkpoint)  # all or nothing, naming what failed
        scaler.verify_agreement()  # every rank loaded the same scaler state
        if rank == 0:
            print(f"resumed from {checkpoint} at step {start}, scale {scaler.get_scale():g}")

    for step in range(start + 1, args.steps + 1):
        tokens = batch(step, rank, device)
        with torch.autocast(device.type, dtype=torch.float16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float(), tokens[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(model.parameters(), max_norm=1.0)  # the global norm
        scaler.step(optimizer)  # skipped on every rank if any rank's gradients overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)  # no gradients held between steps
        if rank == 0:  # the scale and the skip decision are the same on every rank
            note = ", skipped (inf/NaN gradients)" if scaler.last_step_skipped else ""
            print(f"step {step}: loss {loss.item():.4f}, scale {scaler.get_scale():g}{note}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            dcp.save(state, checkpoint_id=os.path.join(args.checkpoint_dir, f"step_{step:06d}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # then skip torch's C++ teardown, which may abort (docs/reliability.md)
    os._exit(0)
