"""`scale_policy="fit"`: the scale that fits the gradients, found in one update, not in thousands.

Gradients are planted (a parameter `w` and the loss `(w * g).sum()`, whose gradient is exactly
`g` times the scale), so every expected scale is computed by hand from the rule in
`shardscale._policy`: after a clean step, `2**(16 - margin) / max(window)`, the window holding
the power of two just above each of the last 16 steps' largest |gradient|.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler, ShardScaleWarning, count_collectives
from shardscale._policy import FIT_MARGIN, FIT_WINDOW
from tests.harness import run_ranks


class Planted(nn.Module):
    """One parameter whose gradient is whatever the step plants."""

    def __init__(self, size: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))

    def loss(self, grad: torch.Tensor) -> torch.Tensor:
        return (self.w * grad).sum()


def _step(scaler: ShardedGradScaler, model: Planted, optimizer: Any, grad: torch.Tensor) -> None:
    """One iteration whose gradient is `grad` (times the scale); an inf in `grad` is planted in
    the gradient after the backward (a finite loss: a gradient overflow, not a forward one)."""
    optimizer.zero_grad()
    scaler.scale(model.loss(grad.nan_to_num(posinf=0.0))).backward()
    assert model.w.grad is not None
    model.w.grad[grad.isinf()] = math.inf
    scaler.step(optimizer)
    scaler.update()


def _setup(**kwargs: Any) -> tuple[ShardedGradScaler, Planted, torch.optim.Optimizer]:
    model = Planted()
    return (
        ShardedGradScaler(scale_policy="fit", **kwargs),
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
    )


def _fitted(largest: float, margin: int = FIT_MARGIN) -> float:
    """The rule, by hand: the power of two above `largest`, `16 - margin` bits below."""
    return 2.0 ** (16 - margin) / 2.0 ** math.frexp(largest)[1]


def test_fit_reaches_the_fitting_scale_in_one_update_from_a_cold_start() -> None:
    scaler, model, optimizer = _setup(init_scale=1.0)
    grad = torch.full((8,), 3e-6)
    _step(scaler, model, optimizer, grad)
    assert scaler.get_scale() == _fitted(3e-6)  # 2**33 from 1: torch's rule needs 33 x 2,000 steps
    assert not scaler.last_step_skipped
    _step(scaler, model, optimizer, grad)
    assert scaler.get_scale() == _fitted(3e-6)  # it stays


def test_fit_follows_a_shrink_once_the_window_forgets_and_a_growth_at_once() -> None:
    scaler, model, optimizer = _setup()
    big, small = torch.full((8,), 0.3), torch.full((8,), 0.3e-3)
    _step(scaler, model, optimizer, big)
    assert scaler.get_scale() == _fitted(0.3)
    scales = []
    for _ in range(FIT_WINDOW):  # gradients 1,000x smaller: the window still holds the big one
        _step(scaler, model, optimizer, small)
        scales.append(scaler.get_scale())
    assert scales[: FIT_WINDOW - 1] == [_fitted(0.3)] * (FIT_WINDOW - 1)
    assert scales[-1] == _fitted(0.3e-3)  # 16 steps on, in one update: 2**10 up
    _step(scaler, model, optimizer, big)  # larger again: down at once, no overflow needed
    assert scaler.get_scale() == _fitted(0.3)
    assert scaler.stats.skipped_steps == 0


def test_fit_overflow_halves_and_widens_the_margin_a_forward_overflow_holds() -> None:
    scaler, model, optimizer = _setup()
    grad = torch.full((8,), 0.3)
    _step(scaler, model, optimizer, grad)
    fitted = scaler.get_scale()
    _step(scaler, model, optimizer, torch.tensor([math.inf] + [0.3] * 7))
    assert scaler.last_step_skipped
    assert scaler.get_scale() == fitted / 2
    assert scaler.state_dict()["_fit_margin"] == FIT_MARGIN + 1  # learned
    _step(scaler, model, optimizer, grad)
    assert scaler.get_scale() == _fitted(0.3, FIT_MARGIN + 1)  # one bit more room kept
    before = scaler.state_dict()
    optimizer.zero_grad()
    scaler.scale(model.loss(grad) * math.inf).backward()  # a forward overflow: the loss is inf
    scaler.step(optimizer)
    scaler.update()
    after = scaler.state_dict()
    assert scaler.last_step_skipped
    assert (after["scale"], after["_fit_margin"]) == (before["scale"], before["_fit_margin"])


def test_fit_leaves_a_start_far_too_high_in_a_few_skips() -> None:
    """From 2**32 (Megatron's default) to gradients that fit 2**18: 1, 2, 4, then 8 halvings
    (four skipped steps, not fourteen), then the first clean step fits the scale."""
    scaler, model, optimizer = _setup(init_scale=2.0**32)
    grad = torch.full((8,), 0.3)  # fp16 holds it up to 2**17; the fit keeps a bit: 2**16
    scales = []
    for _ in range(6):
        optimizer.zero_grad()
        scaled = scaler.get_scale() * grad
        overflows = bool((scaled > 65504).any())  # what fp16 would do to the planted gradient
        _step(
            scaler,
            model,
            optimizer,
            torch.where(scaled > 65504, math.inf, grad) if overflows else grad,
        )
        scales.append(math.log2(scaler.get_scale()))
    assert scales == [31, 29, 25, 17, 16, 16]  # 2**(16 - the margin of 1) / the bound 0.5
    assert scaler.stats.skipped_steps == 4
    assert scaler.state_dict()["_fit_streak"] == 0


def test_fit_keeps_the_floor_and_ceiling_and_the_hysteresis() -> None:
    scaler, model, optimizer = _setup(max_scale=2.0**20)
    _step(scaler, model, optimizer, torch.full((8,), 3e-9))
    assert scaler.get_scale() == 2.0**20  # the fitted 2**43, capped
    scaler, model, optimizer = _setup(min_scale=2.0**10)
    _step(scaler, model, optimizer, torch.full((8,), 3e3))
    assert scaler.get_scale() == 2.0**10  # the fitted 2**3, floored
    scaler, model, optimizer = _setup(hysteresis=2)
    _step(scaler, model, optimizer, torch.full((8,), 0.3))
    fitted = scaler.get_scale()
    _step(scaler, model, optimizer, torch.full((8,), math.inf))
    assert scaler.last_step_skipped
    assert scaler.get_scale() == fitted


def test_fit_reads_the_gradients_before_unscale_and_after_it() -> None:
    """`unscale_()` divides the gradients in place; the largest |gradient| the policy sees is
    the scaled one either way (taken before the unscale, or the clip's times the scale)."""
    for clip in (False, True):
        scaler, model, optimizer = _setup(init_scale=2.0**8)
        optimizer.zero_grad()
        scaler.scale(model.loss(torch.full((8,), 3e-6))).backward()
        scaler.unscale_(optimizer)
        if clip:
            scaler.clip_grad_norm_(model.parameters(), max_norm=1e9)
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == _fitted(3e-6), f"clip={clip}"


def test_fit_fused_optimizer_matches_the_plain_one() -> None:
    scales = []
    for fused in (False, True):
        model = Planted()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = ShardedGradScaler(scale_policy="fit")
        for grad in (0.3, 0.3, math.inf, 0.3e-3):
            _step(scaler, model, optimizer, torch.full((8,), grad))
            scales.append((fused, scaler.get_scale()))
    assert [s for f, s in scales if f] == [s for f, s in scales if not f]


def test_fit_state_dict_round_trips_and_older_formats_load() -> None:
    scaler, model, optimizer = _setup()
    for grad in (0.3, math.inf, 0.3e-3):
        _step(scaler, model, optimizer, torch.full((8,), grad))
    state = scaler.state_dict()
    assert state["format_version"] == 5
    assert state["scale_policy"] == "fit"
    assert state["_fit_streak"] == 0  # the clean step ended it
    assert state["_fit_margin"] == FIT_MARGIN + 1
    assert state["_fit_window"][:3] == [2.0**-11, 0.0, 2.0**-1]  # newest first; 0: skipped
    other = ShardedGradScaler()  # "interval": the checkpoint's policy is taken, as its settings
    other.load_state_dict(state)
    assert other.state_dict() == state
    fit_keys = ("scale_policy", "_fit_margin", "_fit_window", "_fit_streak")
    older = {k: v for k, v in state.items() if k not in fit_keys}
    older["format_version"] = 2
    fresh = ShardedGradScaler(scale_policy="fit")
    fresh.load_state_dict(older)
    loaded = fresh.state_dict()
    assert loaded["scale"] == state["scale"]
    assert loaded["scale_policy"] == "fit"
    assert loaded["_fit_margin"] == FIT_MARGIN
    assert loaded["_fit_window"] == [0.0] * FIT_WINDOW


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "scale_policy",
            "amax",
            r"\['scale_policy'\] must be one of \('interval', 'fit'\), got 'amax'",
        ),
        ("_fit_margin", 99, r"_fit_margin must be in \[0, 8\], got 99"),
        ("_fit_streak", 5, r"_fit_streak must be in \[0, 4\], got 5"),
        ("_fit_window", [1.0] * 3, r"_fit_window must be 16 finite numbers >= 0"),
        ("_fit_window", [-1.0] * 16, r"_fit_window must be 16 finite numbers >= 0"),
        ("_fit_window", 1.0, r"state_dict\['_fit_window'\] must be a list, got 1.0"),
    ],
)
def test_fit_bad_state_is_refused_with_the_rule_and_nothing_changes(
    key: str, value: object, message: str
) -> None:
    scaler, model, optimizer = _setup()
    _step(scaler, model, optimizer, torch.full((8,), 0.3))
    before = scaler.state_dict()
    with pytest.raises((ValueError, TypeError), match=message):
        scaler.load_state_dict({**before, key: value})
    assert scaler.state_dict() == before


def test_fit_bad_arguments_say_the_rule() -> None:
    rule = r"scale_policy must be one of \('interval', 'fit'\), got 'amax'"
    with pytest.raises(ValueError, match=rule):
        ShardedGradScaler(scale_policy="amax")
    rule = r"scale_policy='fit' moves the scale: it needs dynamic=True"
    with pytest.raises(ValueError, match=rule):
        ShardedGradScaler(scale_policy="fit", dynamic=False)


def _ranks_fit(rank: int, world_size: int, clip: bool) -> dict[str, Any]:
    """Each rank holds its own shard: rank 1's gradients are 2**6 times rank 0's."""
    scaler, model, optimizer = _setup()
    grad = torch.full((8,), 3e-5 * 64**rank)
    counts = counted_steps(scaler, model, optimizer, grad, 3, clip)
    return {"scale": scaler.get_scale(), "collectives": counts, "state": scaler.state_dict()}


def counted_steps(
    scaler: ShardedGradScaler,
    model: Planted,
    optimizer: Any,
    grad: torch.Tensor,
    steps: int,
    clip: bool,
) -> list[int]:
    """`steps` iterations planting `grad` on this rank's own shard (a clip first, if `clip`, of
    this rank's parameters alone); the collectives each step + update issued."""
    counts = []
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(model.loss(grad)).backward()
        with count_collectives() as counted:
            if clip:
                scaler.clip_grad_norm_(model.parameters(), max_norm=1e9, replica_group=1)
            scaler.step(optimizer)
            scaler.update()
        counts.append(sum(counted.values()))
    return counts


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip 2-norm (a summed ballot)"])
def test_fit_every_rank_fits_the_global_largest_gradient_in_the_one_collective(clip: bool) -> None:
    rank0, rank1 = run_ranks(_ranks_fit, 2, clip)
    assert rank0["state"] == rank1["state"]
    assert rank0["scale"] == _fitted(3e-5 * 64)  # rank 1's, the larger
    # the first step after a clip agrees at a collective of its own (the optimizer was not
    # known to the clip), then one a step
    assert rank0["collectives"] == rank1["collectives"] == ([2, 1, 1] if clip else [1, 1, 1])


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip"])
def test_fit_fused_step_adds_no_host_read_on_the_device_path(clip: bool) -> None:
    """On the meta device (every non-CPU branch), counted as the suite counts torch's."""
    from tests.devicepath import Case, measure

    counts = measure(Case("fused", {"scale_policy": "fit"}, clip=clip))
    default = measure(Case("fused", clip=clip))  # its one non-blocking copy: the alarms' watch
    assert (counts.host_reads, counts.d2h_blocking, counts.d2h_async) == (0, 0, default.d2h_async)


def _ranks_verify(rank: int, world_size: int) -> str:
    from shardscale import ShardScaleDistributedError

    scaler, model, optimizer = _setup()
    _step(scaler, model, optimizer, torch.full((8,), 0.3))
    scaler.verify_agreement()  # the same window and margin everywhere
    if rank == 1:
        state = scaler.state_dict()
        assert state["_fit_window"][0] == 0.5  # 0.3's power of two
        scaler.load_state_dict({**state, "_fit_window": [0.25, *state["_fit_window"][1:]]})
    try:
        scaler.verify_agreement()
    except ShardScaleDistributedError as error:
        return str(error)
    return "agreed"


def test_fit_verify_agreement_compares_the_window_and_margin() -> None:
    for message in run_ranks(_ranks_verify, 2):
        assert "_fit_window[0]: rank 0 = 0.5, rank 1 = 0.25" in message


@pytest.mark.torchrun
@pytest.mark.xdist_group("torchrun")
def test_policies_bench_runs_and_the_fit_arrives_from_a_cold_start(tmp_path: Any) -> None:
    """`launch/rigs/scale_policies.py` (docs/scale-policies.md), shortened: every policy gets
    a row, the working scale is a power of two, and the fit reaches it from 1 in one update
    while torch's rule, in 40 steps, cannot."""
    import json

    from tests.test_train import ROOT, torchrun

    script = str(ROOT / "launch" / "rigs" / "scale_policies.py")
    out = tmp_path / "policies.json"
    torchrun(
        2,
        *("--steady", "40", "--recover", "40", "--summed", "60", "--nan", "60"),
        *("--json", str(out)),
        script=script,
    )
    found = json.loads(out.read_text())
    rows = {row["policy"]: row for row in found["rows"]}
    assert len(rows) == 5
    assert math.log2(found["working_scale"]).is_integer()
    assert rows['shardscale, scale_policy="fit"']["cold_1"] == {
        "steps": 1,
        "skips": 0,
        "arrived": True,
    }
    assert not rows["torch.amp.GradScaler"]["cold_1"]["arrived"]
    # ours read the underflow meter at each probe, beside the script's own fp32 count: the
    # step's fp16 backward against an fp32 one, so close, not equal
    for name in ("shardscale (default)", 'shardscale, scale_policy="fit"'):
        assert rows[name]["meter_mean"] is not None
        assert rows[name]["meter_max_gap"] < 0.01
    assert rows["torch.amp.GradScaler"]["meter_mean"] is None
    # fp16's whole range: the summed loss and a NaN at every scale (docs/scale-policies.md)
    fit, ours, torchs = (
        rows[name]
        for name in (
            'shardscale, scale_policy="fit"',
            "shardscale (default)",
            "torch.amp.GradScaler",
        )
    )
    assert fit["cold_2_32"]["arrived"]
    assert fit["cold_2_32"]["skips"] <= 5
    assert fit["summed"]["skips"] <= 8
    assert ours["summed"]["skips"] <= torchs["summed"]["skips"]
    assert ours["nan"]["error"] == "ShardScaleNonFiniteError at step 47"
    assert fit["nan"]["error"] is not None
    assert torchs["nan"]["error"] is None
    assert all(row["nan"]["weights_finite"] for row in rows.values())


@pytest.mark.torchrun
@pytest.mark.xdist_group("torchrun")
def test_fit_on_gpt_rig_runs_every_policy_and_measures_the_activations(tmp_path: Any) -> None:
    """`launch/rigs/fit_on_gpt.py` (docs/scale-policies.md#the-fit-on-the-gpt-job), shortened:
    every policy runs the GPT job, fp32 is its own reference, and each fp16 run's probe names
    real modules of the model with fractions, not an empty watch."""
    import json

    from tests.test_train import ROOT, torchrun

    out = tmp_path / "fit_on_gpt.json"
    script = str(ROOT / "launch" / "rigs" / "fit_on_gpt.py")
    torchrun(2, "--steps", "6", "--seeds", "1", "--json", str(out), script=script)
    records = {record["policy"]: record for record in json.loads(out.read_text())}
    assert sorted(records) == sorted(
        ["torch.amp.GradScaler", "shardscale (interval)", 'shardscale, scale_policy="fit"', "fp32"]
    )
    assert all(len(record["scales"]) == 6 for record in records.values())
    assert all(math.isfinite(record["held_out_loss"]) for record in records.values())
    assert records["fp32"]["final_scale"] == 1.0
    # why the fit holds its scale: its margin and the largest gradient it saw, in range
    fit = records['shardscale, scale_policy="fit"']
    assert fit["fit_margin"] >= 0
    assert 0.0 < fit["fit_window_peak"] < 2.0**16
    assert fit["final_scale"] * fit["fit_window_peak"] * 2.0 ** fit["fit_margin"] <= 2.0**16
    assert "fit_margin" not in records["shardscale (interval)"]
    # the GPT's own module names (launch/job/lm_model.py), no wrapper's prefix
    own_name = re.compile(r"(token_embedding|position_embedding|norm|head|blocks\.\d+(\.\w+)*)")
    for record in records.values():
        assert record["worst_activations"], record["policy"]
        for name, share, _ in record["worst_activations"]:
            assert own_name.fullmatch(name), name
            assert 0.0 <= share <= 1.0


def test_fit_resumes_through_dcp_at_another_world_size_and_the_ranks_agree(tmp_path: Any) -> None:
    """Saved on 2 ranks with a learned margin, resumed on 1 and on 3 into a scaler built with
    "interval" (the checkpoint's policy is taken on load); every rank agrees after a step."""
    from tests.test_checkpoint import _rank_resume, _rank_train_and_save

    fit, overflow = {"scale_policy": "fit"}, {2: 1}  # on rank 1's shard, the window holding steps
    states = run_ranks(_rank_train_and_save, 2, str(tmp_path), fit, overflow)
    assert states[0] == states[1]
    assert states[0]["_fit_margin"] == FIT_MARGIN + 1  # learned from rank 1's overflow
    assert states[0]["skipped_steps"] == 1
    assert any(states[0]["_fit_window"])
    for world_size in (1, 3):
        results = run_ranks(_rank_resume, world_size, str(tmp_path))
        for result in results:
            assert result["loaded"] == states[0]
            assert result["after"] == results[0]["after"]
            assert result["after"]["scale_policy"] == "fit"
            assert result["after"]["steps"] == states[0]["steps"] + 1


# ---------------------------------------------------------------- what the fit reads (issue 49)


class _Gained(nn.Module):
    """An input gain (fp32, outside autocast's casts) before two autocast Linears: the gain's
    gradient forms in fp32 and is the largest (2^2 here, the Linears' at most 2^-4), so a fit
    that read it held a scale 2^7 below the largest that keeps every fp16 tensor finite."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gain = nn.Parameter(torch.full((32,), 1e-5))
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return self.fc2(torch.relu(self.fc1(x * self.gain))).float()


SAFE_EXPONENT = {1: 19, 8: 22}
"""The largest e at which every backward of the gain model at scale 2^e stays finite, by
micro-batches a step: the fit ends FIT_MARGIN below it (docs/scale-policies.md states both)."""
STEPS = 30


def _gained_losses(model: nn.Module, step: int, micro: int) -> Any:
    for k in range(micro):  # a mean over micro-batches, as accumulation divides it
        inputs = torch.randn(64, 32, generator=torch.Generator().manual_seed(100 * step + k))
        yield model(inputs * 4096).pow(2).mean() / micro


def _largest_safe_exponent(micro: int) -> int:
    """The largest e at which every micro-batch's backward at scale 2^e stays finite."""
    model, best = _Gained(), 0
    for exponent in range(40):
        for loss in _gained_losses(model, 0, micro):
            model.zero_grad()
            (loss * 2.0**exponent).backward()
            if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):  # type: ignore[arg-type]
                return best
        best = exponent
    return best


@pytest.mark.parametrize("micro", [1, 8])
def test_fit_reads_the_fp16_tensors_one_backward_at_a_time_and_ends_near_the_safe_scale(
    micro: int,
) -> None:
    safe = _largest_safe_exponent(micro)
    model = _Gained()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the same gradients every step
    scaler = ShardedGradScaler(scale_policy="fit")
    skips = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        for loss in _gained_losses(model, step % 2, micro):
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skips += scaler.last_step_skipped
    assert scaler._agreement.readings.fp16.fp32_formed == {id(model.gain)}  # the gain is not read
    assert safe == SAFE_EXPONENT[micro]  # the model as documented
    assert math.log2(scaler.get_scale()) == safe - FIT_MARGIN
    assert skips == 0


def test_fit_tells_the_gradients_formed_in_fp16_from_those_formed_in_fp32() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain, self.embedding = nn.Parameter(torch.ones(8)), nn.Embedding(4, 8)
            self.norm, self.fc, self.head = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                return self.head(self.norm(self.fc(x * self.gain + self.embedding(ids)))).float()

    model = Mixed()
    scaler = ShardedGradScaler(scale_policy="fit")
    scaler.scale(model(torch.randn(3, 8), torch.tensor([0, 1, 2])).sum()).backward()
    fp32 = scaler._agreement.readings.fp16.fp32_formed
    formed = {name: "fp32" if id(p) in fp32 else "fp16" for name, p in model.named_parameters()}
    assert formed == {
        "gain": "fp32",  # an elementwise product: fp32 under autocast
        "embedding.weight": "fp32",
        "norm.weight": "fp32",  # autocast runs layer_norm in fp32
        "norm.bias": "fp32",
        "fc.weight": "fp16",  # cast to fp16 by autocast: its gradient forms there
        "fc.bias": "fp16",
        "head.weight": "fp16",
        "head.bias": "fp16",
    }


def test_fit_reads_every_gradient_of_a_model_in_fp16_and_of_one_without_fp16() -> None:
    for dtype in (torch.float16, torch.float32):  # nothing to tell apart in either
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to(dtype)
        scaler = ShardedGradScaler(scale_policy="fit")
        scaler.scale(model(torch.randn(2, 8, dtype=dtype)).float().sum()).backward()
        assert scaler._agreement.readings.fp16.fp32_formed == frozenset()


def test_fit_under_torch_compile_reads_everything_and_says_so_once() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    compiled = torch.compile(model, backend="aot_eager")
    scaler = ShardedGradScaler(scale_policy="fit")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = compiled(torch.randn(2, 8)).float().sum()
    with pytest.warns(ShardScaleWarning, match=r"cannot tell how .* opaque \(torch.compile"):
        scaler.scale(loss)
    # the safe side: read them all
    assert scaler._agreement.readings.fp16.fp32_formed == frozenset()


def _ranks_gained_fsdp2(rank: int, world_size: int) -> tuple[list[float], int]:
    """The model above under FSDP2 (its unsharded parameters are the graph's leaves, not the
    optimizer's sharded ones), the same batches on every rank: the scale after each step (its
    log2), and the steps skipped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _Gained()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ShardedGradScaler(scale_policy="fit")
    scales, skips = [], 0
    for step in range(STEPS):
        optimizer.zero_grad()
        for loss in _gained_losses(model, step % 2, 1):
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(math.log2(scaler.get_scale()))
        skips += scaler.last_step_skipped
    return scales, skips


def test_fit_under_fsdp2_reads_the_unsharded_fp16_gradients() -> None:
    """FSDP2 all-gathers unsharded parameters, whose gradients are the fp16 tensors: read in
    each backward, the gain's left out, the scale ends where one process's does, with no skip.
    The first iteration reads the sharded `.grad` (the gain's included): its 2^12 holds until
    that reading leaves the window."""
    end = SAFE_EXPONENT[1] - FIT_MARGIN
    course = [12.0] * FIT_WINDOW + [float(end)] * (STEPS - FIT_WINDOW)
    assert run_ranks(_ranks_gained_fsdp2, 2) == [(course, 0), (course, 0)]
