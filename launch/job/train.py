"""The example job: a small GPT-style language model trained in fp16 with shardscale.

    torchrun --standalone --nproc-per-node 2 launch/job/train.py            # 2 CPU ranks (gloo)
    bash launch/run.sh --steps 200 --plot runs/train.png                # the same, via the launcher

It trains on the standard library's docstrings (no download), under FSDP2 by default (or FSDP1,
DDP, pipeline stages ``pp``, pipeline stages sharded with FSDP2 ``pp_fsdp2``, or one process),
in fp16 with ``shardscale.ShardedGradScaler`` (bf16 and fp32 use its static
guard: scale 1, non-finite steps still skipped on every rank together). NCCL and the local GPU
are used when CUDA is there, gloo and the CPU otherwise: the script is the same.

Sharded checkpoints (``--checkpoint-dir``, ``--checkpoint-every``, ``--resume``) hold the model,
optimizer, scaler, step, data position and RNG state; a resumed run continues bit for bit, and
may resume at another world size. ``--inject-inf-every K --inject-rank R`` plants an inf in one
element of rank R's gradient shard every K steps, to show every rank skip together;
``--inject-forward-overflow-every K`` makes rank R's loss inf instead (a forward overflow: every
rank skips, the scale is held). ``--retry`` reruns a batch whose gradients overflowed at a
backed-off scale (``scaler.step(optimizer, closure=...)``) instead of dropping it; the summary
counts the batches dropped.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import checkpointing
import torch
import torch.distributed as dist
from lm_data import Batches, build_corpus
from lm_model import GPT, Block, GPTConfig, lm_loss
from pipeline import LAYOUTS as PIPELINE_LAYOUTS
from pipeline import Pipeline
from replicas import local_grad_shards, params_digest, ranks_agree, steps_digest
from torch import nn

from shardscale import ScalerStats, ShardedGradScaler, watch_activations

_COMPUTE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small GPT in mixed precision with shardscale.ShardedGradScaler.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--steps", type=int, default=100, help="total optimizer steps (a resumed run counts on)")
    add(
        "--parallel",
        choices=("fsdp2", "fsdp1", "ddp", "none", *PIPELINE_LAYOUTS),
        default="fsdp2",
        help="pp: one pipeline stage per rank; pp_fsdp2: 2 stages, each FSDP2 over half the ranks",
    )
    add(
        "--microbatches",
        type=int,
        default=4,
        help="pipeline microbatches per step (pp, pp_fsdp2); must divide --batch-size",
    )
    add("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    add(
        "--no-loss-scaling",
        action="store_true",
        help="fp16 at a fixed scale of 1, the scaler's static guard (for comparison)",
    )
    add("--batch-size", type=int, default=16, help="sequences per rank per step")
    add("--seq-len", type=int, default=64)
    add("--d-model", type=int, default=64, help="small by default: fp16 matmuls are slow on CPUs")
    add("--layers", type=int, default=2)
    add("--heads", type=int, default=4)
    add("--lr", type=float, default=2e-3)
    add(
        "--loss-divisor",
        type=float,
        default=1.0,
        help="divide the loss by D, as when averaging over D times more tokens (large batches, "
        "gradient accumulation); AdamW's eps is divided too, so fp32 training is unchanged",
    )
    add("--init-scale", type=float, default=2.0**16)
    add(
        "--clip-norm",
        type=float,
        default=1.0,
        help="clip gradients to this global norm, in the scaler's one collective (0: no clipping)",
    )
    add(
        "--sync-timeout",
        type=float,
        default=300.0,
        help="seconds the scaler waits for every rank at its collective before raising",
    )
    add(
        "--verify-every",
        type=int,
        default=0,
        help="compare the scaler state across ranks every K steps (0: only after --resume)",
    )
    add("--growth-interval", type=int, default=100)
    add("--seed", type=int, default=0)
    add("--checkpoint-dir", type=Path, help="where sharded checkpoints go")
    add("--checkpoint-every", type=int, default=0, help="save every K steps (0: only at the end)")
    add("--resume", action="store_true", help="continue from the newest checkpoint")
    add("--inject-inf-every", type=int, default=0, help="plant an inf every K steps (0: never)")
    add(
        "--inject-forward-overflow-every",
        type=int,
        default=0,
        help="make --inject-rank's loss inf every K steps, as an fp16 forward overflow (0: never)",
    )
    add("--inject-rank", type=int, default=0, help="the rank whose gradient (or loss) gets the inf")
    add(
        "--retry",
        action="store_true",
        help="rerun a batch whose gradients overflowed, at a backed-off scale, instead of "
        "dropping it (scaler.step(optimizer, closure=...)); an inf planted by --inject-inf-every "
        "lands in the first run only, as an overflow the lower scale avoids",
    )
    add("--max-retries", type=int, default=3, help="reruns of one batch, at most (--retry)")
    add("--eval-batches", type=int, default=8, help="held-out batches for the final eval loss")
    add(
        "--underflow-every",
        type=int,
        default=100,
        help="the scaler's underflow meter reads the gradients every K steps; each reading goes "
        "into that step's record as 'underflow' (0: never)",
    )
    add(
        "--watch-activations",
        type=int,
        default=0,
        metavar="K",
        help="every K steps, watch that step's backward (shardscale.watch_activations) and print "
        "the modules whose output gradients lose the most to fp16's range (0: never)",
    )
    add("--log-every", type=int, default=10, help="progress lines when not on a terminal")
    add("--summary-json", type=Path, help="write the run's summary here (rank 0)")
    add("--plot", type=Path, help="write a PNG of loss and scale against step (rank 0)")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "d_model",
        "layers",
        "heads",
        "log_every",
        "microbatches",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.loss_divisor >= 1.0:
        parser.error(f"--loss-divisor must be >= 1, got {args.loss_divisor}")
    if not args.clip_norm >= 0:
        parser.error(f"--clip-norm must be >= 0 (0: no clipping), got {args.clip_norm}")
    if args.sync_timeout <= 0:
        parser.error(f"--sync-timeout must be > 0, got {args.sync_timeout}")
    for name in (
        "checkpoint_every",
        "inject_inf_every",
        "inject_forward_overflow_every",
        "eval_batches",
        "verify_every",
        "max_retries",
        "underflow_every",
        "watch_activations",
    ):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.parallel in PIPELINE_LAYOUTS and args.batch_size % args.microbatches:
        parser.error(
            f"--batch-size must be a multiple of --microbatches ({args.microbatches}), "
            f"got {args.batch_size}"
        )
    if args.d_model % args.heads:
        parser.error(f"--d-model must be a multiple of --heads ({args.heads}), got {args.d_model}")
    if (args.resume or args.checkpoint_every) and args.checkpoint_dir is None:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.no_loss_scaling and args.precision != "fp16":
        parser.error("--no-loss-scaling is for --precision fp16")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[launch]'")


# ------------------------------------------------------------------ setup


def _init_distributed() -> torch.device:
    """Start the process group (NCCL with CUDA, else gloo); one rank if not under torchrun."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    device_id = device if backend == "nccl" else None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if "RANK" in os.environ and attempt:
        # torch 2.13 reuses torchrun's store across restarts without a per-attempt prefix, so a
        # restarted rank would read the dead attempt's addresses; add the prefix ourselves.
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=rank == 0 and not agent_hosts,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"shardscale/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            device_id=device_id,
        )
    elif "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device_id)
    else:  # plain `python launch/job/train.py`: a group of one, so every code path is the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def _wrap(model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
    if parallel == "none":
        if dist.get_world_size() > 1:
            raise SystemExit(
                f"--parallel none trains one replica per process with nothing keeping them in "
                f"step; launch it with one process, got world size {dist.get_world_size()}"
            )
        return model
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if parallel == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks.values():  # type: ignore[union-attr, operator]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _make_scaler(args: argparse.Namespace) -> ShardedGradScaler:
    bounds = {
        "sync_timeout": args.sync_timeout,
        "verify_every": args.verify_every,
        # with planted infs, show where they landed. A clean step pays one host read of the
        # agreed flag: after AdamW's non-fused step, which has read it already, it waits for nothing
        "locate_overflow": bool(args.inject_inf_every or args.inject_forward_overflow_every),
        "max_retries": args.max_retries,
        "underflow_every": args.underflow_every,
    }
    if args.precision == "fp16" and not args.no_loss_scaling:
        return ShardedGradScaler(
            init_scale=args.init_scale, growth_interval=args.growth_interval, **bounds
        )
    # bf16, fp32 and unscaled fp16: the guard, scale 1 (nothing is scaled), non-finite steps
    # skipped on every rank together; its underflow meter reads the gradients as they are
    return ShardedGradScaler(dynamic=False, **bounds)


@torch.no_grad()
def _plant_inf(optimizer: torch.optim.Optimizer) -> None:
    """Write an inf into one element of this rank's local gradient shard."""
    for shard in local_grad_shards(optimizer):
        shard.view(-1)[0] = math.inf
        return


# ------------------------------------------------------------------ what a user sees


class Progress:
    """Rank 0's progress: a bar on a terminal, a line every ``log_every`` steps elsewhere."""

    def __init__(self, total: int, log_every: int, enabled: bool) -> None:
        self.total, self.log_every, self.enabled = total, log_every, enabled
        self.tty = enabled and sys.stdout.isatty()

    def update(self, step: int, loss: float, scale: float, skipped: int, tokens_s: float) -> None:
        if not self.enabled:
            return
        done = step + 1
        text = (
            f"step {done:>5}/{self.total}  loss {loss:7.4f}  scale {scale:>9g}  "
            f"skipped {skipped:>3}  {tokens_s:9.0f} tok/s"
        )
        if self.tty:
            filled = int(30 * done / self.total)
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}", end="", flush=True)
        elif done % self.log_every == 0 or done == self.total:
            print(text, flush=True)

    def note(self, message: str) -> None:
        if self.enabled:
            print(("\n" if self.tty else "") + message, flush=True)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


def _plot(path: Path, history: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (loss_axis, scale_axis) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    loss_axis.plot(steps, [h["loss"] for h in history], lw=1)
    loss_axis.set_ylabel("training loss")
    loss_axis.set_title(title)
    scale_axis.plot(steps, [h["scale"] for h in history], lw=1, color="tab:orange")
    skipped = [h for h in history if h["skipped"]]
    scale_axis.scatter(
        [h["step"] for h in skipped],
        [h["scale"] for h in skipped],
        marker="x",
        color="tab:red",
        label="skipped step",
        zorder=3,
    )
    scale_axis.set_yscale("log", base=2)
    scale_axis.set_ylabel("loss scale")
    scale_axis.set_xlabel("step")
    if skipped:
        scale_axis.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the job


@dataclass(frozen=True)
class Job:
    """What one run trains with, built once: the model, its optimizer and scaler, its data share."""

    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: ShardedGradScaler
    pipeline: Pipeline | None
    autocast: Callable[[], Any]
    """A context for the forward pass in the compute dtype (a no-op in fp32)."""
    data_rank: int
    data_ranks: int
    """This rank's share of the data: its index among the ranks that take different batches."""
    stage: int
    """The pipeline stage this rank runs (0 without a pipeline): ranks of one stage agree."""

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """Plain pipeline-stage parameters live on their stage's ranks only; the clip is told."""
        return self.pipeline.replica_group if self.pipeline is not None else None


def build_job(args: argparse.Namespace, device: torch.device) -> Job:
    """The model (wrapped for ``--parallel``), AdamW and the scaler, seeded by ``--seed``."""
    torch.manual_seed(args.seed)
    config = GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers
    )
    autocast_dtype = _COMPUTE_DTYPES[args.precision]

    def autocast() -> Any:
        if autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype)

    scaler = _make_scaler(args)
    pipeline: Pipeline | None = None
    if args.parallel in PIPELINE_LAYOUTS:
        pipeline = Pipeline(
            args.parallel, config, device, scaler, args.microbatches, args.loss_divisor, autocast
        )
        model: nn.Module = pipeline.module
        data_rank, data_ranks, stage = pipeline.dp_rank, pipeline.dp_size, pipeline.stage
    else:
        model = _wrap(GPT(config).to(device), args.parallel, device)
        data_rank, data_ranks, stage = dist.get_rank(), dist.get_world_size(), 0
    # eps / D keeps AdamW's update what it is at D = 1: only the gradients' range moves.
    # Built from named parameters, so that located overflows are named.
    optimizer = torch.optim.AdamW(
        model.named_parameters(), lr=args.lr, eps=1e-8 / args.loss_divisor
    )
    return Job(device, model, optimizer, scaler, pipeline, autocast, data_rank, data_ranks, stage)


def checkpoint_state(job: Job, seed: int) -> dict[str, Any]:
    """What a checkpoint holds: model and optimizer, scaler, the loop's position, the RNG."""
    return {
        "app": checkpointing.ModelAndOptimizer(job.model, job.optimizer),
        "scaler": job.scaler,
        "train": {"step": 0, "samples_seen": 0, "seed": seed},
        "rng": torch.get_rng_state(),
    }


def resume_if_asked(
    args: argparse.Namespace, state: dict[str, Any], restart: int, progress: Progress
) -> None:
    """Load the latest checkpoint into ``state`` on ``--resume``, or when torchrun restarted a
    checkpointed job (``restart`` > 0); then check that every rank loaded the same scaler."""
    if restart and args.checkpoint_dir is not None and not args.resume:
        if checkpointing.has_checkpoint(args.checkpoint_dir):
            args.resume = True  # torchrun restarted the job: carry on from the last checkpoint
        else:
            progress.note(
                f"restart {restart}: no checkpoint in {args.checkpoint_dir} yet, "
                "starting again from step 0"
            )
    if not args.resume:
        return
    path = checkpointing.latest(args.checkpoint_dir)
    checkpointing.load(path, state)
    train_state, scaler = state["train"], state["scaler"]
    if train_state["seed"] != args.seed:
        raise SystemExit(f"--seed {args.seed} differs from the checkpoint's {train_state['seed']}")
    torch.set_rng_state(state["rng"])
    scaler.verify_agreement()  # every rank loaded the same scaler state, or we stop here
    progress.note(
        f"resumed from {path} at step {train_state['step']} "
        f"(scale {scaler.get_scale():g}, world size {dist.get_world_size()})"
    )


def save_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> None:
    state["rng"] = torch.get_rng_state()
    checkpointing.save(directory, step, state)


def forward_backward(
    job: Job, inputs: torch.Tensor, targets: torch.Tensor, loss_divisor: float, inf_loss: bool
) -> torch.Tensor:
    """The scaled forward and backward pass; returns the loss averaged over ranks (to log).

    ``inf_loss`` makes this rank's loss inf, as an fp16 forward overflow would."""
    if job.pipeline is not None:  # the last stage scales its loss; the schedule runs backward
        job.pipeline.inf_loss = inf_loss
        return job.pipeline.forward_backward(inputs, targets)
    with job.autocast():
        loss = lm_loss(job.model(inputs), targets)
    if inf_loss:
        loss = loss * math.inf
    job.scaler.scale(loss / loss_divisor).backward()
    global_loss = loss.detach().double()
    dist.all_reduce(global_loss)
    return global_loss / dist.get_world_size()


def _due(every: int, step: int) -> bool:
    """Whether what is done every ``every`` steps (0: never) falls on ``step`` (0-based): an
    injection, the meter's reading."""
    return bool(every) and (step + 1) % every == 0


def train_step(
    args: argparse.Namespace, job: Job, step: int, inputs: torch.Tensor, targets: torch.Tensor
) -> dict[str, Any]:
    """One batch: forward and backward (with the injected infs), clip (``--clip-norm``), step
    and update; returns the step's record. With ``--retry`` the scaler runs the batch itself,
    as the closure of ``scaler.step``, and again at a backed-off scale where it overflowed."""
    scaler, injected = job.scaler, dist.get_rank() == args.inject_rank
    inf_loss = injected and _due(args.inject_forward_overflow_every, step)
    plant_inf = injected and _due(args.inject_inf_every, step)
    record: dict[str, Any] = {"step": step + 1}

    def run_batch() -> torch.Tensor:
        job.optimizer.zero_grad(set_to_none=True)
        global_loss = forward_backward(job, inputs, targets, args.loss_divisor, inf_loss)
        if plant_inf and "loss" not in record:  # a rerun (--retry) gets no planted inf
            _plant_inf(job.optimizer)
        record["loss"] = global_loss.item()
        if args.clip_norm:
            record["grad_norm"] = scaler.clip_grad_norm_(
                job.model.parameters(), args.clip_norm, replica_group=job.replica_group
            )
        return global_loss

    watching = _due(args.watch_activations, step)
    with watch_activations(job.model) if watching else nullcontext() as watch:
        if args.retry:  # every run of the batch adds to the watch
            scaler.step(job.optimizer, closure=run_batch)
        else:
            run_batch()
            scaler.step(job.optimizer)
    scaler.update()
    if watch is not None:  # the worst first: (module, fraction below 2^-14, dtype)
        worst = (watch.records or [])[:5]
        record["activations"] = [(r.name, r.fraction, r.dtype) for r in worst]
    record["scale"] = scaler.get_scale()
    record["skipped"] = scaler.last_step_skipped  # free after AdamW's (non-fused) step
    if "grad_norm" in record:
        record["grad_norm"] = record["grad_norm"].item()  # unscaled, global; inf when skipped
    return record


def train_loop(
    args: argparse.Namespace,
    job: Job,
    batches: Batches,
    state: dict[str, Any],
    progress: Progress,
) -> list[dict[str, Any]]:
    """Steps from the checkpointed one to ``--steps``: one record per step, progress on rank 0,
    checkpoints every ``--checkpoint-every`` steps."""
    train_state, scaler = state["train"], job.scaler
    start = train_state["step"]
    tokens_per_step = args.batch_size * args.seq_len * job.data_ranks
    # Host-side copies, so the loop reads the device once per step (the new scale), not more.
    scale = scaler.get_scale()
    counted = scaler.stats  # as of the last step that read them
    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    for step in range(start, args.steps):
        batch = batches.train_batch(step, job.data_rank, job.data_ranks)
        inputs, targets = (t.to(job.device) for t in batch)
        record = train_step(args, job, step, inputs, targets)
        history.append(record)
        scale_used, scale = scale, record["scale"]
        train_state.update(
            step=step + 1, samples_seen=(step + 1) * args.batch_size * job.data_ranks
        )
        forward = False  # the counters cost a host read: only where a step needs them
        if record["skipped"] or args.retry or _due(args.underflow_every, step):
            before, counted = counted, scaler.stats
            forward = _count_step(record, before, counted)
        _note_step(progress, record, scale_used, forward, scaler)
        elapsed = time.perf_counter() - started
        progress.update(
            step,
            record["loss"],
            scale,
            counted.skipped_steps,
            tokens_per_step * (step + 1 - start) / max(elapsed, 1e-9),
        )
        every = args.checkpoint_every
        if args.checkpoint_dir is not None and every and (step + 1) % every == 0:
            save_checkpoint(args.checkpoint_dir, step + 1, state)
    progress.close()
    return history


def _count_step(record: dict[str, Any], before: ScalerStats, counted: ScalerStats) -> bool:
    """Add to the step's record what the counters say of it (``counted``, read after it;
    ``before``, at the last read): its batch's reruns, and the meter's reading where the meter
    read this step. Returns whether the step's loss itself was non-finite."""
    record["retries"] = counted.retries - before.retries
    if counted.underflow_step == record["step"]:
        record["underflow"] = counted.underflow
    return counted.forward_overflows > before.forward_overflows


def _note_step(
    progress: Progress,
    record: dict[str, Any],
    scale_used: float,
    forward: bool,
    scaler: ShardedGradScaler,
) -> None:
    """Rank 0's lines for a step: the watch's worst modules where it watched the step; a rerun
    of the batch, or a skip: why, the scale before and after, and where the overflow was
    located. ``forward``: the step's loss was non-finite."""
    step, scale = record["step"], record["scale"]
    if record.get("activations"):
        worst = [f"{name} {share:.2%} ({dtype})" for name, share, dtype in record["activations"]]
        progress.note(
            f"step {step}: activation gradients below 2^-14, worst first: " + ", ".join(worst[:3])
        )
    if record.get("retries"):
        progress.note(
            f"step {step}: gradients overflowed, batch rerun {record['retries']} "
            f"time(s) at a lower scale (--retry); scale {scale_used:g} -> {scale:g}"
        )
    if not record["skipped"]:
        return
    why = "non-finite loss: a forward overflow" if forward else "non-finite gradients"
    # a forward overflow's NaNs fill every gradient: name the losses alone
    located_records = scaler.last_overflow or []  # None: not located (no locate_overflow)
    where = [r for r in located_records if not forward or r.name == "<loss>"]
    located = "; ".join(map(str, where[:3])) + (
        f"; and {len(where) - 3} more" if len(where) > 3 else ""
    )
    progress.note(
        f"step {step}: skipped on all {dist.get_world_size()} rank(s) ({why}); "
        f"scale {scale_used:g} -> {scale:g}" + (f"; located at {located}" if located else "")
    )


def summarise(
    args: argparse.Namespace,
    job: Job,
    history: list[dict[str, Any]],
    elapsed: float,
    final_step: int,
    eval_loss: float | None,
) -> dict[str, Any]:
    """The run's summary, the same on every rank; ``ranks_agree`` compares them (a collective).

    Ranks of one stage must hold the same parameters; every rank the same optimizer steps and
    scaler state.
    """
    scaler = job.scaler
    scaler_state = scaler.state_dict()
    agree = ranks_agree(
        params_digest(job.model),
        steps_digest(job.optimizer, repr(sorted(scaler_state.items()))),
        job.stage,
    )
    tokens_per_step = args.batch_size * args.seq_len * job.data_ranks
    stats = scaler.stats
    return {
        "steps": final_step,
        "interrupted": final_step < args.steps,
        "skipped_steps": stats.skipped_steps,
        "batches_dropped": stats.skipped_steps,  # a skipped step's batch is not trained on
        "forward_overflows": stats.forward_overflows,
        "retries": stats.retries,
        # the underflow meter's last reading (every --underflow-every steps; 0: none yet)
        "underflow": stats.underflow,
        "underflow_scale": stats.underflow_scale,
        "underflow_step": stats.underflow_step,
        "retry": args.retry,
        "final_loss": history[-1]["loss"] if history else None,
        "eval_loss": eval_loss,
        "final_scale": scaler.get_scale(),
        "world_size": dist.get_world_size(),
        "ranks_agree": agree,
        "parallel": args.parallel,
        "pipeline_stages": job.pipeline.stages if job.pipeline is not None else 1,
        "precision": args.precision,
        "loss_scaling": args.precision == "fp16" and not args.no_loss_scaling,
        "backend": str(dist.get_backend()),
        "tokens_per_s": tokens_per_step * len(history) / elapsed if history else 0.0,
        "elapsed_s": elapsed,
        "history": history,
    }


def train(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Run the job on the initialised process group; return its summary (on every rank)."""
    world_size = dist.get_world_size()
    if not 0 <= args.inject_rank < world_size:
        raise SystemExit(f"--inject-rank must be in [0, {world_size}), got {args.inject_rank}")
    job = build_job(args, device)
    pipeline = job.pipeline
    if args.inject_forward_overflow_every and pipeline is not None:
        last_stage_ranks = range(world_size - pipeline.dp_size, world_size)
        if args.inject_rank not in last_stage_ranks:
            raise SystemExit(
                f"--inject-forward-overflow-every needs --inject-rank on the last pipeline stage "
                f"(ranks {list(last_stage_ranks)}: only it has a loss), got {args.inject_rank}"
            )
    # The job prints skips and located overflows itself, once (rank 0), beside its progress bar:
    # the library's log lines would repeat them on every rank.
    logging.getLogger("shardscale").setLevel(logging.ERROR)
    batches = Batches(build_corpus(), args.seq_len, args.batch_size, args.seed)
    progress = Progress(args.steps, args.log_every, enabled=dist.get_rank() == 0)
    state = checkpoint_state(job, args.seed)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resume_if_asked(args, state, restart, progress)

    started = time.perf_counter()
    history = train_loop(args, job, batches, state, progress)
    elapsed = time.perf_counter() - started
    final_step = state["train"]["step"]
    if args.checkpoint_dir is not None and not args.checkpoint_every and final_step >= args.steps:
        save_checkpoint(args.checkpoint_dir, final_step, state)
    eval_loss = _evaluate(job.model, job.pipeline, batches, args.eval_batches, device, job.autocast)
    return summarise(args, job, history, elapsed, final_step, eval_loss)


@torch.no_grad()
def _evaluate(
    model: nn.Module,
    pipeline: Pipeline | None,
    batches: Batches,
    count: int,
    device: torch.device,
    autocast: Any,
) -> float | None:
    """Mean held-out loss over ``count`` fixed batches, averaged over ranks."""
    if count == 0:
        return None
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, targets in batches.held_out_batches(count):
        inputs, targets = inputs.to(device), targets.to(device)
        if pipeline is not None:
            total += pipeline.evaluate(inputs, targets)  # the same on every rank already
        else:
            with autocast():
                total += lm_loss(model(inputs), targets).double() / dist.get_world_size()
    if pipeline is None:
        dist.all_reduce(total)
    return float(total.item()) / count


def _print_summary(summary: dict[str, Any]) -> None:
    rows = [
        ("steps", summary["steps"]),
        (
            "batches dropped",
            f"{summary['batches_dropped']} (skipped steps; {summary['forward_overflows']} of "
            f"them forward overflows)",
        ),
        ("batches rerun", summary["retries"] if summary["retry"] else "- (no --retry)"),
        ("final training loss", f"{summary['final_loss']:.4f}" if summary["final_loss"] else "-"),
        ("held-out loss", f"{summary['eval_loss']:.4f}" if summary["eval_loss"] else "-"),
        ("final scale", f"{summary['final_scale']:g}"),
        (
            "gradient underflow",
            f"{summary['underflow']:.3%} of non-zero elements below 2^-14 at step "
            f"{summary['underflow_step']} (at most 0.1% from scale {summary['underflow_scale']:g})"
            if summary["underflow_step"]
            else "- (no reading yet: --underflow-every)",
        ),
        (
            "world size",
            f"{summary['world_size']} ({summary['backend']}, {summary['parallel']}"
            + (f", {summary['pipeline_stages']} stages" if summary["pipeline_stages"] > 1 else "")
            + ")",
        ),
        (
            "precision",
            summary["precision"]
            + (
                ""
                if summary["loss_scaling"] or summary["precision"] != "fp16"
                else " (no loss scaling)"
            ),
        ),
        ("ranks agree", "yes" if summary["ranks_agree"] else "NO: the replicas diverged"),
        ("throughput", f"{summary['tokens_per_s']:.0f} tokens/s"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"  {name:<{width}}  {value}" for name, value in rows), flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = _init_distributed()
    try:
        summary = train(args, device)
        if dist.get_rank() == 0:
            _print_summary(summary)
            if args.summary_json is not None:
                args.summary_json.parent.mkdir(parents=True, exist_ok=True)
                args.summary_json.write_text(json.dumps(summary, indent=2))
            if args.plot is not None:
                title = f"{args.precision}, {args.parallel}, {summary['world_size']} rank(s)"
                _plot(args.plot, summary["history"], title)
        if not summary["ranks_agree"]:
            raise SystemExit("the ranks' parameters or scaler states differ at the end")
        # No rank leaves while another still needs the group (rank 0 may host its store).
        dist.barrier()
        return summary
    except checkpointing.CheckpointError as error:
        raise SystemExit(f"error: {error}") from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The job is done and its outputs are written. torch 2.13 sometimes aborts while tearing
    # down its C++ state at interpreter exit ("terminate called without an active exception";
    # ~1 run in 8 with 3 ranks on 2 cores), which torchrun reports as a failed job: skip that.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
