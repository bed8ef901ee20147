"""The device path's costs per step, counted on ``meta``, pinned, and stated by the docs.

Every ``device.type != "cpu"`` branch of the scaler runs here on the ``meta`` device (see
``tests/devicepath.py`` for what counts as a host read, a copy and a kernel). For each optimizer
flavour (plain, fused) and option, the third step's host reads, copies and kernels must be what
docs/guides.md's device-path table states, row by row: a change to the code that moves a count
fails here until the table says so. docs/benchmarks.md's table (ours beside torch's scalers,
printed by launch/rigs/count_device_path.py) is checked the same way.

World size 1 throughout: no process group, no collective. A ballot on ``meta`` cannot travel
through gloo, so the collective and ``verify_agreement``'s exchange (world size > 1) are not
counted here; at world size 1 ``verify_every`` is a no-op, which its row pins.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from shardscale.testing import CudaPathLog, cuda_path
from tests.devicepath import (
    CASES,
    META,
    Case,
    Counts,
    DeviceCounter,
    Fused,
    measure,
    measure_torch,
    meta_params,
)

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (
    "case",
    "host reads",
    "blocking device→host copies",
    "non-blocking device→host copies",
    "host→device copies",
    "kernels",
    "event waits",
)


def _table(path: Path, columns: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The rows of the markdown table in ``path`` whose header is ``columns``, by first cell."""
    lines = path.read_text().splitlines()
    header = "| " + " | ".join(columns) + " |"
    starts = [i for i, line in enumerate(lines) if line.strip() == header]
    if len(starts) != 1:
        raise AssertionError(
            f"{path.name}: expected one table headed {header!r}, found {len(starts)}"
        )
    rows: dict[str, tuple[int, ...]] = {}
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != len(columns):
            raise AssertionError(f"{path.name}: row {line!r} has {len(cells)} cells")
        if cells[0] in rows:
            raise AssertionError(f"{path.name}: row {cells[0]!r} twice")
        rows[cells[0]] = tuple(int(cell) for cell in cells[1:])
    return rows


@pytest.fixture
def path() -> Any:
    """The CUDA path on ``meta`` tensors (``shardscale.testing.cuda_path()``), and its log."""
    with cuda_path() as log:
        yield log


# ---------------------------------------------------------------- the docs' table, row by row


def test_guides_device_table_lists_every_case_once() -> None:
    rows = _table(ROOT / "docs" / "guides.md", COLUMNS)
    assert sorted(rows) == sorted(CASES)


@pytest.mark.parametrize("label", list(CASES))
def test_guides_device_table_row_matches_measured_counts(label: str, path: CudaPathLog) -> None:
    documented = _table(ROOT / "docs" / "guides.md", COLUMNS)[label]
    measured = measure(CASES[label], path=path)
    assert measured.row() == documented, (
        f"docs/guides.md says {label!r} costs {documented}, the code costs {measured.row()} "
        f"({', '.join(COLUMNS[1:])}); fix the code or the table"
    )


# ---------------------------------------------------------------- the targets (issue 18)


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip"])
def test_fused_step_with_or_without_clip_no_host_read_no_blocking_copy(clip: bool) -> None:
    """No host synchronisation: the one device->host copy is the alarms' watch of the streaks,
    non-blocking, waited for an update later (when the device has long finished it)."""
    counts = measure(Case("fused", clip=clip))
    assert (counts.host_reads, counts.d2h_blocking, counts.d2h_async) == (0, 0, 1)


@pytest.mark.parametrize(
    "case",
    [
        Case("plain"),
        Case("plain", clip=True),
        Case("plain", unscale_first=True),
        Case("plain", {"locate_overflow": True}),
    ],
    ids=["step", "clip", "unscale_", "locate_overflow"],
)
def test_plain_step_at_most_one_host_read_no_copy(case: Case) -> None:
    counts = measure(case)
    assert counts.host_reads <= 1
    assert (counts.d2h_blocking, counts.d2h_async) == (0, 0)


@pytest.mark.parametrize(("flavour", "most"), [("plain", 17), ("fused", 23)])
def test_clip_step_update_kernels_within_torchs_plus_updates_own(flavour: str, most: int) -> None:
    """torch.amp's `unscale_` + foreach clip + `step` + `update`: 16 and 17 kernels. Ours: the
    same 15 for the clip, then `update()`'s own: its device counters (1 after a plain step, 2
    after a fused one) and, after a fused step only, the forward-overflow hold (2), the floor
    (1) and the floor streak (2) (docs/benchmarks.md)."""
    counts = measure(Case(flavour, clip=True))
    assert counts.kernels <= most


KERNEL_CASES = {
    "step": Case("plain"),
    "fused step": Case("fused"),
    "clip": Case("fused", clip=True),
    "unscale_ + clip": Case("plain", unscale_first=True, clip=True),
}


@pytest.mark.parametrize("label", list(KERNEL_CASES))
def test_kernels_per_step_independent_of_gradient_count(label: str) -> None:
    case = KERNEL_CASES[label]
    assert measure(case, params=2).kernels == measure(case, params=20).kernels


# Kernels per (device, dtype) group beyond the first: a check (or its multiply) per group, and a
# _foreach_norm and a stack of its norms per group when clipping; the groups' norms are then
# concatenated together.
EXTRA_PER_DTYPE = {"step": 1, "fused step": 1, "clip": 3, "unscale_ + clip": 4}


@pytest.mark.parametrize("label", list(KERNEL_CASES))
def test_kernels_per_step_grow_with_dtype_groups_not_tensors(label: str) -> None:
    case = KERNEL_CASES[label]
    two_dtypes = (torch.float32, torch.float16)
    few = measure(case, params=2, dtypes=two_dtypes).kernels
    assert measure(case, params=20, dtypes=two_dtypes).kernels == few
    assert few == measure(case, params=2).kernels + EXTRA_PER_DTYPE[label]


# ---------------------------------------------------------------- what the counts stand for


def test_counter_counts_reads_copies_and_kernels_not_views() -> None:
    with DeviceCounter(value=3.0) as counter:
        x = torch.ones(4, device=META)  # a fill: a kernel
        counter.reset()
        x.reshape(2, 2).t()[1:].detach().unsqueeze(0).expand(3, 1, 2)  # views only
        torch.empty(3, device=META)  # an allocation
        assert counter.counts() == Counts()
        (x * 2).sum()  # two kernels
        assert x.sum().item() == 3.0  # a kernel and a read, answered with the counter's value
        x.cpu()  # a blocking copy
        x.to("cpu", non_blocking=True)
        torch.ones(2).to(META, non_blocking=True)  # a CPU fill (not counted) and a copy up
    assert counter.counts() == Counts(
        host_reads=1, d2h_blocking=1, d2h_async=1, h2d=1, kernels=3, event_waits=0
    )


def test_fused_stub_is_handed_the_scale_and_flag_on_meta() -> None:
    from shardscale import ShardedGradScaler

    params = meta_params()
    optimizer = Fused(params)
    scaler = ShardedGradScaler()
    with DeviceCounter():
        scaler.scale(torch.ones((), device=META))
        for p in params:
            p.grad = torch.ones_like(p)
        scaler.step(optimizer)
    ((grad_scale, found_inf),) = optimizer.handed
    assert grad_scale is not None
    assert found_inf is not None
    assert (grad_scale.device, found_inf.device) == (META, META)


def test_stats_hook_case_runs_the_accelerator_branch(path: CudaPathLog) -> None:
    measure(CASES["fused: a stats hook"], path=path)
    copies = [detail for what, detail in path.events if what == "copy"]
    assert copies == [META] * 3  # one per update of the case's 3 steps, of the state on meta
    # each update waits for the one before's copy (the stats and the alarms' trigger in one);
    # the last copy is still on its way
    assert path.waits == 2


# ---------------------------------------------------------------- beside torch's scalers

BENCH_COLUMNS = ("scaler", "pattern", "host reads", "device→host copies", "kernels")


def _bench_script() -> Any:
    path = ROOT / "launch" / "rigs" / "count_device_path.py"
    spec = importlib.util.spec_from_file_location("count_device_path", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_table() -> dict[tuple[str, str], tuple[int, ...]]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    header = "| " + " | ".join(BENCH_COLUMNS) + " |"
    assert text.count(header) == 1, f"docs/benchmarks.md: expected one table headed {header!r}"
    rows = {}
    for line in text[text.index(header) :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[(cells[0], cells[1])] = tuple(int(c) for c in cells[2:])
    return rows


def test_benchmarks_device_table_is_what_the_script_counts() -> None:
    printed = _bench_script().rows()
    assert {(r[0], r[1]): tuple(r[2:]) for r in printed} == _bench_table()


@pytest.mark.parametrize("flavour", ["plain", "fused"])
@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip"])
def test_benchmarks_script_counts_like_the_suite(flavour: str, clip: bool) -> None:
    """The script's own counter (launch/ uses only public APIs) agrees with this suite's."""
    printed = {(r[0], r[1]): tuple(r[2:]) for r in _bench_script().rows()}
    pattern = f"{flavour}, " + ("with clipping" if clip else "`step` + `update`")
    counts = measure(Case(flavour, clip=clip))
    _, torch_counts = measure_torch(flavour, clip=clip)
    for scaler, measured in (("shardscale", counts), ("torch.amp.GradScaler", torch_counts)):
        copies = measured.d2h_blocking + measured.d2h_async
        assert printed[(scaler, pattern)] == (measured.host_reads, copies, measured.kernels)


# ---------------------------------------------------------------- what the kernel cuts keep


@pytest.mark.parametrize("clipped", ["a, b", "b"])
def test_clip_norm_shows_an_overflow_an_earlier_unscale_saw_of_its_own_parameters(
    clipped: str,
) -> None:
    """`unscale_(opt_a)` saw an inf its agreement waits for; the clip carries it in the same
    collective. Where the clip covers `a` (after `unscale_` of both), its share is forced to inf
    before the collective (the flag is not the norms' own), and the steps of the optimizers it
    covered are skipped (clipping.md's rule); where it covers `b` alone, each optimizer keeps
    its own verdict, as torch's: `a` skips, `b` is clipped by its own finite norm and steps."""
    from torch import nn

    from shardscale import ShardedGradScaler

    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=1.0)
    scaler = ShardedGradScaler(init_scale=4.0)
    for step in range(2):  # the second step defers unscale_'s agreement to the clip
        scaler.scale(torch.ones(()))
        a.grad = torch.full((4,), math.inf if step == 1 else 1.0)
        b.grad = torch.ones(4)
        scaler.unscale_(opt_a)
        if clipped == "a, b":
            scaler.unscale_(opt_b)  # torch's order: every optimizer clipped was unscaled
        b_before = b.detach().clone()
        norm = scaler.clip_grad_norm_([a, b] if clipped == "a, b" else [b], 1.0)
        a_skipped = scaler.step(opt_a) is None and scaler.last_step_skipped
        scaler.step(opt_b)
        b_skipped = scaler.last_step_skipped
        scaler.update()
    assert a_skipped
    if clipped == "a, b":
        assert not math.isfinite(norm.item())
        assert b_skipped
        assert torch.equal(b.grad, torch.full((4,), 0.25))  # only unscaled: the step is skipped
        assert torch.equal(b.detach(), b_before)
    else:
        assert norm.item() == 0.5  # b's own norm: 4 elements of 0.25
        assert not b_skipped
        assert torch.allclose(b.detach(), b_before - 0.25)  # clipped to norm 1 > 0.5: as is


def test_clip_factor_and_inverse_match_the_reference_arithmetic() -> None:
    """inverse() is torch's float64 reciprocal rounded once; the clip factor min(1, m/(n+eps))."""
    from torch import nn

    from shardscale import ShardedGradScaler
    from shardscale._grads import Kernels

    for value in (3.0, 2.0**16, 1.5**40, 7.0e-3):
        scale = torch.tensor(value)
        assert torch.equal(Kernels().inverse(scale), scale.double().reciprocal().float())
    grads = [torch.full((3,), 2.0), torch.full((5,), -1.0)]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, grads, strict=True):
        p.grad = g * 8.0
    norm = scaler.clip_grad_norm_(params, 0.5)
    expected = math.sqrt(3 * 4.0 + 5 * 1.0)
    assert norm.item() == pytest.approx(expected, rel=1e-7)
    factor = 0.5 / (norm.item() + 1e-6)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * factor, rtol=1e-6, atol=0)
