"""A loss that is itself inf/NaN (a forward overflow) skips the step on every rank with the scale
held; `step(closure=...)` reruns a batch whose gradients overflowed instead of dropping it.

Each behaviour on 2 real gloo ranks, beside torch's scalers where the claim is about them."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardscale import (
    AsyncShardedGradScaler,
    NonFiniteGrad,
    ShardedGradScaler,
    ShardScaleSkipError,
)
from tests.harness import run_ranks

BAD_STEPS = (1, 2, 3)  # steps whose loss is inf on rank 1


def _replicas(seed: int = 0) -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _all_reduce_grads(model: nn.Module) -> None:
    """What DDP does: the replicas' gradients summed, a NaN on one rank reaching all."""
    for param in model.parameters():
        assert param.grad is not None
        dist.all_reduce(param.grad)


def _rank_forward_overflow(rank: int, world_size: int, which: str) -> dict[str, Any]:
    model, optimizer = _replicas()
    scaler: Any = (
        ShardedGradScaler(init_scale=2.0**10, locate_overflow=True)
        if which == "ours"
        else torch.amp.GradScaler("cpu", init_scale=2.0**10)
    )
    scales, stepped = [], []
    for step in range(5):
        optimizer.zero_grad()
        loss = model(torch.ones(3, 4)).pow(2).mean()
        if rank == 1 and step in BAD_STEPS:
            loss = loss * math.inf  # the forward overflowed on this rank only
        scaler.scale(loss).backward()
        _all_reduce_grads(model)
        before = model.weight.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        stepped.append(not torch.equal(before, model.weight.detach()))
        scales.append(scaler.get_scale())
    result: dict[str, Any] = {"scales": scales, "stepped": stepped}
    if which == "ours":
        stats = scaler.stats
        result.update(
            forward=stats.forward_overflows,
            skipped=stats.skipped_steps,
            located=[str(r) for r in scaler.last_overflow or [] if r.name == "<loss>"],
            state=scaler.state_dict(),
        )
    return result


def test_forward_overflow_on_one_rank_holds_the_scale_on_every_rank() -> None:
    ours = run_ranks(_rank_forward_overflow, 2, "ours")
    clean = [step not in BAD_STEPS for step in range(5)]
    for result in ours:
        assert result["stepped"] == clean  # every rank skipped the bad steps, took the rest
        assert result["scales"] == [2.0**10] * 5  # held: backing off cannot fix a forward
        assert (result["forward"], result["skipped"]) == (3, 3)
        assert result["located"] == ["rank 1: <loss> (1 inf, 0 NaN)"]  # which rank's loss
        assert (result["state"]["forward_overflows"], result["state"]["skipped_steps"]) == (3, 3)
    assert ours[0]["state"] == ours[1]["state"]
    theirs = run_ranks(_rank_forward_overflow, 2, "torch")
    for result in theirs:  # torch's scaler: the same skips, and the scale halved each time
        assert result["stepped"] == clean
        assert result["scales"] == [2.0**10, 2.0**9, 2.0**8, 2.0**7, 2.0**7]


def test_forward_overflow_is_logged_as_one_and_counts_towards_the_skip_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, optimizer = _replicas()
    scaler = ShardedGradScaler(max_consecutive_skips=2)
    caplog.set_level(logging.INFO, logger="shardscale")

    def nan_step() -> None:
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 4)).sum() * math.nan).backward()
        scaler.step(optimizer)
        scaler.update()

    nan_step()
    nan_step()
    with pytest.raises(ShardScaleSkipError, match=r"3 forward overflow\(s\)"):
        nan_step()
    assert "the loss itself was non-finite on some rank (a forward overflow" in caplog.text
    assert scaler.get_scale() == 2.0**16


def test_forward_overflow_in_one_micro_batch_of_several_is_seen() -> None:
    model, optimizer = _replicas()
    scaler = ShardedGradScaler(init_scale=8.0)
    for micro_batch in range(3):  # gradient accumulation: every scale() call is checked
        loss = model(torch.ones(1, 4)).sum()
        scaler.scale(loss * (math.inf if micro_batch == 1 else 1.0)).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_step_skipped
    assert (scaler.stats.forward_overflows, scaler.get_scale()) == (1, 8.0)


def _fp16_weights(rank: int, scale: float, retry: bool, max_retries: int = 3) -> dict[str, Any]:
    """One step of a model with fp16 weights: rank 1's gradient is 1.5 * S, which fp16 holds at
    S = 2**15 (49152) but not at 2**16 (98304 > 65504): a real gradient overflow, on one rank."""
    weight = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    optimizer = torch.optim.SGD([weight], lr=2.0**-10)
    scaler = ShardedGradScaler(init_scale=scale, growth_interval=1000, max_retries=max_retries)
    x = torch.full((4,), 1.5 if rank == 1 else 0.5)
    runs = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (weight.float() * x).sum()
        scaler.scale(loss).backward()
        runs.append(scaler.get_scale())
        return loss

    if retry:
        loss = scaler.step(optimizer, closure=closure)
    else:
        closure()
        loss = None
        scaler.step(optimizer)
    scaler.update()
    stats = scaler.stats
    return {
        "weight": weight.tolist(),
        "runs": runs,
        "loss": None if loss is None else float(loss),
        "skipped": stats.skipped_steps,
        "retries": stats.retries,
        "scale": scaler.get_scale(),
    }


def _rank_retry(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "retried": _fp16_weights(rank, 2.0**16, retry=True),
        "at_settled_scale": _fp16_weights(rank, 2.0**15, retry=False),
        "without_retry": _fp16_weights(rank, 2.0**16, retry=False),
        "bounded": _fp16_weights(rank, 2.0**18, retry=True, max_retries=1),
    }


def test_retry_after_a_gradient_overflow_drops_no_batch_on_any_rank() -> None:
    results = run_ranks(_rank_retry, 2)
    for result in results:
        retried, settled = result["retried"], result["at_settled_scale"]
        # Every rank ran the batch again, together, at the backed-off scale, and stepped once.
        assert retried["runs"] == [2.0**16, 2.0**15]
        assert (retried["skipped"], retried["retries"], retried["scale"]) == (0, 1, 2.0**15)
        assert retried["loss"] == 0.0  # what the closure's last run returned (zero weights)
        # The same parameters as a run started at the scale the retry settled on.
        assert retried["weight"] == settled["weight"]
        assert retried["weight"] != [0.0] * 4
        # Without a closure the batch is dropped on every rank (and the scale backs off).
        assert result["without_retry"]["weight"] == [0.0] * 4
        assert result["without_retry"]["skipped"] == 1
        # Past max_retries the step is skipped as without one: 2**18 -> 2**17 still overflows.
        bounded = result["bounded"]
        assert bounded["runs"] == [2.0**18, 2.0**17]
        assert (bounded["skipped"], bounded["retries"], bounded["weight"]) == (1, 1, [0.0] * 4)
    assert results[0]["retried"]["scale"] == results[1]["retried"]["scale"]


def test_retry_is_not_tried_for_a_forward_overflow() -> None:
    model, optimizer = _replicas()
    scaler = ShardedGradScaler(init_scale=8.0)
    runs = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.ones(1, 4)).sum() * math.inf
        scaler.scale(loss).backward()
        runs.append(1)
        return loss

    scaler.step(optimizer, closure=closure)
    scaler.update()
    assert runs == [1]  # run once: no scale fixes a non-finite loss
    assert (scaler.stats.retries, scaler.stats.forward_overflows, scaler.get_scale()) == (0, 1, 8.0)


@pytest.mark.filterwarnings("ignore:the loss scale has backed off to min_scale")
def test_retry_at_the_floor_or_with_a_static_scale_skips_without_rerunning() -> None:
    for options in ({"init_scale": 1.0, "min_scale": 1.0}, {"dynamic": False}):
        scaler = ShardedGradScaler(**options)  # type: ignore[arg-type]
        runs = _overflowing_closure_step(scaler)
        assert runs == [1]
        assert (scaler.stats.skipped_steps, scaler.stats.retries) == (1, 0)


def _overflowing_closure_step(scaler: ShardedGradScaler) -> list[int]:
    """`step(closure=...)` whose every run overflows; how many runs there were."""
    weight = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    runs = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        scaler.scale(weight.sum()).backward()
        assert weight.grad is not None
        weight.grad[0] = math.inf
        runs.append(1)
        return weight.sum()

    scaler.step(optimizer, closure=closure)
    scaler.update()
    return runs


def test_retry_is_refused_by_the_async_scaler() -> None:
    scaler = AsyncShardedGradScaler()
    weight = nn.Parameter(torch.zeros(2))
    scaler.scale(weight.sum()).backward()
    with pytest.raises(NotImplementedError, match=r"step\(closure=\.\.\.\) is not supported"):
        scaler.step(torch.optim.SGD([weight], lr=0.1), closure=lambda: weight.sum())


def test_retry_is_refused_for_an_optimizer_that_takes_the_scaler_itself() -> None:
    class PassedTheScaler(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure: Any = None, grad_scaler: Any = None) -> None:  # type: ignore[override]
            raise AssertionError("never stepped")

    weight = nn.Parameter(torch.zeros(2))
    scaler = ShardedGradScaler()
    scaler.scale(weight.sum()).backward()
    refused = r"cannot retry PassedTheScaler: its step\(\) takes grad_scaler="
    with pytest.raises(RuntimeError, match=refused):
        scaler.step(PassedTheScaler([weight], lr=0.1), closure=lambda: weight.sum())


def test_located_forward_overflow_record_names_the_loss() -> None:
    model, optimizer = _replicas()
    scaler = ShardedGradScaler(locate_overflow=True)
    scaler.scale(model(torch.ones(1, 4)).sum() * math.nan).backward()
    scaler.step(optimizer)
    assert NonFiniteGrad(0, "<loss>", 0, 1) in scaler.last_overflow


@pytest.mark.torchrun
@pytest.mark.xdist_group("torchrun")
def test_demo_beside_torch_scalers_prints_what_the_docs_quote() -> None:
    """`launch/demos/forward_overflow.py`, whose output docs/forward-overflow.md quotes."""
    from tests.test_train import ROOT, torchrun

    output = torchrun(2, script=str(ROOT / "launch" / "demos" / "forward_overflow.py")).stdout
    halved = "2^15, 2^14, 2^13, 2^12, 2^12, 2^12 | yes |"
    assert f"| torch.amp.GradScaler | [2, 3, 4] | 0 | {halved}" in output
    assert f"| torch ShardedGradScaler | [2, 3, 4] | 0 | {halved}" in output
    held = "| shardscale.ShardedGradScaler | [2, 3, 4] | 0 | 2^15, 2^15, 2^15, 2^15, 2^15, 2^15 |"
    assert held in output
    assert "shardscale counted 3 forward overflows" in output
    dropped = "| [1, 2, 3] | 0 | 2^17, 2^16, 2^15, 2^15, 2^15, 2^15 | no |"
    assert f"| torch.amp.GradScaler {dropped}" in output
    assert f"| torch ShardedGradScaler {dropped}" in output
    assert (
        "| shardscale.ShardedGradScaler, step(closure=...) | none | 4 | "
        "2^15, 2^15, 2^14, 2^14, 2^14, 2^14 | yes |"
    ) in output


def _rank_dtensor_loss(rank: int, world_size: int) -> tuple[int, int, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    weight = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = ShardedGradScaler(init_scale=8.0)
    for inf_loss in (False, True):
        optimizer.zero_grad()
        loss = (weight * weight).sum()  # a DTensor loss, as tensor parallelism's loss_parallel
        scaler.scale(loss * math.inf if inf_loss else loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler.stats.steps, scaler.stats.forward_overflows, scaler.get_scale()


def test_a_dtensor_loss_is_checked_on_its_local_part() -> None:
    assert run_ranks(_rank_dtensor_loss, 2) == [(2, 1, 8.0)] * 2
