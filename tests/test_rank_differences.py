"""Every rank together where ranks legitimately differ: 2 gloo ranks, each case of issue 54.

Ranks of one job differ in what they hold (an MoE expert no token reached holds no gradient on
one rank and one on another; FSDP2's uneven dim-0 shard leaves a rank an empty tensor) and in
what they run besides the loop (a stats hook whose backend is unreachable on one rank, a
thread reading `stats`). None of it may change what a rank communicates, nor split the step.
torch.amp's own step body (`unscale_`, then `_maybe_opt_step`) must agree as `step()` does.
`tests/test_rank_fuzz.py` searches the whole class; these are its named cases.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import math
import re
import sys
import threading
import warnings
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

import shardscale
from shardscale import AsyncShardedGradScaler, ShardedGradScaler, ShardScaleWarning
from shardscale.testing import cuda_path
from tests.harness import run_ranks
from tests.test_rank_symmetry import DETAIL, recorded_collectives

STEPS = 200  # of the reader thread's run


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, routed: bool) -> torch.Tensor:
        hidden = self.dense(x)
        return self.expert(hidden) if routed else hidden


def _rank_partial_clip(rank: int, world_size: int, variant: str) -> dict[str, Any]:
    """The dense part clipped, the experts not, one optimizer; which ranks' tokens reach the
    expert differs: `"one rank"` (rank 1's), `"disjoint"` (rank 0 dense only, rank 1 the
    expert only)."""
    model = _Moe()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**8, sync_timeout=10.0)
    x = torch.ones(2, 4)
    with recorded_collectives() as log:
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(model(x, routed=rank == 1).sum()).backward()
            if variant == "disjoint" and rank == 1:
                for param in model.dense.parameters():
                    param.grad = None
            scaler.clip_grad_norm_(model.dense.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    return {
        "collectives": log,
        "skipped": scaler.stats.skipped_steps,
        "expert": model.expert.weight.detach().tolist(),
        "dense moved": not torch.equal(model.dense.weight, _Moe().dense.weight),
    }


@pytest.mark.parametrize("variant", ["one rank", "disjoint"])
def test_partial_clip_gradients_held_differently_steps_on_both_ranks(variant: str) -> None:
    rank0, rank1 = run_ranks(_rank_partial_clip, 2, variant, env=DETAIL)
    assert rank0["collectives"] == rank1["collectives"]
    # the clip's at each of 3 steps, and the optimizer's own at its first step after a clip
    # (the clip could not know it); later the clip checks the gradients it leaves out too
    assert len(rank0["collectives"]) == 4
    assert rank0["skipped"] == rank1["skipped"] == 0
    expert_moved = rank1["expert"] != _Moe().expert.weight.tolist()
    assert expert_moved  # rank 1's expert held gradients and stepped
    assert rank0["dense moved"]  # rank 0's dense part held gradients and stepped


def _rank_clip_lists_of_their_own(rank: int, world_size: int, case: str, path: str) -> Any:
    """Clip lists each rank builds from its own gradients (as torch's clip filters), which
    cover a different part of an optimizer on each rank (the cases the rank fuzz found):

    * `"unscale_ first"`: one optimizer, `unscale_()` then a clip of `[a, b]`'s gradients: rank
      0 holds them (and a NaN in `e`, outside the clip), rank 1 none (its list is empty);
    * `"expert optimizer"`: a dense optimizer `[a, d]` and an expert's `[e]`, a clip of `[a, e]`'s
      gradients: rank 0's covers the expert's optimizer, rank 1's (no expert gradient) does not,
      and rank 0 holds `d`'s, which the clip leaves out;
    * `"never scaled, nothing listed"`: rank 1 never calls `scale()` and holds no gradient
      (a pipeline stage whose parameters had none): its clip list is empty.
    """
    a, b, d, e = (nn.Parameter(torch.ones(3)) for _ in range(4))
    if case == "expert optimizer":
        optimizers = [torch.optim.SGD([a, d], lr=0.1), torch.optim.SGD([e], lr=0.1)]
    else:
        optimizers = [torch.optim.SGD([a, b, d, e], lr=0.1)]
    scaler = ShardedGradScaler(init_scale=2.0**4, sync_timeout=10.0)
    events, skipped = [], []
    with cuda_path() if path == "cuda" else nullcontext(), recorded_collectives() as log:
        for step in range(3):
            scale = scaler.get_scale()
            for param in (a, b, d, e):
                param.grad = torch.full((3,), 0.5 * scale)
            if case != "never scaled, nothing listed" or rank == 0:
                scaler.scale((a * 0.0).sum())  # a loss: its gradient is set by hand
            never = case == "never scaled, nothing listed"
            if rank == 1 and (step == 2 or never):
                for param in (a, b, d, e) if case != "expert optimizer" else (d, e):
                    param.grad = None
            if step == 2 and rank == 0 and case == "unscale_ first":
                e.grad[0] = math.nan  # type: ignore[index]
            if case == "unscale_ first":
                scaler.unscale_(optimizers[0])
            listed = [
                p for p in ((a, e) if case == "expert optimizer" else (a, b)) if p.grad is not None
            ]
            try:
                scaler.clip_grad_norm_(listed, 1e9)
                for optimizer in optimizers:
                    scaler.step(optimizer)
                scaler.update()
            except Exception as error:  # the same call, the same error, on every rank
                events.append((step, type(error).__name__))
                break
            skipped.append(scaler.last_step_skipped)
    return {"collectives": log, "events": events, "skipped": skipped, "scale": scaler.get_scale()}


@pytest.mark.parametrize("path", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "case", ["unscale_ first", "expert optimizer", "never scaled, nothing listed"]
)
def test_clip_lists_of_their_own_decide_alike(case: str, path: str) -> None:
    rank0, rank1 = run_ranks(_rank_clip_lists_of_their_own, 2, case, path, env=DETAIL)
    assert rank0 == rank1
    assert rank0["events"] == []
    # the NaN on rank 0 skips the last step on both; else every step is taken
    assert rank0["skipped"] == [False, False, case == "unscale_ first"]


def _rank_torch_step_body(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """torch.amp's GradScaler.step body: unscale_, then _maybe_opt_step; an inf on rank 1 only."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**6, sync_timeout=10.0)
    with cuda_path() if path == "cuda" else nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardScaleWarning)  # the local flags' read
        for step in range(3):  # the first unscale_ agrees at once; the later ones defer
            optimizer.zero_grad()
            scaler.scale(model(torch.ones(2, 3)).sum()).backward()
            if rank == 1 and step == 1:
                model.weight.grad[0, 0] = math.inf  # type: ignore[index]
            scaler.unscale_(optimizer)
            scaler._maybe_opt_step(optimizer, scaler._per_optimizer_states[id(optimizer)])
            scaler.update()
        return {
            "weight": model.weight.detach().tolist(),
            "skipped": scaler.stats.skipped_steps,
            "scale": scaler.get_scale(),
        }


@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_torch_step_body_inf_on_one_rank_skips_on_both_and_weights_stay_equal(path: str) -> None:
    rank0, rank1 = run_ranks(_rank_torch_step_body, 2, path, env=DETAIL)
    assert rank0 == rank1
    assert rank0["skipped"] == 1
    assert rank0["scale"] == 2.0**5


def _rank_empty_shard(rank: int, world_size: int, policy: str) -> dict[str, Any]:
    """A parameter with fewer rows than ranks: rank 0's shard of it is empty; an inf-norm clip
    (and the fit, which reads the largest |gradient|) over it."""
    shard = nn.Parameter(torch.ones(0 if rank == 0 else 1, 3))
    dense = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([shard, dense], lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**4, scale_policy=policy, sync_timeout=10.0)
    for _ in range(2):
        optimizer.zero_grad()
        loss = (dense * 2.0).sum() + (shard * 3.0).sum()
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_([shard, dense], 100.0, norm_type=math.inf)
        scaler.step(optimizer)
        scaler.update()
    return {"norm": float(norm), "dense": dense.detach().tolist(), "steps": scaler.stats.steps}


@pytest.mark.parametrize("policy", ["interval", "fit"])
def test_empty_shard_inf_norm_clip_joins_the_collective_and_steps(policy: str) -> None:
    rank0, rank1 = run_ranks(_rank_empty_shard, 2, policy, env=DETAIL)
    assert rank0 == rank1
    assert rank0["norm"] == 3.0  # the largest |gradient| anywhere: rank 1's shard
    assert rank0["steps"] == 2
    assert rank0["dense"] != [1.0, 1.0, 1.0]


def _rank_failing_hook(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Rank 0's stats hook raises at step 2 (its metrics backend unreachable)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(sync_timeout=10.0)
    seen: list[int] = []

    def hook(stats: shardscale.ScalerStats) -> None:
        seen.append(stats.steps)
        if stats.steps == 2:
            raise ConnectionError("the metrics backend is unreachable")

    if rank == 0:
        scaler.register_stats_hook(hook)
    with (
        cuda_path() if path == "cuda" else nullcontext(),
        warnings.catch_warnings(record=True) as got,
    ):
        warnings.simplefilter("always")
        for _ in range(4):
            optimizer.zero_grad()
            scaler.scale(model(torch.ones(2, 3)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        stats = scaler.stats
    hook_warnings = [str(w.message) for w in got if "stats hook" in str(w.message)]
    return {"steps": stats.steps, "seen": seen, "warnings": hook_warnings}


@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_failing_hook_on_one_rank_warns_and_later_steps_work(path: str) -> None:
    rank0, rank1 = run_ranks(_rank_failing_hook, 2, path, env=DETAIL)
    assert rank0["steps"] == rank1["steps"] == 4
    assert rank0["seen"] == [1, 2, 3, 4]  # it stays registered; the next steps reach it
    assert len(rank0["warnings"]) == 1
    assert re.search(r"step 2: the stats hook .*hook raised ConnectionError", rank0["warnings"][0])
    assert rank1["warnings"] == []


def _rank_reader_thread(rank: int, world_size: int) -> dict[str, Any]:
    """A thread reading `stats` throughout, as docs/reliability.md recommends, on the CUDA path
    (stats in flight, delivered by whichever thread comes first), with a hook counting."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(sync_timeout=10.0)
    delivered: list[int] = []
    scaler.register_stats_hook(lambda stats: delivered.append(stats.steps))
    stop, reads, errors = threading.Event(), [], []
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: races show

    def reader() -> None:
        try:
            while not stop.is_set():
                reads.append(scaler.stats.steps)
        except Exception as error:  # what the test looks for
            errors.append(repr(error))

    with cuda_path():
        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for step in range(STEPS):
                optimizer.zero_grad()
                scaler.scale(model(torch.ones(2, 3)).sum()).backward()
                if step % 3 == 0:
                    model.weight.grad[0, 0] = math.inf  # type: ignore[index]
                scaler.step(optimizer)
                scaler.update()
        finally:
            stop.set()
            thread.join()
        final = scaler.stats
    return {"errors": errors, "delivered": delivered, "reads": reads, "steps": final.steps}


def test_stats_reader_thread_during_updates_sees_whole_steps() -> None:
    for result in run_ranks(_rank_reader_thread, 2):
        assert result["errors"] == []
        assert result["steps"] == STEPS
        assert result["delivered"] == list(range(1, STEPS + 1))  # each step's stats once, in order
        assert result["reads"] == sorted(result["reads"])  # never a step back
        assert len(result["reads"]) > STEPS


def _docstring_example() -> str:
    """The code of AsyncShardedGradScaler's docstring example, as written there."""
    doc = inspect.getdoc(AsyncShardedGradScaler) or ""
    block = doc.split("```python", 1)[1].split("```", 1)[0]
    return inspect.cleandoc(block)


def _rank_async_docstring(rank: int, world_size: int) -> dict[str, Any]:
    """The docstring's loop, run as written, around a model whose weights do not move (the
    optimizer steps its own copy): each step must see exactly its own batch's gradients."""
    torch.manual_seed(rank)
    model = nn.Linear(4, 2)
    batches = [torch.randn(3, 4) for _ in range(12)]
    master_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    seen: list[list[torch.Tensor]] = []

    class Recording(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            seen.append([p.grad.clone() for p in master_params])  # type: ignore[union-attr]
            return super().step(closure)

    optimizer = Recording(master_params, lr=0.0)
    namespace = {
        "AsyncShardedGradScaler": AsyncShardedGradScaler,
        "concurrent": concurrent,
        "master_params": master_params,
        "optimizer": optimizer,
        "model": model,
        "loader": batches,
        "loss_fn": lambda output: output.pow(2).sum(),
    }
    exec(_docstring_example(), namespace)
    expected = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(batch).pow(2).sum().backward()
        expected.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    wrong = sum(
        not all(torch.allclose(a, b, rtol=1e-5, atol=0) for a, b in zip(got, want, strict=True))
        for got, want in zip(seen, expected, strict=True)
    )
    return {"steps": len(seen), "wrong": wrong}


def test_async_docstring_example_steps_each_iteration_on_its_own_gradients() -> None:
    assert run_ranks(_rank_async_docstring, 2) == [{"steps": 12, "wrong": 0}] * 2
