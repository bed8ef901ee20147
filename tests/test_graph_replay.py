"""CUDA-graph replay of step + update, on the CPU: what a graph reads must be what scale() writes.

A CUDA graph records kernels once and replays them on the same addresses, with no Python. The
first GPU run (docs/gpu.md, 2026-11-26) found that a replayed step read the tensors of the
iteration it was captured in: the loss's scale copy and non-finite bit that scale() made then,
freed after that iteration's update(). Their memory was reused, the replay read a "non-finite
loss" from it, and every replayed step was skipped with the scale held.

``Recording`` gives a CPU run the same semantics: it records the aten ops of a region and replays
them on the same tensors, writing what an op allocated into the tensor it allocated when
recorded. The scaler runs its CUDA path (``shardscale.testing.cuda_path()``), whose capture
check says a capture is under way while the region is recorded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale import ShardedGradScaler
from shardscale.testing import cuda_path


def _flat(tree: Any) -> list[Any]:
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _flat(item)]
    return [tree]


class Recording(TorchDispatchMode):
    """The aten ops run inside it, replayable as a CUDA graph replays its kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        assert func is not torch.ops.aten._local_scalar_dense.default, "a host read in a graph"
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(_flat(out), _flat(fresh), strict=True):
                if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                    old.copy_(new)  # an allocation: the graph's output lives where it was


def _iteration(model: nn.Module, scaler: ShardedGradScaler, step: int) -> None:
    """Forward and backward, outside any graph, into the same gradient tensors every time: the
    third iteration's loss is inf (a forward overflow), the fourth's gradients hold an inf."""
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    loss = model(inputs).pow(2).mean() * (math.inf if step == 2 else 1.0)
    scaler.scale(loss).backward()
    if step == 3:
        with torch.no_grad():
            model.weight.grad[0, 0] = math.inf


def _train(replay: bool) -> tuple[list[float], list[Any]]:
    """Six iterations on the CUDA path (``shardscale.testing.cuda_path()``); with ``replay``,
    step + update of iterations 4 to 6 are replays of the third's, captured while its loss was
    inf. SGD, whose step is proportional to the gradient: one divided by another scale than its
    loss's moves otherwise."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=1000)
    graph, scales = None, []
    with cuda_path() as path:
        for step in range(6):
            optimizer.zero_grad(set_to_none=False)
            _iteration(model, scaler, step)
            if graph is not None:
                graph.replay()
            elif replay and step == 2:
                graph = Recording()
                path.capturing = True  # what the scaler's capture check now answers
                with graph:
                    scaler.step(optimizer)
                    scaler.update()
                path.capturing = False
            else:
                scaler.step(optimizer)
                scaler.update()
            scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def test_replayed_step_reads_each_iterations_scale_and_loss_bit() -> None:
    """The replays read each iteration's own loss bit (not the captured one: every replay was
    skipped as a forward overflow) and scale (they back off on the overflow, then divide by the
    scale the next losses were multiplied by): bit for bit the eager run."""
    eager_scales, eager_params = _train(False)
    replayed_scales, replayed_params = _train(True)
    assert eager_scales == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0]
    assert replayed_scales == eager_scales
    for eager, replayed in zip(eager_params, replayed_params, strict=True):
        assert torch.equal(eager, replayed)
