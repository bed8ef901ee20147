"""Every rank together, whatever differs between ranks: a property-based search, 2 gloo ranks.

A scenario is a training loop's calls, the same on every rank (the scale policy, one optimizer
or two, their flavour, a clip over some subset of the parameters, `unscale_` first or not,
`scaler.step` or torch.amp's own step body, or `step(closure=...)`, which reruns the batch at a
lower scale; `verify_every`, `locate_overflow` and the underflow meter's steps; whether warnings
are errors), and what each rank holds, observes, loads and lists, drawn for each rank apart:
which parameters hold a gradient at each step and what it holds (none; finite; an inf; a NaN),
whether its shard of one parameter is empty (FSDP2's uneven dim-0 shards), how many
micro-batches it runs at each step (0: a pipeline stage that scales no loss there) and whether a
loss of its is non-finite, the clip list it builds (the scenario's, or from its own gradients,
as torch's `clip_grad_norm_` filters: MoE tokens reach other experts on each rank), a state it
loads between steps (none; its current one; a stale one, from a step before), which observers it
attaches (a stats hook, the log at INFO, `stats` reads, torch's private reads), and whether its
hook raises at some step.

Hypothesis draws the scenarios, in this process; both ranks then run all of them, on the CPU
path and on the CUDA path through `shardscale.testing.cuda_path()`, with and without
`TORCH_DISTRIBUTED_DEBUG=DETAIL` (with it torch checks before each collective that every rank
issues the same one; without, a collective of another shape would abort gloo). The property,
per scenario: both ranks issue the same collectives, in order, and warn and raise at the same
calls (the same error: a rank that loaded another state is named on both, at the first
collective after its load); take the same step/skip decisions and hold the same scale; a
parameter whose gradients were equal on both ranks ends equal; and nothing waits out a timeout
(a rank that is left alone raises the scaler's distributed error, which then differs from its
peer's). A hook's own failure is the hook's: said to its rank alone, which goes on.

CI runs `EXAMPLES` scenarios per path and debug level, 400 (about 70 s for the four on 2 cores;
60 once missed the splits of clip lists built from each rank's gradients, which the 113th of
that day's draws found); `SHARDSCALE_RANK_FUZZ_EXAMPLES` sets another number. The draws are
the same on every run (`tests.drawn`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import warnings
from contextlib import ExitStack
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn

from shardscale import ShardedGradScaler, ShardScaleWarning
from shardscale.testing import cuda_path
from tests.drawn import derandomized
from tests.harness import run_ranks
from tests.test_rank_symmetry import DETAIL, recorded_collectives

EXAMPLES = int(os.environ.get("SHARDSCALE_RANK_FUZZ_EXAMPLES", "400"))
STEPS = 3
NAMES = ("dense.weight", "dense.bias", "expert.weight", "shard", "control")
HELD = ("none", "finite", "inf", "nan")
OBSERVERS = ("hook", "log", "stats", "reads")
# The warnings that are a rank's own diagnostics (a hook of its that raised; plain gradients
# clipped on a rank that scaled no loss), said once the call's collective is behind: that rank
# alone is told, and goes on, where warnings are errors too.
_HOOK_FAILED = "the stats hook"
_ITS_OWN = (_HOOK_FAILED, "clip_grad_norm_ on a rank that never called scale()")


def _rank_part() -> st.SearchStrategy[dict[str, Any]]:
    """What one rank holds, observes, loads and lists."""
    held = st.fixed_dictionaries({name: st.sampled_from(HELD) for name in NAMES[:-1]})
    return st.fixed_dictionaries(
        {
            "held": st.lists(held, min_size=STEPS, max_size=STEPS),
            "shard_rows": st.sampled_from((0, 2)),
            "observers": st.sets(st.sampled_from(OBSERVERS)).map(sorted),
            "hook_raises_at": st.sampled_from((None, 1, 2)),
            "micro_batches": st.lists(
                st.sampled_from((1, 1, 2, 0, 3)), min_size=STEPS, max_size=STEPS
            ),
            "nonfinite_loss_at": st.sampled_from((None, None, 1, 2, 3)),
            "clip_list": st.sampled_from(("given", "own gradients")),
            "load": st.sampled_from(("none", "none", "current", "stale")),
            "load_at": st.sampled_from((2, 3)),
        }
    )


SCENARIOS = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(("interval", "fit")),
        "optimizers": st.sampled_from((1, 2)),
        "flavour": st.sampled_from(("for-loop", "foreach", "fused")),
        "clip": st.one_of(st.none(), st.sets(st.sampled_from(NAMES), min_size=1).map(sorted)),
        "norm_type": st.sampled_from((2.0, math.inf)),
        "unscale_first": st.booleans(),
        "body": st.sampled_from(("step", "torch")),
        "warnings": st.sampled_from(("recorded", "errors")),
        "closure": st.sampled_from((False, False, False, True)),
        "options": st.fixed_dictionaries(
            {
                "verify_every": st.sampled_from((0, 0, 1, 2)),
                "locate_overflow": st.booleans(),
                "underflow_every": st.sampled_from((100, 1, 2)),
            }
        ),
        "ranks": st.lists(_rank_part(), min_size=2, max_size=2),
    }
)


class _Model(nn.Module):
    """A dense layer, an expert, a parameter sharded unevenly, and a control parameter whose
    gradient is the same on every rank (its own loss)."""

    def __init__(self, shard_rows: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(3, 4)
        self.expert = nn.Linear(3, 4, bias=False)
        self.shard = nn.Parameter(torch.ones(shard_rows, 3))
        self.control = nn.Parameter(torch.ones(3))


def _optimizers(model: _Model, scenario: dict[str, Any]) -> list[torch.optim.Optimizer]:
    named = dict(model.named_parameters())
    flavour = scenario["flavour"]
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(flavour, {"foreach": False})
    if scenario["optimizers"] == 1:
        groups = [list(NAMES)]
    else:
        groups = [[n for n in NAMES if n != "expert.weight"], ["expert.weight"]]
    return [torch.optim.SGD([named[n] for n in names], lr=0.5, **kind) for names in groups]


def _scaled_gradient(kind: str, shape: torch.Size, scale: float) -> torch.Tensor:
    grad = torch.full(shape, 0.25 * scale)
    if grad.numel() and kind in ("inf", "nan"):
        grad.view(-1)[0] = math.inf if kind == "inf" else math.nan
    return grad


class _Run:
    """One scenario on this rank: what it records of itself, for the parent to compare."""

    def __init__(self, rank: int, scenario: dict[str, Any]) -> None:
        self.scenario, self.mine = scenario, scenario["ranks"][rank]
        self.model = _Model(self.mine["shard_rows"])
        self.optimizers = _optimizers(self.model, scenario)
        self.scaler = ShardedGradScaler(
            init_scale=2.0**4,
            scale_policy=scenario["policy"],
            sync_timeout=20.0,
            **scenario["options"],
        )
        self.events: list[tuple[Any, ...]] = []  # (step, call, what) warnings and the error
        self.decisions: list[tuple[bool | None, float]] = []
        self.saved = [self.scaler.state_dict()]  # the states after each update (a stale one)

    def call(self, step: int, name: str, function: Any, *args: Any) -> Any:
        """Run one of the loop's calls, recording the scaler's warnings it gave, or (warnings
        as errors) raising them; a hook's own failure is the hook's, not the scaler's: left
        out, and where it raises (at the end of `update()`) this rank goes on."""
        errors = self.scenario["warnings"] == "errors"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if errors:
                warnings.simplefilter("error", ShardScaleWarning)
            try:
                result = function(*args)
            except ShardScaleWarning as warning:
                if not any(own in str(warning) for own in _ITS_OWN):
                    raise
                result = None
        for warning in caught:
            text = str(warning.message)
            ours = issubclass(warning.category, ShardScaleWarning)
            if ours and not any(own in text for own in _ITS_OWN):
                self.events.append((step, name, "warns", text[:80]))
        return result

    def observe(self, what: str) -> None:
        """This rank's observers' reads (thrown away, and their warnings with them)."""
        scaler, observers = self.scaler, self.mine["observers"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if what == "after unscale" and "reads" in observers:
                for optimizer in self.optimizers:
                    scaler._per_optimizer_states[id(optimizer)]
            if what == "after update" and "stats" in observers:
                scaler.stats  # noqa: B018
            if what == "after update" and "reads" in observers:
                scaler.last_step_skipped  # noqa: B018
                scaler.get_scale()

    def step(self, step: int) -> None:
        scenario, model, scaler, mine = self.scenario, self.model, self.scaler, self.mine
        if mine["load"] != "none" and step == mine["load_at"]:  # between iterations
            state = self.saved[-1] if mine["load"] == "current" else self.saved[0]
            self.call(step, "load_state_dict", scaler.load_state_dict, state)
        if scenario["closure"]:  # the batch's calls inside the step, which may rerun them
            closure = functools.partial(self.backward, step)
            target = self.optimizers if len(self.optimizers) > 1 else self.optimizers[0]
            self.call(step, "step", lambda: scaler.step(target, closure=closure))
            self.finish(step)
            return
        self.call(step, "scale", self.backward, step)
        params = dict(model.named_parameters())
        if scenario["unscale_first"]:
            for optimizer in self.optimizers:
                self.call(step, "unscale_", scaler.unscale_, optimizer)
            self.observe("after unscale")
        if scenario["clip"] is not None:
            clipped = [params[name] for name in scenario["clip"]]
            if mine["clip_list"] == "own gradients":  # as torch's clip_grad_norm_ filters
                clipped = [param for param in clipped if param.grad is not None]
            clip = scaler.clip_grad_norm_
            self.call(step, "clip_grad_norm_", clip, clipped, 1.0, scenario["norm_type"])
        for optimizer in self.optimizers:
            self.call(step, "step", self._step_body, optimizer)
        self.finish(step)

    def backward(self, step: int) -> torch.Tensor | None:
        """The batch: its micro-batches' scaled backward, then this rank's gradients for the
        step, at the scale they would carry (a rank that never scaled: the one it would have).
        Returns the last loss (a closure's)."""
        model, scaler, mine = self.model, self.scaler, self.mine
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = None
        for micro in range(mine["micro_batches"][step - 1]):
            inputs = torch.full((3,), 2.0 ** (step + micro))
            if mine["nonfinite_loss_at"] == step:
                inputs[0] = math.inf
            loss = (model.control * inputs).sum()
            scaler.scale(loss).backward()
        scale = scaler.get_scale()
        params = dict(model.named_parameters())
        for name, kind in mine["held"][step - 1].items():
            if kind != "none":
                params[name].grad = _scaled_gradient(kind, params[name].shape, scale)
        return loss

    def finish(self, step: int) -> None:
        """The iteration's update, and what this rank keeps and reads of it."""
        scaler = self.scaler
        self.call(step, "update", scaler.update)
        self.saved.append(scaler.state_dict())
        self.observe("after update")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.decisions.append((scaler.last_step_skipped, scaler.get_scale()))

    def _step_body(self, optimizer: torch.optim.Optimizer) -> None:
        scaler = self.scaler
        if self.scenario["body"] == "step":
            scaler.step(optimizer)
            return
        # torch.amp's GradScaler.step, as subclasses and framework scalers run it
        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"].name == "READY":
            scaler.unscale_(optimizer)
        scaler._maybe_opt_step(optimizer, scaler._per_optimizer_states[id(optimizer)])


def _run_scenario(rank: int, scenario: dict[str, Any]) -> dict[str, Any]:
    run = _Run(rank, scenario)
    mine, shardscale_log = run.mine, logging.getLogger("shardscale")
    level = shardscale_log.level

    def hook(stats: Any) -> None:
        if stats.steps == mine["hook_raises_at"]:
            raise ConnectionError("the metrics backend is unreachable")

    with ExitStack() as stack:
        log = stack.enter_context(recorded_collectives())
        if "hook" in mine["observers"]:
            stack.callback(run.scaler.register_stats_hook(hook).remove)
        if "log" in mine["observers"]:
            shardscale_log.setLevel(logging.INFO)
            stack.callback(shardscale_log.setLevel, level)
        for step in range(1, STEPS + 1):
            try:
                run.step(step)
            except Exception as error:  # the same call, the same error, on every rank
                run.events.append((step, "raised", type(error).__name__, str(error)[:200]))
                break
    params = dict(run.model.named_parameters())
    return {
        "collectives": log,
        "events": run.events,
        "decisions": run.decisions,
        "equal": {name: params[name].detach().tolist() for name in _equal_grads(scenario)},
    }


def _equal_grads(scenario: dict[str, Any]) -> list[str]:
    """The parameters whose gradients were equal on both ranks at every step: the control's
    (its own loss), and any other that held the same finite gradient on both."""
    first, second = scenario["ranks"]
    backwards = ("micro_batches", "nonfinite_loss_at")
    same = ["control"] if all(first[key] == second[key] for key in backwards) else []
    for name in ("dense.weight", "dense.bias", "expert.weight"):
        pairs = zip(first["held"], second["held"], strict=True)
        if all(a[name] == b[name] == "finite" for a, b in pairs):
            same.append(name)
    return same


def _rank_scenarios(rank: int, world_size: int, scenarios: list[Any], path: str) -> list[Any]:
    results = []
    for scenario in scenarios:
        if path == "cuda":
            with cuda_path():
                results.append(_run_scenario(rank, scenario))
        else:
            results.append(_run_scenario(rank, scenario))
        try:
            dist.barrier()  # the next scenario starts together (recorded by neither)
        except RuntimeError as error:  # DETAIL saw the ranks' collectives differ: stop here
            results.append({"barrier": str(error)[:400]})
            break
    return results


@pytest.mark.parametrize("debug", ["DETAIL", "off"])
@pytest.mark.parametrize("path", ["cpu", "cuda"])
def test_rank_fuzz_what_ranks_hold_and_observe_never_splits_them(path: str, debug: str) -> None:
    scenarios = derandomized(SCENARIOS, EXAMPLES)
    timeout = 60 + 3 * len(scenarios)
    env = DETAIL if debug == "DETAIL" else {"TORCH_DISTRIBUTED_DEBUG": "OFF"}
    rank0, rank1 = run_ranks(_rank_scenarios, 2, scenarios, path, timeout_s=timeout, env=env)
    raised = 0
    for scenario, mine, theirs in zip(scenarios, rank0, rank1, strict=False):
        assert mine["collectives"] == theirs["collectives"], scenario
        assert mine["events"] == theirs["events"], scenario
        assert mine["decisions"] == theirs["decisions"], scenario
        assert mine["equal"] == theirs["equal"], scenario
        for event in mine["events"]:
            assert "ShardScaleDistributedError" not in event, (scenario, event)  # no timeout
        raised += any(event[1] == "raised" for event in mine["events"])
    assert len(rank0) == len(rank1) == len(scenarios), (rank0[-1], rank1[-1])
    assert raised < len(scenarios)  # most scenarios run through: the search reaches the steps
