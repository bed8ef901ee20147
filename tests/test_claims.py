"""What the docs say torch's scalers do, layout by layout, checked beside shardscale's.

docs/index.md ("Torch's scalers, layout by layout") and the layout rows of README.md's short
table ("Differences from torch's scalers") compare ``torch.amp.GradScaler`` and torch's FSDP
``ShardedGradScaler`` with ours, layout by layout. Each cell of those tables is asserted here
(torch 2.13, gloo, 2 ranks), so the day a torch release changes one, this module fails and the
docs get corrected.

One case: a fresh model of one layout and one scaler, two iterations: a clean one, then one
with an inf written into rank 1's local gradient shard (after backward, before the step). Per
rank: did the step move the parameters this rank holds, the scale after ``update()``, and the
collectives issued by ``step()`` + ``update()`` (and ``unscale_``/clip where the case calls them)
in the second iteration. Outcomes: *agrees* (every rank skipped, same scale), *diverges* (some
rank stepped while another skipped), *raises*, and, in their own tests, *hangs* (bounded by a
gloo timeout of a few seconds).

Collectives are counted with ``shardscale.count_collectives``, which counts ``c10d::`` operators:
every collective, eager or functional (DTensor's), runs exactly one (checked here against the
process group's own count).

The cases of the 2-rank table run one after another in one pair of processes, in one test (the
profiler costs ~2 s per process to start; a module fixture would run once per xdist worker).
"""

from __future__ import annotations

import inspect
import math
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.distributed.tensor import DTensor

from shardscale import ShardedGradScaler, count_collectives
from tests import pipelines
from tests.harness import run_ranks
from tests.setups import local_grad_values, mlp, plant_in

AMP = "torch.amp"
SHARDED = "torch sharded"
OURS = "shardscale"
SCALE = 1024.0
OVERFLOW_RANK = 1


@dataclass(frozen=True)
class Case:
    layout: str
    flavour: str
    scaler: str
    plant: str = "grad"
    """Where the inf goes: "grad" (rank 1's local gradient shard, second iteration), "input"
    (rank 1's batch, second iteration) or "every rank" (every rank's shard, every iteration)."""


def _scaler(name: str) -> Any:
    kwargs: dict[str, Any] = {"init_scale": SCALE, "growth_interval": 1000}
    if name == AMP:
        return torch.amp.GradScaler("cpu", **kwargs)
    if name == SHARDED:
        return TorchShardedGradScaler("cpu", **kwargs)
    return ShardedGradScaler(**kwargs)


def _optimizer(params: Any, flavour: str) -> torch.optim.Optimizer:
    """AdamW, with an eps fp16 parameters can hold: the default 1e-8 is 0 in fp16, and a zero
    gradient then steps its parameter to 0/0 = NaN (the fp16 layer of fsdp2_two_dtypes would
    make the next loss NaN on every rank, whatever was planted)."""
    fused = flavour in ("fused", "unscale_+fused")
    options = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4, **options)


class _Job:
    """One rank's model, optimizer and data for a layout."""

    def __init__(self, layout: str, flavour: str, scaler: Any, rank: int, world_size: int):
        self.layout, self.flavour, self.rank = layout, flavour, rank
        self.pipeline: pipelines.Pipeline | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        if layout == "pipeline":
            self.pipeline = pipelines.build("pp", "gpipe", scaler, rank, world_size)
            self.params = self.pipeline.parameters()
            self.optimizers = [_optimizer(self.params, flavour)]
            return
        self.model = self._wrap(layout, rank, world_size)
        self.params = list(self.model.parameters())
        if layout == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            fused = flavour == "fused"
            options = {"fused": True} if fused else {"foreach": True}
            self.optimizers = [
                ZeroRedundancyOptimizer(
                    self.params, optimizer_class=torch.optim.AdamW, lr=0.01, **options
                )
            ]
        elif flavour == "two optimizers":
            self.optimizers = [
                _optimizer(self.model[0].parameters(), "foreach"),
                _optimizer(self.model[2].parameters(), "foreach"),
            ]
        elif layout == "tp_replicated_first":
            # A replicated parameter first in the optimizer (here the row-wise layer's bias).
            self.optimizers = [_optimizer(self.params[::-1], flavour)]
        else:
            self.optimizers = [_optimizer(self.params, flavour)]

    @staticmethod
    def _wrap(layout: str, rank: int, world_size: int) -> nn.Module:
        model = mlp()
        if layout == "plain_shards":
            # Each rank's parameters are its own plain tensors (hand-sharded: a Megatron-style
            # tensor-parallel slice, an expert): nothing replicates them.
            torch.manual_seed(rank)
            return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        if layout in ("ddp", "zero"):
            return nn.parallel.DistributedDataParallel(model)
        if layout == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        if layout.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            options: dict[str, Any] = {"mesh": mesh}
            if layout == "fsdp2_mp":
                options["mp_policy"] = MixedPrecisionPolicy(
                    param_dtype=torch.float16, reduce_dtype=torch.float32
                )
            if layout == "fsdp2_two_dtypes":
                model[2].half()
                model[2].register_forward_pre_hook(lambda module, args: (args[0].half(),))
            for layer in (model[0], model[2], model):
                fully_shard(layer, **options)
            return model
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def forward_backward(self, step: int, scaler: Any, inf_input: bool) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            self.pipeline.run(step, scaler)
            return
        # tensor parallel: every rank of the mesh must see the same batch
        same = self.layout.startswith("tp")
        generator = torch.Generator().manual_seed(100 * step + (0 if same else self.rank))
        inputs = torch.randn(4, 16, generator=generator)
        if inf_input:
            inputs[0, 0] = math.inf
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.model(inputs).float().pow(2).mean()
        scaler.scale(loss).backward()

    @torch.no_grad()
    def plant(self) -> None:
        """An inf in one element of this rank's local gradient shard."""
        if self.layout == "tp_replicated_first":
            local_grad_values(self.params[0]).view(-1)[0] = math.inf  # type: ignore[union-attr]
        else:
            plant_in(self.params, math.inf)

    def step(self, scaler: Any) -> None:
        """The case's calls between backward and the next iteration."""
        optimizer = self.optimizers[0]
        if self.flavour == "unscale_+fused":
            scaler.unscale_(optimizer)
        if self.flavour == "clip":
            if isinstance(scaler, ShardedGradScaler):
                scaler.clip_grad_norm_(self.params, 1.0)
            else:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        if self.flavour == "two optimizers" and isinstance(scaler, ShardedGradScaler):
            scaler.step(self.optimizers)  # both in one call: one collective
        else:
            for each in self.optimizers:
                scaler.step(each)
        scaler.update()

    def local_params(self) -> list[torch.Tensor]:
        return [
            (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in self.params
        ]


def _collectives(counts: Counter[str]) -> int:
    """The collectives issued, from ``count_collectives``.

    ZeroRedundancyOptimizer's own broadcasts (its step shares each rank's updated parameters)
    are the optimizer's, not the scaler's: left out.
    """
    return sum(n for name, n in counts.items() if "broadcast" not in name)


def _any_rank(flag: bool) -> bool:
    """Whether any rank says ``flag``; keeps the ranks in step when one has raised."""
    tensor = torch.tensor([float(flag)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def _run_case(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    error = None
    try:
        scaler = _scaler(case.scaler)
        job = _Job(case.layout, case.flavour, scaler, rank, world_size)
    except Exception as caught:  # a layout that no longer builds
        error = f"{type(caught).__name__}: {caught}"
    if _any_rank(error is not None):
        return {"raised": error, "steps": steps}
    for step in range(2):
        overflow = step == 1 and rank == OVERFLOW_RANK
        try:
            job.forward_backward(step, scaler, inf_input=overflow and case.plant == "input")
            if (overflow and case.plant == "grad") or case.plant == "every rank":
                job.plant()
            before = job.local_params()
            with count_collectives() as counts:
                job.step(scaler)
            moved = [not torch.equal(b, a) for b, a in zip(before, job.local_params(), strict=True)]
            steps.append(
                {
                    "moved": "all" if all(moved) else "none" if not any(moved) else "some",
                    "scale": scaler.get_scale(),
                    "collectives": _collectives(counts),
                }
            )
        except Exception as caught:
            error = f"{type(caught).__name__}: {str(caught).splitlines()[0]}"
        if _any_rank(error is not None):
            break
    nan = any(not bool(torch.isfinite(p).all()) for p in job.local_params())
    return {"raised": error, "steps": steps, "nan_params": nan}


def _rank_matrix(rank: int, world_size: int, cases: list[Case]) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "cases": [_run_case(rank, world_size, case) for case in cases],
        "counting": _counting_rule(),
        "loaded_scales": _load_different_states(rank),
    }


def _counting_rule() -> dict[str, Any]:
    """One functional and one eager all-reduce, counted by the process group and by us."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    assert group is not None
    before = group._get_sequence_number_for_group()  # what the process group counts
    with count_collectives() as counts:
        funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", group))
        dist.all_reduce(torch.ones(2))
    return {
        "counts": dict(counts),
        "issued": group._get_sequence_number_for_group() - before,
        "rule": sum(counts.values()),
    }


def _load_different_states(rank: int) -> list[float]:
    """Each rank loads its own scale into each of torch's scalers."""
    scales = []
    for make in (torch.amp.GradScaler, TorchShardedGradScaler):
        scaler = make("cpu")
        scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0 ** (10 + rank)})
        scales.append(scaler.get_scale())
    return scales


def _outcome(per_rank: list[dict[str, Any]]) -> tuple[str, int | None]:
    """(agrees | agrees, scale held | diverges | raises, the collectives of the second iteration,
    the same on every rank). *Scale held*: every rank skipped a forward overflow (an inf in the
    batch makes the loss inf), which ours tells apart and does not back off for."""
    if any(r["raised"] for r in per_rank):
        return "raises", None
    clean = [r["steps"][0] for r in per_rank]
    assert all(s["moved"] == "all" and s["scale"] == SCALE for s in clean), clean
    second = [r["steps"][1] for r in per_rank]
    counts = {s["collectives"] for s in second}
    assert len(counts) == 1, second  # every rank issued the same collectives
    decisions = {(s["moved"], s["scale"]) for s in second}
    if decisions == {("none", SCALE)}:
        return "agrees, scale held", counts.pop()
    if len(decisions) == 1:
        assert second[0]["scale"] == SCALE / 2, second  # every rank saw the overflow
        return "agrees", counts.pop()
    assert decisions == {("all", SCALE), ("none", SCALE / 2)}, second  # one stepped, one skipped
    return "diverges", counts.pop()


# (layout, flavour) -> {scaler: (outcome, collectives per step)}: docs/index.md's table.
EXPECTED: dict[tuple[str, str], dict[str, tuple[str, int | None]]] = {
    # DDP, with an inf only rank 1 sees (after DDP's all-reduce): torch.amp checks locally.
    ("ddp", "foreach"): {AMP: ("diverges", 0), SHARDED: ("agrees", 1), OURS: ("agrees", 1)},
    ("ddp", "fused"): {AMP: ("diverges", 0), SHARDED: ("diverges", 0), OURS: ("agrees", 1)},
    ("ddp", "unscale_+fused"): {SHARDED: ("raises", None), OURS: ("agrees", 1)},
    ("fsdp1", "foreach"): {AMP: ("diverges", 0), SHARDED: ("agrees", 1), OURS: ("agrees", 1)},
    ("fsdp1", "fused"): {AMP: ("diverges", 0), SHARDED: ("diverges", 0), OURS: ("agrees", 1)},
    ("plain_shards", "foreach"): {
        AMP: ("diverges", 0),
        SHARDED: ("agrees", 1),
        OURS: ("agrees", 1),
    },
    ("plain_shards", "fused"): {
        AMP: ("diverges", 0),
        SHARDED: ("diverges", 0),
        OURS: ("agrees", 1),
    },
    # FSDP2 / DTensor: DTensor all-reduces found_inf inside torch's check.
    ("fsdp2", "foreach"): {AMP: ("agrees", 1), SHARDED: ("agrees", 2), OURS: ("agrees", 1)},
    ("fsdp2", "fused"): {AMP: ("agrees", 1), SHARDED: ("agrees", 1), OURS: ("agrees", 1)},
    ("fsdp2", "unscale_+fused"): {
        AMP: ("agrees", 1),
        SHARDED: ("raises", None),
        OURS: ("agrees", 1),
    },
    ("fsdp2_mp", "foreach"): {AMP: ("agrees", 1), SHARDED: ("agrees", 2), OURS: ("agrees", 1)},
    ("fsdp2_mp", "fused"): {AMP: ("agrees", 1), SHARDED: ("agrees", 1), OURS: ("agrees", 1)},
    # fp32 and fp16 parameters: one DTensor reduction per (device, dtype) group of gradients;
    # torch.amp refuses fp16 gradients ("Attempting to unscale FP16 gradients.")
    ("fsdp2_two_dtypes", "foreach"): {
        AMP: ("raises", None),
        SHARDED: ("agrees", 3),
        OURS: ("agrees", 1),
    },
    ("fsdp2", "clip"): {AMP: ("agrees", 2), SHARDED: ("agrees", 3), OURS: ("agrees", 1)},
    ("fsdp2", "two optimizers"): {
        AMP: ("agrees", 2),
        SHARDED: ("agrees", 4),
        OURS: ("agrees", 1),
    },
    ("tp", "foreach"): {AMP: ("agrees", 1), SHARDED: ("agrees", 2), OURS: ("agrees", 1)},
    ("tp", "fused"): {AMP: ("agrees", 1), SHARDED: ("agrees", 1), OURS: ("agrees", 1)},
    # DTensor reduces found_inf by the placements of the FIRST gradient it is given: a
    # replicated one first and nothing is reduced.
    ("tp_replicated_first", "foreach"): {
        AMP: ("diverges", 0),
        SHARDED: ("agrees", 1),
        OURS: ("agrees", 1),
    },
    ("tp_replicated_first", "fused"): {
        AMP: ("diverges", 0),
        SHARDED: ("diverges", 0),
        OURS: ("agrees", 1),
    },
    ("zero", "foreach"): {SHARDED: ("agrees", 1), OURS: ("agrees", 1)},
    ("zero", "fused"): {SHARDED: ("agrees", 1), OURS: ("agrees", 1)},
    # torch.amp: the stage that computes no loss raises; torch sharded: test_pipeline_torch_*
    ("pipeline", "foreach"): {AMP: ("raises", None), OURS: ("agrees", 1)},
    ("pipeline", "fused"): {OURS: ("agrees", 1)},
}
CASES = [Case(layout, flavour, s) for (layout, flavour), row in EXPECTED.items() for s in row]
# DDP, an overflow in rank 1's backward (an inf in its batch): DDP's all-reduce sums it into
# every rank's gradients, so every scaler sees it. Rank 1's loss is inf too: a forward overflow,
# for which ours holds the scale (torch's halve it).
NATURAL = {
    Case("ddp", "foreach", AMP, plant="input"): ("agrees", 0),
    Case("ddp", "foreach", SHARDED, plant="input"): ("agrees", 1),
    Case("ddp", "foreach", OURS, plant="input"): ("agrees, scale held", 1),
}
# torch's sharded scaler, unscale_() then a fused AdamW, an inf on every rank: found_inf sums
# to 2.0, and the fused kernel, which skips only on 1.0, steps with the infs before the raise.
SUMMED = Case("ddp", "unscale_+fused", SHARDED, plant="every rank")


def test_torch_scalers_and_ours_layout_by_layout_as_the_docs_say() -> None:
    cases = [*CASES, *NATURAL, SUMMED]
    ranks = run_ranks(_rank_matrix, 2, cases, timeout_s=240, group_timeout_s=20)
    measured = {case: [rank["cases"][i] for rank in ranks] for i, case in enumerate(cases)}

    # the tables (docs/index.md, README.md's layout rows): every cell that differs, named
    expected = {c: EXPECTED[(c.layout, c.flavour)][c.scaler] for c in CASES}
    expected.update(NATURAL)
    wrong = [
        f"{c.layout}, {c.flavour}, {c.scaler} (inf in rank 1's {c.plant}): the docs say "
        f"{expected[c]}, measured {_outcome(measured[c])}"
        for c in expected
        if _outcome(measured[c]) != expected[c]
    ]
    assert not wrong, "\n".join(wrong)
    assert {expected[c][1] for c in expected if c.scaler == OURS} == {1}
    ours = {expected[c][0] for c in expected if c.scaler == OURS}
    assert ours <= {"agrees", "agrees, scale held"}, ours

    # how torch's scalers raise
    for layout in ("ddp", "fsdp2"):
        for rank in measured[Case(layout, "unscale_+fused", SHARDED)]:
            assert rank["raised"] == (
                "RuntimeError: output with shape [] doesn't match the broadcast shape [1]"
            )
            assert rank["steps"] == []  # at the first, clean, step
            assert not rank["nan_params"]  # found_inf was 0.0: the fused kernel stepped cleanly
    for rank in measured[SUMMED]:
        assert rank["raised"] == (
            "RuntimeError: output with shape [] doesn't match the broadcast shape [1]"
        )
        assert rank["nan_params"]  # stepped with found_inf = 2.0, then raised
    for rank in measured[Case("fsdp2_two_dtypes", "foreach", AMP)]:
        assert rank["raised"] == "ValueError: Attempting to unscale FP16 gradients."
    first, last = measured[Case("pipeline", "foreach", AMP)]
    assert first["raised"].startswith("AssertionError: Attempted step but _scale is None")
    assert first["steps"] == []
    assert last["raised"] is None  # the last stage stepped alone
    assert last["steps"] == [{"moved": "all", "scale": SCALE, "collectives": 0}]

    for rank in ranks:
        # count_collectives counts what the process group counts: one functional all-reduce
        # (which records a _c10d_functional:: operator around its c10d:: one) and one eager
        assert rank["counting"]["issued"] == 2, rank["counting"]
        assert rank["counting"]["rule"] == 2, rank["counting"]
    # each rank loaded its own scale into torch's scalers, and nothing noticed
    assert [rank["loaded_scales"] for rank in ranks] == [[1024.0, 1024.0], [2048.0, 2048.0]]


# ------------------------------------------------------------------ hangs, bounded by gloo

HANG_TIMEOUT_S = 3.0
HOLD_S = HANG_TIMEOUT_S + 2.0
"""How long a rank stays in the group after its part: the other's wait must run out first
(a rank that left would end it sooner, with another error)."""


def _time_out_from_here(*groups: dist.ProcessGroup) -> None:
    """Shorten the process groups' timeout to HANG_TIMEOUT_S, once both ranks are here.

    Setup (first imports, FSDP's and the pipeline's first collectives) runs under the harness's
    30 s, so a rank slowed down on a loaded machine cannot time out there; the wait under test
    then runs out after a few seconds.
    """
    dist.barrier()
    for group in {dist.group.WORLD, *groups}:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=HANG_TIMEOUT_S), group)


def _failure(error: BaseException, start: float) -> dict[str, Any]:
    return {
        "error": f"{type(error).__name__}: {str(error).splitlines()[0]}",
        "after_s": time.monotonic() - start,
    }


def _rank_pipeline_torch_sharded(rank: int, world_size: int) -> dict[str, Any]:
    """The stage without a loss raises in step(); the last stage waits in unscale_'s all-reduce."""
    scaler = TorchShardedGradScaler("cpu", init_scale=SCALE)
    pipeline = pipelines.build("pp", "gpipe", scaler, rank, world_size)
    optimizer = _optimizer(pipeline.parameters(), "foreach")
    pipeline.run(0, scaler)
    _time_out_from_here()
    start = time.monotonic()
    try:
        scaler.step(optimizer)
    except Exception as error:
        result = _failure(error, start)
        if not pipeline.last:
            time.sleep(HOLD_S)
        return result
    return {"error": None}


def test_pipeline_torch_sharded_stage_without_loss_raises_last_stage_hangs_until_timeout() -> None:
    first, last = run_ranks(_rank_pipeline_torch_sharded, 2, timeout_s=90)
    assert first["error"].startswith("AssertionError: Attempted step but _scale is None")
    assert first["after_s"] < HANG_TIMEOUT_S  # at once, waiting for no one
    # the last stage is released by nothing but the process group's timeout
    assert last["error"].startswith("RuntimeError: "), last
    assert "Timed out waiting 3000ms" in last["error"], last
    assert HANG_TIMEOUT_S - 0.2 < last["after_s"] < HANG_TIMEOUT_S + 10.0, last


def _rank_fsdp2_torch_amp_rank_missing(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 and torch.amp: rank 1 takes another code path and never steps."""
    job = _Job("fsdp2", "foreach", None, rank, world_size)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    job.forward_backward(0, scaler, inf_input=False)
    _time_out_from_here(job.params[0].device_mesh.get_group())
    if rank == 1:
        time.sleep(HOLD_S)  # in the group, elsewhere
        return {"error": None}
    start = time.monotonic()
    try:
        scaler.step(job.optimizers[0])
    except Exception as error:
        return _failure(error, start)
    return {"error": "step() returned"}


def test_fsdp2_torch_amp_missing_rank_waits_in_dtensor_all_reduce_until_timeout() -> None:
    waiting, _ = run_ranks(_rank_fsdp2_torch_amp_rank_missing, 2, timeout_s=90)
    assert waiting["error"].startswith("RuntimeError: "), waiting
    assert "Timed out waiting 3000ms" in waiting["error"], waiting
    assert HANG_TIMEOUT_S - 0.2 < waiting["after_s"] < HANG_TIMEOUT_S + 10.0, waiting


def _rank_zero_torch_amp(rank: int, world_size: int) -> dict[str, Any]:
    """DDP + ZeroRedundancyOptimizer, torch.amp, an inf that rank 1 alone sees at step 1."""
    job = _Job("zero", "foreach", None, rank, world_size)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scales: list[float] = []
    start = time.monotonic()
    try:
        for step in range(3):
            if step == 1:
                _time_out_from_here()
            start = time.monotonic()
            job.forward_backward(step, scaler, inf_input=False)
            if step == 1 and rank == OVERFLOW_RANK:
                job.plant()
            scaler.step(job.optimizers[0])
            scaler.update()
            scales.append(scaler.get_scale())
    except Exception as error:
        failure = _failure(error, start)
        time.sleep(HOLD_S)
        return {"scales": scales, **failure}
    return {"scales": scales, "error": None}


def test_zero_torch_amp_one_rank_skips_alone_and_the_job_dies_at_the_group_timeout() -> None:
    stepped, skipped = run_ranks(_rank_zero_torch_amp, 2, timeout_s=90)
    # rank 1 skipped step 1 (scale halved) and went on; rank 0 stepped into ZeRO's broadcast
    assert skipped["scales"] == [SCALE, SCALE / 2], skipped
    assert stepped["scales"] == [SCALE], stepped
    # Both released by the process group's timeout alone: the first to reach it reports the
    # timeout, and gloo then closes its connections, which the other may report instead.
    errors = [rank["error"].lower() for rank in (stepped, skipped)]
    assert any("timeout" in error or "timed out" in error for error in errors), errors
    for rank in (stepped, skipped):
        assert rank["error"].startswith("RuntimeError: "), rank
        assert any(
            words in rank["error"].lower()
            for words in ("timeout", "timed out", "connection closed by peer")
        ), rank
        assert rank["after_s"] < HANG_TIMEOUT_S + 10.0, rank
    assert max(stepped["after_s"], skipped["after_s"]) > HANG_TIMEOUT_S - 0.2


def test_torch_gloo_default_group_timeout_is_30_minutes() -> None:
    """What a rank that never arrives costs torch's scalers by default on gloo."""
    from torch.distributed.constants import default_pg_timeout

    assert default_pg_timeout == timedelta(minutes=30)


# ------------------------------------------------------------------ the rest of the table


def _overflow_forever(scaler: Any, steps: int) -> tuple[list[float], bool]:
    """``steps`` overflowing iterations, then a clean one: the scales, and NaN weights?"""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = []
    for step in range(steps + 1):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).mean()).backward()
        if step < steps:
            plant_in(model.parameters(), math.inf)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, any(p.isnan().any().item() for p in model.parameters())


def test_torch_amp_endless_overflows_scale_reaches_zero_then_nan_weights() -> None:
    scales, nan = _overflow_forever(torch.amp.GradScaler("cpu", init_scale=2.0**-145), 6)
    assert scales[-2:] == [0.0, 0.0]
    assert nan  # scale 0: finite zero gradients times 1/0 pass the check as NaN


def test_torch_sharded_endless_overflows_scale_reaches_zero(
    world_of_one: dist.ProcessGroup,
) -> None:
    scaler = TorchShardedGradScaler("cpu", init_scale=2.0**-145)
    scales, nan = _overflow_forever(scaler, 6)
    assert scales[-2:] == [0.0, 0.0]
    assert nan


def test_torch_sharded_in_place_update_breaks_a_loss_scaled_before_it(
    world_of_one: dist.ProcessGroup,
) -> None:
    """(torch.amp.GradScaler: tests/test_observability.py.)"""
    scaler = TorchShardedGradScaler("cpu", init_scale=8.0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = scaler.scale(model(torch.ones(2, 16)).sum())
    second = scaler.scale(model(torch.ones(2, 16)).sum())
    first.backward()
    plant_in(model.parameters(), math.inf)
    scaler.step(optimizer)
    scaler.update()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        second.backward()


def test_torch_scalers_signatures_cuda_default_positional_factors_swapped_no_extras() -> None:
    amp = inspect.signature(torch.amp.GradScaler.__init__).parameters
    sharded = inspect.signature(TorchShardedGradScaler.__init__).parameters
    for params in (amp, sharded):
        assert params["device"].default == "cuda"
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params.values())
        assert not {"hysteresis", "max_scale", "min_scale", "dynamic"} & set(params)
    assert list(amp)[3:5] == ["growth_factor", "backoff_factor"]
    assert list(sharded)[3:5] == ["backoff_factor", "growth_factor"]
    for cls in (torch.amp.GradScaler, TorchShardedGradScaler):
        assert not hasattr(cls, "last_step_skipped")
        assert not hasattr(cls, "clip_grad_norm_")
