"""Megatron-core's own optimizers on CPU tensors, for tests/test_integration_megatron.py.

The classes are megatron-core's, unchanged (`Float16OptimizerWithFloat16Params`,
`ChainedOptimizer`, `DynamicGradScaler`, its pipeline schedule's `backward_step` and
`forward_step_calc_loss`, its `parallel_state` groups, its MoE loss scaler); what they need to run
on a CPU lives here, never in the package. Megatron hard-codes CUDA: tensors made with
`device='cuda'` (or `torch.cuda.current_device()`), `.cuda()` copies,
`torch.cuda.current_device()` and `synchronize()` (the checkpoint writer), and type checks that
read `'torch.cuda.HalfTensor'` / `'torch.cuda.FloatTensor'`. `cuda_on_cpu()` answers
those for CPU tensors (a torch function mode: `device='cuda'` becomes the CPU, `.cuda()` keeps the
tensor, `.type()` names the CUDA type) while the block runs; nothing else changes.

The gradients arrive as Megatron's DDP leaves them: backward writes the fp16 `.grad`, which the
DDP hook adds into the parameter's `main_grad` (here fp32, as with Megatron's
`accumulate_allreduce_grads_in_fp32`) and clears. Megatron's `_copy_model_grads_to_main_grads`
then hands the fp32 main parameter `main_grad.float()`, that same tensor, so unscaling it unscales
the buffer: a second `prepare_grads()` divides again (with an fp16 buffer `.float()` copies, and
the second division lands on a fresh copy).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _CudaOnCpu(TorchFunctionMode):
    """Megatron's CUDA-only calls, answered with CPU tensors (the module docstring)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        # an int is what torch.cuda.current_device() returned: an accelerator's index
        if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return str(func(*args)).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Run Megatron's CUDA-only code on CPU tensors while the block runs."""
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device, torch.cuda.synchronize = lambda: 0, lambda device=None: None
    try:
        with _CudaOnCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


def import_megatron(sources: str) -> SimpleNamespace:
    """megatron-core's modules the tests use, imported from its unpacked sources."""
    if sources not in sys.path:
        sys.path.insert(0, sources)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" x4
        from megatron.core import parallel_state
        from megatron.core.optimizer import grad_scaler, optimizer, optimizer_config
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        from shardscale.integrations import megatron as integration
    return SimpleNamespace(
        parallel_state=parallel_state,
        DynamicGradScaler=grad_scaler.DynamicGradScaler,
        ConstantGradScaler=grad_scaler.ConstantGradScaler,
        Float16Optimizer=optimizer.Float16OptimizerWithFloat16Params,
        ChainedOptimizer=optimizer.ChainedOptimizer,
        OptimizerConfig=optimizer_config.OptimizerConfig,
        schedules=schedules,
        MoEAuxLossAutoScaler=MoEAuxLossAutoScaler,
        MTPLossAutoScaler=MTPLossAutoScaler,
        integration=integration,
    )


# Megatron's fp16 defaults are 2**32, floor 1.0, window 1000, hysteresis 2; a short window and a
# small scale keep the tests' gradients and steps few.
SCALER = {"initial_scale": 1024.0, "min_scale": 1.0, "growth_factor": 2.0}
SCALER |= {"backoff_factor": 0.5, "growth_interval": 4.0, "hysteresis": 2}  # a float, as there


@dataclass
class Group:
    """One sub-optimizer's model parameters (fp16, each with an fp32 `main_grad` buffer) and
    the groups `get_megatron_optimizer` gives it (grad statistics, tensor parallel)."""

    params: list[torch.nn.Parameter]
    grad_stats: Any
    tp: Any
    expert: bool = False


def group(sizes: list[int], grad_stats: Any, tp: Any, *, expert: bool, seed: int) -> Group:
    """Parameters of `sizes` elements, the same for every rank (the same `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for size in sizes:
        param = torch.nn.Parameter(torch.randn(size, generator=generator).half())
        param.main_grad = torch.zeros(size)  # type: ignore[attr-defined]
        if expert:
            param.allreduce = False  # type: ignore[attr-defined]  # Megatron's expert mark
        params.append(param)
    return Group(params, grad_stats, tp, expert)


def optimizer(
    mg: SimpleNamespace, groups: list[Group], *, clip_grad: float = 0.0, **settings: float
) -> Any:
    """A `ChainedOptimizer` of one `Float16OptimizerWithFloat16Params` (SGD inside, lr 1, so a
    step moves a weight by its gradient) per group, each with its own `DynamicGradScaler`
    (`SCALER`, updated by `settings`), wired as `get_megatron_optimizer` wires them. Call inside
    `cuda_on_cpu()`."""
    config = mg.OptimizerConfig(fp16=True, lr=1.0, clip_grad=clip_grad)
    leaves = []
    for each in groups:
        scaler = mg.DynamicGradScaler(**{**SCALER, **settings})
        sgd = torch.optim.SGD(each.params, lr=1.0)
        leaf = mg.Float16Optimizer(sgd, config, scaler, _no_state_to_initialise)
        leaf.grad_stats_parallel_group = each.grad_stats
        leaf.tp_group = leaf.expert_tp_group = each.tp
        leaves.append(leaf)
    return mg.ChainedOptimizer(leaves)


def _no_state_to_initialise(optimizer: Any, config: Any = None) -> None:
    """SGD's `init_state_fn` (Megatron calls one before a sharded load)."""


def backward(optimizer: Any, groups: list[Group], inputs: list[list[torch.Tensor]]) -> None:
    """One micro-batch: the loss `sum(param * input)` (so each gradient is its input), scaled
    by `optimizer.scale_loss` (Megatron's `grad_scale_func`), backward, and the DDP hook's
    `main_grad += grad; grad = None`."""
    loss = sum(
        (param.float() * x).sum()
        for each, xs in zip(groups, inputs, strict=True)
        for param, x in zip(each.params, xs, strict=True)
    )
    optimizer.scale_loss(loss).backward()
    for each in groups:
        for param in each.params:
            param.main_grad.add_(param.grad.float())  # type: ignore[union-attr]
            param.grad = None


def zero_grad(optimizer: Any, groups: list[Group]) -> None:
    """What Megatron's training loop does first: the DDP buffers, then the optimizer."""
    for each in groups:
        for param in each.params:
            param.main_grad.zero_()  # type: ignore[attr-defined]
    optimizer.zero_grad()


def main_grads(optimizer: Any) -> list[list[float]]:
    """Each sub-optimizer's fp32 main gradients, flattened, as the inner optimizer sees them."""
    return [
        torch.cat(
            [p.grad.flatten() for group in leaf.fp32_from_float16_groups for p in group]
        ).tolist()
        for leaf in optimizer.chained_optimizers
    ]


def main_params(optimizer: Any) -> list[list[float]]:
    """Each sub-optimizer's fp32 main parameters (what its inner optimizer steps), flattened."""
    return [
        torch.cat(
            [p.detach().flatten() for group in leaf.fp32_from_float16_groups for p in group]
        ).tolist()
        for leaf in optimizer.chained_optimizers
    ]


def scales(optimizer: Any) -> list[float]:
    """Each sub-optimizer's grad scaler's scale."""
    return [float(leaf.grad_scaler.scale) for leaf in optimizer.chained_optimizers]


class _DecoupledSGD(torch.optim.Optimizer):
    """SGD that reads each parameter's `decoupled_grad`, as Transformer Engine's `FusedAdam`
    does with `use_decoupled_grad=True` (the inner optimizer of the precision-aware one)."""

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None)
                if grad is not None:
                    param.add_(grad.to(param.dtype), alpha=-group["lr"])


def decoupled_optimizer(
    mg: SimpleNamespace, groups: list[Group], *, clip_grad: float = 0.0, **settings: float
) -> Any:
    """A `ChainedOptimizer` whose sub-optimizers keep their main gradients as the
    precision-aware optimizer does (verl's fp16 setting): in `main_param.decoupled_grad`, the
    DDP buffer itself, read by the inner optimizer and by Megatron's norm and unscale.

    A stand-in, said plainly: the precision-aware optimizer is a `DistributedOptimizer` over
    Transformer Engine's `FusedAdam`, which does not run on a CPU. This is megatron-core's
    `Float16OptimizerWithFloat16Params` with the two methods the precision-aware path changes
    (`_copy_model_grads_to_main_grads`, `_collect_main_grad_data_for_unscaling`) written as
    `DistributedOptimizer` writes them for it, unsharded; everything else (its config flag, the
    norm's filter, the clip, the chain, the scaler) is megatron-core's own."""

    class Decoupled(mg.Float16Optimizer):  # type: ignore[misc,name-defined]
        def _copy_model_grads_to_main_grads(self) -> None:
            for model_group, main_group in zip(
                self.float16_groups, self.fp32_from_float16_groups, strict=True
            ):
                for model_param, main_param in zip(model_group, main_group, strict=True):
                    main_param.decoupled_grad = model_param.main_grad
                    model_param.grad = None

        def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
            return [
                param.decoupled_grad.data
                for group in self.optimizer.param_groups
                for param in group["params"]
            ]

    config = mg.OptimizerConfig(fp16=True, lr=1.0, clip_grad=clip_grad)
    # set after __post_init__, which asks for the distributed optimizer and TE's Adam
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    leaves = []
    for each in groups:
        scaler = mg.DynamicGradScaler(**{**SCALER, **settings})
        leaf = Decoupled(
            _DecoupledSGD(each.params, lr=1.0), config, scaler, _no_state_to_initialise
        )
        leaf.grad_stats_parallel_group = each.grad_stats
        leaf.tp_group = leaf.expert_tp_group = each.tp
        leaves.append(leaf)
    return mg.ChainedOptimizer(leaves)


def decoupled_grads(optimizer: Any) -> list[list[float]]:
    """Each sub-optimizer's `decoupled_grad`s, flattened (what the inner optimizer reads)."""
    return [
        torch.cat(
            [p.decoupled_grad.flatten() for group in leaf.fp32_from_float16_groups for p in group]
        ).tolist()
        for leaf in optimizer.chained_optimizers
    ]
