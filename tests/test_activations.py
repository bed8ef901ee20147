"""`shardscale.watch_activations`: where in a model fp16 loses gradient, module by module.

A block scaled down at initialisation (LayerScale's 1e-5, a zero-initialised gate) is where
activation gradients fall below fp16's normal range first: the planted model gates its third
block by 2^-22, and a backward under fp16 autocast at scale 2^8 loses that block's gradient,
while the parameters' gradients (fp32) and every other block look healthy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import shardscale
from tests.harness import run_ranks

GATED = 2  # the planted block


class Block(nn.Module):
    """A residual MLP block whose branch is multiplied by `gate`."""

    def __init__(self, width: int, gate: float = 1.0) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Linear(4 * width, width),
        )
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, gate: float, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, gate if i == GATED else 1.0) for i in range(4)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _watched_backward(model: nn.Module, seed: int = 0, scale: float = 2.0**8) -> Any:
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = (
        torch.randn(32, 64, generator=generator),
        torch.randn(32, 1, generator=generator),
    )
    with shardscale.watch_activations(model) as watch:
        with torch.autocast("cpu", dtype=torch.float16):
            outputs = model(inputs)
        (((outputs.float() - targets) ** 2).mean() * scale).backward()
    return watch


def _net(gate: float) -> Net:
    torch.manual_seed(0)
    return Net(gate)


def test_watch_names_a_module_of_the_gated_block_first() -> None:
    watch = _watched_backward(_net(2.0**-22))
    worst = watch.records[0]
    assert worst.name.startswith(f"blocks.{GATED}.")
    assert worst.fraction >= 0.5
    assert worst.dtype == "float16"
    gated = [r for r in watch.records if r.name.startswith(f"blocks.{GATED}.")]
    others = [r for r in watch.records if not r.name.startswith(f"blocks.{GATED}.")]
    assert min(r.fraction for r in gated) > max(r.fraction for r in others)


def test_watch_of_the_unplanted_model_finds_no_module_above_five_percent() -> None:
    watch = _watched_backward(_net(1.0))
    assert {r.name for r in watch.records} >= {"blocks.0.fc1", "blocks.3.fc2", "head"}
    assert max(r.fraction for r in watch.records) <= 0.05


def test_watch_counts_what_its_records_say() -> None:
    """One module's record equals the definition applied to the gradient of its output."""
    model, seen = _net(2.0**-22), {}

    def keep(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: seen.setdefault("g", grad.clone()))

    model.blocks[GATED].fc2.register_forward_hook(keep)
    record = next(r for r in _watched_backward(model).records if r.name == f"blocks.{GATED}.fc2")
    grad = seen["g"].float()
    magnitudes = grad.abs()
    counted = (magnitudes >= 2.0**-64) & (magnitudes <= 2.0**64)
    assert record.num_nonzero == int(counted.sum())
    assert record.num_underflowing == int((counted & (magnitudes < 2.0**-14)).sum())
    assert record.num_zeros == int((grad == 0).sum())


def test_watch_costs_nothing_outside_its_context() -> None:
    model = _net(1.0)
    watch = _watched_backward(model)
    for module in model.modules():
        assert not module._forward_hooks  # every hook removed on closing
    before = list(watch.records)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 64)).float().sum()
    loss.backward()  # a backward after the watch closed changes nothing
    assert watch.records == before


def test_watch_counts_a_module_called_twice_once_by_name() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(self.shared(x))

    model = Twice()
    with shardscale.watch_activations(model) as watch:
        model(torch.randn(4, 8)).sum().backward()
    ((record,),) = [[r for r in watch.records if r.name == "shared"]]
    assert record.num_nonzero + record.num_zeros == 2 * 4 * 8  # both calls' outputs
    assert record.dtype == "float32"


def test_watch_through_torch_compile_names_the_inner_modules() -> None:
    """A compiled model (compiled before the watch: its hooks make dynamo recompile once)."""
    model = torch.compile(_net(2.0**-22), backend="eager")
    model(torch.randn(2, 64))
    records = _watched_backward(model).records  # type: ignore[arg-type]
    assert records[0].name.startswith(f"blocks.{GATED}.")
    assert not any("_orig_mod" in record.name for record in records)


def test_watch_refuses_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got Tensor"):
        shardscale.watch_activations(torch.zeros(2))  # type: ignore[arg-type]


def _rank_watch(rank: int, world_size: int, kind: str) -> list[tuple[Any, ...]]:
    """The planted model wrapped as `kind`, each rank its own batch: the records."""
    torch.manual_seed(0)
    model: nn.Module = Net(2.0**-22)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:  # type: ignore[attr-defined]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "checkpointed":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        inner = model
        for i, block in enumerate(inner.blocks):  # type: ignore[attr-defined]
            inner.blocks[i] = checkpoint_wrapper(block)  # type: ignore[index]
    records = _watched_backward(model, seed=rank).records
    return [(r.name, r.num_underflowing, r.num_nonzero, r.num_zeros) for r in records]


@pytest.mark.parametrize("kind", ["ddp", "fsdp1", "fsdp2", "checkpointed"])
def test_watch_names_the_users_modules_through_wrappers_alike_on_every_rank(kind: str) -> None:
    rank0, rank1 = run_ranks(_rank_watch, 2, kind)
    assert rank0 == rank1  # one gather: every rank holds every rank's counts
    names = [name for name, *_ in rank0]
    assert names[0].startswith(f"blocks.{GATED}.")
    assert "head" in names
    assert not any("module." in name or "_wrapped_module" in name for name in names)
    plain = run_ranks(_rank_watch, 2, "plain")[0]
    by_name = {name: counts for name, *counts in plain}
    for name, *counts in rank0:  # the same gradients, whatever wraps the model
        assert math.isclose(counts[0], by_name[name][0], rel_tol=0.02, abs_tol=2), name
