"""find_nonfinite_grads and locate_overflow: original names, right ranks, the same everywhere."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from shardscale import NonFiniteGrad, ShardedGradScaler, count_collectives, find_nonfinite_grads
from tests.harness import run_ranks
from tests.setups import build, local_grad_values, mlp, plant

# Where rank 0's last local gradient element lives (see _rank_find): FSDP1 cuts the flat
# parameter [0.weight | 0.bias | 2.weight | 2.bias] (512 + 32 + 256 + 8 elements) in two halves of
# 404, and rank 0's half holds only 0.weight.
LAST_ON_RANK_0 = {"fsdp1": "0.weight", "fsdp1_orig": "0.weight", "sparse": "head.bias"}
FIRST = {"sparse": "embedding.weight"}
LOCATE_KINDS = ("plain", "ddp", "fsdp1", "fsdp1_orig", "fsdp2", "hsdp", "tp", "sparse")


def _rank_find(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    setup = build(kind, "for-loop", world_size)
    setup.loss(0, rank).backward()
    clean = find_nonfinite_grads(setup.model)
    if rank == 1:
        plant(setup.optimizer, math.inf)
    # the last element of the last local gradient: 2.bias, or the end of rank 0's flat half
    held = [v for p in setup.model.parameters() if (v := local_grad_values(p)) is not None]
    held[-1].view(-1)[-1] = math.nan if rank == 0 else -math.inf
    return {"clean": clean, "found": find_nonfinite_grads(setup.model)}


@pytest.mark.parametrize("kind", LOCATE_KINDS)
def test_find_nonfinite_grads_names_original_params_on_every_rank(kind: str) -> None:
    results = run_ranks(_rank_find, 2, kind)
    last = "head.bias" if kind == "sparse" else "2.bias"
    assert results[0]["found"] == [
        NonFiniteGrad(rank=0, name=LAST_ON_RANK_0.get(kind, last), num_inf=0, num_nan=1),
        NonFiniteGrad(rank=1, name=FIRST.get(kind, "0.weight"), num_inf=1, num_nan=0),
        NonFiniteGrad(rank=1, name=last, num_inf=1, num_nan=0),
    ]
    for result in results:
        assert result["clean"] == []
        assert result["found"] == results[0]["found"]  # identical on every rank


def test_find_nonfinite_grads_world_of_one_and_no_process_group() -> None:
    model = mlp()
    model(torch.ones(2, 16)).sum().backward()
    model[2].weight.grad[0, :3] = torch.tensor([math.inf, math.nan, math.nan])
    assert find_nonfinite_grads(model) == [NonFiniteGrad(0, "2.weight", 1, 2)]
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module, got list"):
        find_nonfinite_grads([model])  # type: ignore[arg-type]


def test_find_nonfinite_grads_unwraps_torch_compile_names() -> None:
    model = mlp()
    compiled = torch.compile(model)
    model(torch.ones(2, 16)).sum().backward()
    model[0].bias.grad[1] = math.inf
    assert [r.name for r in find_nonfinite_grads(compiled)] == ["0.bias"]


def _rank_locate_overflow(rank: int, world_size: int, kind: str, named: bool) -> dict[str, Any]:
    setup = build(kind, "fused", world_size)
    if named:
        setup.optimizer = torch.optim.AdamW(setup.model.named_parameters(), lr=0.05, fused=True)
    scaler = ShardedGradScaler(init_scale=8.0, locate_overflow=True)
    collectives = []
    for step in range(3):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, rank)).backward()
        if step == 1 and rank == 1:
            plant(setup.optimizer, math.inf)
        with count_collectives() as counts:
            scaler.step(setup.optimizer)
            scaler.update()
        collectives.append(sum(counts.values()))
        if step == 1:
            located = scaler.last_overflow
    return {"located": located, "collectives": collectives, "last": scaler.last_overflow}


@pytest.mark.parametrize("kind", ["ddp", "fsdp1", "fsdp2"])
def test_locate_overflow_names_the_param_and_clean_steps_pay_nothing(kind: str) -> None:
    results = run_ranks(_rank_locate_overflow, 2, kind, True)
    expected = [NonFiniteGrad(rank=1, name="0.weight", num_inf=1, num_nan=0)]
    for result in results:
        assert result["located"] == expected
        # clean steps: the one agreement collective; the overflow step adds
        # all_gather_object's two (the sizes, then the records)
        assert result["collectives"] == [1, 3, 1]
        assert result["last"] == expected  # kept until the next overflow


def test_locate_overflow_without_param_names_uses_positions() -> None:
    results = run_ranks(_rank_locate_overflow, 2, "fsdp2", False)
    assert results[0]["located"] == [NonFiniteGrad(1, "param_groups[0][0]", 1, 0)]


def test_locate_overflow_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1)
    scaler = ShardedGradScaler(locate_overflow=True)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    model[2].bias.grad[0] = math.nan
    with caplog.at_level(logging.WARNING, logger="shardscale"):
        scaler.step(optimizer)
    assert (
        "step 1 overflowed; non-finite gradients at: rank 0: 2.bias (0 inf, 1 NaN)" in caplog.text
    )
    assert scaler.last_step_skipped


def test_locate_overflow_after_clip() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1)
    scaler = ShardedGradScaler(locate_overflow=True)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    model[0].weight.grad[3, 3] = math.inf
    scaler.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    assert scaler.last_overflow == [NonFiniteGrad(0, "0.weight", 1, 0)]
