"""torchtitan's own Trainer on CPU ranks (gloo), for tests/test_integration_torchtitan.py.

Run under torchrun, with SHARDSCALE_TITAN_ASSETS (`make_assets()`'s folder) and
SHARDSCALE_TITAN_OUT (a folder for the records) set. It trains torchtitan 0.3.0's llama3 debug
model through `shardscale.integrations.torchtitan.fp16()` (or, with `--cli`, through that
module's `main()`, which takes torchtitan's own flags), or unconverted in bf16/fp32 for
reference; `--runs` lists the trainers to run one after the other. Each rank writes one record
per step to records-RANK.jsonl: loss, grad norm, LR, the scaler's numbers and the optimizers'
step counters. A run's `inject_at`/`inject_rank` write an inf into that rank's local gradient
shard after that step's backward. A run's `guard` trains with torchtitan's finite-step guard of
later versions (PR #4226, `guarded_train_step`: its hunks applied to 0.3.0's `train_step`), and
its `raw_norm` hands torchtitan the scaler's norm as it is (inf on a skipped step): a run the guard
stops is recorded as `stopped`, and the job goes on.

What torchtitan 0.3.0 needs on a CPU-only machine with torch 2.13 lives here, never in the
package (`cpu_workarounds()`): its device is chosen at import (`tools/utils.py` falls back to
"cuda"), and its memory monitor calls CUDA-only functions of the device module; FlexAttention
has no CPU backward (SDPA instead); the classic FSDP2 path (`spmd_backend="partial_dtensor"`);
gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's gradient divide factor 1.0
(`set_force_sum_reduction_for_comms(True)` is the same sum). And with torch 2.13 on any device:
torchtitan calls `torch.distributed.set_timeout` after the first step, and hands pipeline
schedules pre-split micro-batches (`step(arg_mbs=...)`); both came with torch 2.14. Its wheel
ships no tokenizer or dataset: `make_assets()` trains a small byte-level BPE on synthetic text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "and"]
WORDS += ["then", "it", "slept", "in", "warm", "sun", "under", "blue", "sky", "over", "green"]


def make_assets(folder: str) -> None:
    """A tokenizer folder (tokenizer.json, tokenizer_config.json) and a JSON-lines data set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(600)
    ]
    data = Path(folder, "data")
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.json").write_text("".join(json.dumps({"text": s}) + "\n" for s in lines))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer_dir = Path(folder, "tokenizer")
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(special))


def cpu_workarounds() -> None:
    """Make torchtitan 0.3.0 train on CPU ranks with torch 2.13. Call before importing it."""
    import torch._utils

    cpu = types.ModuleType("torchtitan_cpu_device")
    cpu.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if k[:2] != "__"})
    cpu.__dict__.update(
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=2**34),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        current_device=lambda: 0,
    )
    device_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind: cpu if kind == "cpu" else device_module(kind)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None

    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    disable_division = titan_fsdp.disable_fsdp_gradient_division

    def sum_without_premul(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = sum_without_premul
    _pipeline_steps_take_microbatches()


def _pipeline_steps_take_microbatches() -> None:
    """torchtitan 0.3.0 hands pipeline schedules pre-split microbatches
    (`step(arg_mbs=, kwarg_mbs=, target_mbs=)`, torch 2.14); torch 2.13 takes whole batches."""
    import inspect

    from torch.distributed.pipelining import schedules

    for schedule in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" in inspect.signature(schedule.step).parameters:
            continue

        def step(
            self: Any,
            *args: Any,
            arg_mbs: Any = None,
            kwarg_mbs: Any = None,
            target_mbs: Any = None,
            losses: Any = None,
            return_outputs: bool = True,
            loss_kwargs: Any = None,
            _step: Any = schedule.step,
            **kwargs: Any,
        ) -> Any:
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _step(
                    self,
                    *args,
                    losses=losses,
                    return_outputs=return_outputs,
                    loss_kwargs=loss_kwargs,
                    **kwargs,
                )
            for stage in getattr(self, "_stages", None) or [self._stage]:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
            )
            return None

        schedule.step = step


def llama3_cpu() -> Any:
    """torchtitan's llama3 debug model config, made to run on CPU ranks, and short.

    A config_registry function: `--module tests.torchtitan_job --config llama3_cpu`. The
    assets folder comes from SHARDSCALE_TITAN_ASSETS.
    """
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for _, _, parent, name in config.model_spec.model.traverse(FlexAttention.Config):
        setattr(parent, name, ScaledDotProductAttention.Config())
    assets = os.environ["SHARDSCALE_TITAN_ASSETS"]
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(assets, "data")
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len = 16  # fp16 and bf16 matmuls are ~30x slower than fp32 on a CPU
    config.training.local_batch_size = 1
    config.training.steps = 3
    config.training.disable_cuda_graphs = True
    config.activation_checkpoint = None
    config.validator.enable = False
    config.checkpoint.enable = False
    config.comm.trace_buf_size = 0
    config.debug.seed = 7
    config.metrics.log_freq = 1
    return config


def llama3_cpu_ce() -> Any:
    """`llama3_cpu` with the plain cross-entropy loss (torchtitan's llama3_debugmodel_ce_loss)."""
    from torchtitan.components.loss import CrossEntropyLoss

    config = llama3_cpu()
    config.loss = CrossEntropyLoss.Config(global_vocab_size=config.loss.loss_fn.global_vocab_size)
    return config


class Run:
    """What one trainer run in this process does (from one entry of `--runs`)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.name: str = spec["name"]
        self.precision: str = spec.get("precision", "fp16")
        self.config: str = spec.get("config", "llama3_cpu")
        self.flags: list[str] = spec.get("flags", [])
        self.scaler: dict[str, Any] = spec.get("scaler", {})
        self.inject_at: int = spec.get("inject_at", 0)
        self.inject_rank: int = spec.get("inject_rank", 1)
        # compare the clip with torchtitan's own and count the scaler's collectives
        self.check_clip: bool = spec.get("check_clip", False)
        # train_step with torchtitan's finite-step guard (after 0.3.0: `guarded_train_step`)
        self.guard: bool = spec.get("guard", False)
        # hand torchtitan the scaler's own norm, inf on a skipped step (the adapter before it
        # learned of the guard): where the guard stops the job, record that and go on
        self.raw_norm: bool = spec.get("raw_norm", False)
        self.scale_calls = 0  # on this rank (a pipeline's first stage makes none)
        self.trainer: Any = None


def _instrument(run: list[Run]) -> None:
    """Print a record after each step of `run[0]`; plant its inf; check its clip against
    torchtitan's own and count the scaler's collectives (clip to update)."""
    import torchtitan.trainer
    from torchtitan.components.metrics import BaseLogger, MetricsProcessor
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.trainer import Trainer

    from shardscale import ShardedGradScaler, count_collectives

    titan_clip = titan_utils.clip_grad_norm_
    logged: dict[str, Any] = {}
    metrics_log, base_log = MetricsProcessor.log, BaseLogger.log
    forward_backward, train_step = Trainer.forward_backward_step, Trainer.train_step
    guarded = guarded_train_step(train_step)
    scale, clip = ShardedGradScaler.scale, ShardedGradScaler.clip_grad_norm_
    step, update = ShardedGradScaler.step, ShardedGradScaler.update

    def log(self: Any, step: int, loss: float, max_loss: float, norm: float, **kw: Any) -> None:
        logged.update(loss=loss, grad_norm=norm)
        metrics_log(self, step, loss, max_loss, norm, **kw)

    def log_record(self: Any, metrics: dict[str, Any], step: int) -> None:
        logged["metrics"] = {k: v for k, v in metrics.items() if k.startswith("shardscale/")}
        base_log(self, metrics, step)

    def forward_backward_step(self: Any, **kwargs: Any) -> torch.Tensor:
        loss = forward_backward(self, **kwargs)
        if self.step == run[0].inject_at and dist.get_rank() == run[0].inject_rank:
            grads = [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
            _local(grads[0]).view(-1)[0] = math.inf
        return loss

    def counted_scale(self: Any, outputs: Any) -> Any:
        run[0].scale_calls += 1
        return scale(self, outputs)

    def checked_clip(self: Any, parameters: Any, max_norm: float, *args: Any, **kw: Any) -> Any:
        params = list(parameters)
        if run[0].check_clip:  # torchtitan's own clip on the same (unscaled) gradients
            saved = [p.grad.detach().clone() for p in params]
            for p, grad in zip(params, saved, strict=True):
                p.grad = grad / self.get_scale()
            pp_mesh = run[0].trainer.parallel_dims.get_optional_mesh("pp")
            titan_norm = titan_clip(params, max_norm, foreach=True, pp_mesh=pp_mesh)
            titan_grads = [p.grad for p in params]
            for p, grad in zip(params, saved, strict=True):
                p.grad = grad
        with _counting(run[0].check_clip) as counts:
            norm = clip(self, params, max_norm, *args, **kw)
        logged["scaler_collectives"] = sum(counts.values())
        if run[0].check_clip:
            difference = max(
                float((_local(p.grad) - _local(grad)).abs().max())
                for p, grad in zip(params, titan_grads, strict=True)
            )
            logged["clip"] = {"norm": float(norm), "titan_norm": float(titan_norm)}
            logged["clip"]["max_grad_difference"] = difference  # this rank's shards
        return norm

    def counted_step(self: Any, *args: Any, **kw: Any) -> Any:
        with _counting(run[0].check_clip) as counts:
            result = step(self, *args, **kw)
        logged["scaler_collectives"] = logged.get("scaler_collectives", 0) + sum(counts.values())
        return result

    def counted_update(self: Any, *args: Any, **kw: Any) -> None:
        with _counting(run[0].check_clip) as counts:
            update(self, *args, **kw)
        logged["scaler_collectives"] = logged.get("scaler_collectives", 0) + sum(counts.values())

    @contextlib.contextmanager
    def _counting(enabled: bool) -> Iterator[Counter[str]]:
        """Count collectives (the profiler costs time: only where the run checks)."""
        if not enabled:
            yield Counter()
            return
        with count_collectives() as counts:
            yield counts

    def record_step(self: Any, data_iterator: Any) -> None:
        logged.clear()
        run[0].trainer = self
        (guarded if run[0].guard else train_step)(self, data_iterator)
        scaler = getattr(self, "scaler", None)
        steps = [
            int(state["step"])
            for optimizer in self.optimizers.optimizers
            for state in optimizer.state.values()
            if "step" in state
        ]
        record = {
            "run": run[0].name,
            "rank": dist.get_rank(),
            "step": self.step,
            "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0],
            "optimizer_steps": sorted(set(steps)),
            **logged,
        }
        if scaler is not None:
            stats = scaler.stats
            record.update(
                skipped=scaler.last_step_skipped,
                scale=stats.scale,
                scaler_steps=stats.steps,
                skipped_steps=stats.skipped_steps,
                scale_calls=run[0].scale_calls,
            )
        _write("records", record)

    MetricsProcessor.log = log
    BaseLogger.log = log_record
    Trainer.forward_backward_step = forward_backward_step
    Trainer.train_step = record_step
    ShardedGradScaler.scale = counted_scale  # type: ignore[method-assign]
    ShardedGradScaler.clip_grad_norm_ = checked_clip  # type: ignore[method-assign]
    ShardedGradScaler.step = counted_step  # type: ignore[method-assign]
    ShardedGradScaler.update = counted_update  # type: ignore[method-assign]
    # torchtitan's rank 0 sleeps 2 s after training, "for other ranks to complete"
    torchtitan.trainer.time = types.SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=time.monotonic, sleep=lambda seconds: None
    )


# torchtitan's PR #4226 (merged 2026-08-20, after 0.3.0: "Stop non-finite steps before optimizer
# updates"), its trainer.py hunks as (0.3.0's text, the PR's text), in order: the loss's
# finiteness kept on the device for every micro-batch, then, between the clip and
# `optimizers.step()`, a MIN all-reduce of it over the loss and pipeline meshes and
# `torch._assert_async(loss finite and grad norm finite)`; the old check on the logged loss goes.
_PR_4226 = [
    (
        """        accumulated_loss: torch.Tensor | None = None
""",
        """        accumulated_loss: torch.Tensor | None = None
        # int32 is supported by NCCL reductions, unlike bool.
        loss_is_finite = torch.ones((), dtype=torch.int32, device=self.device)
""",
    ),
    (
        """            if should_log:
                loss = loss.detach()
                if accumulated_loss is None:
                    # Take ownership before the next replay overwrites the
                    # graph-owned output. Later losses accumulate in place.
                    accumulated_loss = loss.clone()
                else:
                    accumulated_loss.add_(loss)
""",
        """            detached_loss = loss.detach()
            local_loss = (
                detached_loss.to_local()
                if isinstance(detached_loss, DTensor)
                else detached_loss
            )
            loss_is_finite.logical_and_(torch.isfinite(local_loss).all())
            if should_log:
                if accumulated_loss is None:
                    # Take ownership before the next replay overwrites the
                    # graph-owned output. Later losses accumulate in place.
                    accumulated_loss = detached_loss.clone()
                else:
                    accumulated_loss.add_(detached_loss)
""",
    ),
    (
        """            self.checkpointer.maybe_wait_for_staging()
""",
        """            # Only the last PP stage owns the loss. First combine its DP/CP
            # replicas, then propagate the result across PP. TP replicas have
            # identical loss values, and grad_norm is already world-reduced by
            # clip_grad_norm_.
            if not parallel_dims.pp_enabled or self.pp_has_last_stage:
                loss_mesh = parallel_dims.get_optional_mesh("loss")
                if loss_mesh is not None:
                    torch.distributed.all_reduce(
                        loss_is_finite,
                        op=torch.distributed.ReduceOp.MIN,
                        group=loss_mesh.get_group(),
                    )
            pp_mesh = parallel_dims.get_optional_mesh("pp")
            if pp_mesh is not None:
                torch.distributed.all_reduce(
                    loss_is_finite,
                    op=torch.distributed.ReduceOp.MIN,
                    group=pp_mesh.get_group(),
                )

            step_is_finite = loss_is_finite.logical_and(torch.isfinite(grad_norm).all())
            # Keep the check and optimizer kernels ordered on the device without
            # synchronizing the host on every step. The RuntimeError is catchable
            # on CPU, while a failed CUDA assertion invalidates the process.
            torch._assert_async(
                step_is_finite,
                "Loss or gradient norm is not finite on at least one rank at "
                f"step {self.step}. Stopping training before the optimizer update.",
            )
            self.checkpointer.maybe_wait_for_staging()
""",
    ),
    (
        """        # Crash on invalid loss. global_avg_loss is a SUM reduction, so a infinite
        # loss on any rank propagates here. This reuses the D2H copy already done
        # for logging, so it adds no extra sync.
        # TODO: make this step work even logging is off.
        if not math.isfinite(global_avg_loss):
            raise RuntimeError(
                f"Loss is not finite (global_avg_loss={global_avg_loss}) at "
                f"step {self.step}. Stopping training."
            )

""",
        "",
    ),
]


def guarded_train_step(train_step: Any) -> Any:
    """torchtitan 0.3.0's `Trainer.train_step` with PR #4226's finite-step guard: the PR's
    hunks applied to 0.3.0's source of it, compiled in torchtitan.trainer's namespace.

    Raises:
        RuntimeError: a hunk's 0.3.0 text is not in the source exactly once (another
            torchtitan): the guard is not what the PR made it.
    """
    import inspect
    import textwrap

    import torchtitan.trainer as titan
    from torch.distributed.tensor import DTensor

    source = inspect.getsource(train_step)
    for old, new in _PR_4226:
        if source.count(old) != 1:
            raise RuntimeError(f"torchtitan#4226's hunk does not apply to this train_step: {old}")
        source = source.replace(old, new)
    namespace = {**vars(titan), "DTensor": DTensor}
    exec(compile(textwrap.dedent(source), "<torchtitan#4226 train_step>", "exec"), namespace)
    return namespace["train_step"]


def _write(kind: str, record: dict[str, Any]) -> None:
    """Append `record` to this rank's `kind` file in SHARDSCALE_TITAN_OUT (one JSON a line)."""
    path = Path(os.environ["SHARDSCALE_TITAN_OUT"], f"{kind}-{os.environ['RANK']}.jsonl")
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def _titan_args(run: Run) -> list[str]:
    return ["--module", "tests.torchtitan_job", "--config", run.config, *run.flags]


def _config_checks() -> list[dict[str, Any]]:
    """What fp16() refuses and what it leaves alone, as records the test asserts on."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.distributed import utils as titan_utils

    from shardscale.integrations.torchtitan import fp16

    class OwnLoss(CrossEntropyLoss):
        @dataclass(kw_only=True, slots=True)
        class Config(CrossEntropyLoss.Config):
            pass

    def own_loss() -> Any:
        config = llama3_cpu()
        config.loss = OwnLoss.Config()
        return config

    def chunked_own_loss() -> Any:
        config = llama3_cpu()
        config.loss = ChunkedLossWrapper.Config(loss_fn=OwnLoss.Config())
        return config

    def bf16_parameters() -> Any:
        config = llama3_cpu()
        config.training.dtype = "bfloat16"
        return config

    def without_clip() -> Any:
        clip = titan_utils.clip_grad_norm_
        del titan_utils.clip_grad_norm_
        try:
            return fp16(llama3_cpu()).build()
        finally:
            titan_utils.clip_grad_norm_ = clip

    def older_torch() -> Any:
        set_timeout = dist.set_timeout
        del dist.set_timeout  # as torch 2.13 and older
        try:
            return fp16(llama3_cpu())
        finally:
            dist.set_timeout = set_timeout

    cases = {
        "older_torch": older_torch,
        "own_loss": lambda: fp16(own_loss()),
        "chunked_own_loss": lambda: fp16(chunked_own_loss()),
        "bf16_parameters": lambda: fp16(bf16_parameters()),
        "twice": lambda: fp16(fp16(llama3_cpu())),
        "process_group": lambda: fp16(llama3_cpu(), process_group=None),
        "growth_factor": lambda: fp16(llama3_cpu(), growth_factor=0.5),
        "unknown_option": lambda: fp16(llama3_cpu(), growth=2.0),
        "not_a_config": lambda: fp16(llama3_cpu().training),
        "without_clip": without_clip,
    }
    results = []
    for name, case in cases.items():
        try:
            case()
            results.append({"case": name, "error": None})
        except Exception as error:  # the test reads its type and message
            results.append({"case": name, "error": type(error).__name__, "message": str(error)})
    original = llama3_cpu()
    converted = fp16(original, init_scale=1024.0, growth_interval=3)
    results.append(
        {
            "case": "converted",
            "original": [original.training.mixed_precision_param, type(original.loss).__name__],
            "param_dtype": converted.training.mixed_precision_param,
            "reduce_dtype": converted.training.mixed_precision_reduce,
            "loss": type(converted.loss).__qualname__,
            "chunk_loss": type(converted.loss.loss_fn).__qualname__,
            "options": converted.shardscale,
            "trainer": type(converted).__qualname__,
        }
    )
    return results


@contextlib.contextmanager
def _norms_as_the_scaler_gives_them(integration: Any, raw: bool) -> Iterator[None]:
    """With `raw`, the adapter hands torchtitan the scaler's norm as it is (inf on a skipped
    step) while the block runs."""
    reported = integration._reported
    if raw:
        integration._reported = lambda norm: norm
    try:
        yield
    finally:
        integration._reported = reported


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="a JSON list of runs (see Run)")
    parser.add_argument("--cli", action="store_true", help="one run, through the module's main()")
    parser.add_argument("--checks", action="store_true", help="rank 0 checks fp16()'s refusals")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu_workarounds()
    current: list[Run] = []
    _instrument(current)
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from shardscale.integrations import torchtitan as integration

    init_logger()
    if args.checks and int(os.environ["RANK"]) == 0:
        for result in _config_checks():
            _write("checks", result)
    for spec in json.loads(args.runs):
        run = Run(spec)
        current[:] = [run]
        if args.cli:
            integration.main(_titan_args(run))
            return
        config = ConfigManager().parse_args(_titan_args(run))
        if run.precision == "fp16":
            config = integration.fp16(config, **run.scaler)
        else:
            config.training.mixed_precision_param = {"bf16": "bfloat16", "fp32": "float32"}[
                run.precision
            ]
        trainer = config.build()
        try:
            with _norms_as_the_scaler_gives_them(integration, run.raw_norm):
                trainer.train()
        except RuntimeError as error:  # the guard's stop is a record; anything else, a failure
            if not (run.guard and "Stopping training before the optimizer" in str(error)):
                raise
            _write("records", {"run": run.name, "rank": dist.get_rank(), "stopped": str(error)})
        finally:
            trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch sometimes aborts in its C++ teardown at interpreter exit, once everything is written
    # ("terminate called without an active exception": docs/reliability.md): skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
