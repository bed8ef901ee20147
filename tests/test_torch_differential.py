"""torch is the oracle: `torch.amp.GradScaler` and ours through the same random sequences of
torch's public AMP API, compared bitwise after every call.

A scenario is a scaler's settings (`init_scale`, the growth and backoff factors, the interval,
`enabled`), one to three optimizers of the CPU's flavours (for-loop, foreach, momentum, Adam,
fused SGD/Adam/AdamW/Adagrad), each over its own layer with one or two param groups, how
`step` runs (ours, torch's own body run on ours, or a subclass whose `step()` is torch's
body), and a sequence of calls: backwards (fp32, CPU autocast fp16 with its own overflows, a
planted inf or NaN, a non-finite loss, over any subset of the layers, micro-batches by
repetition), `zero_grad`, `unscale_`, `torch.nn.utils.clip_grad_norm_`, `step` (with a closure
too), `update()` and `update(new_scale)`, the setters, `state_dict` saves and loads, pickling,
`get_scale`. Both sides run each call on twin models; after it, what it returned or raised, the
parameters, gradients, optimizer states, scale, growth tracker and `state_dict()`'s torch keys
must be equal, bit for bit (NaN where NaN). A difference must be one of docs/migration.md's
table rows (by its id, each with a rule here that recognises it) or the test fails; the first
documented difference ends the scenario (the states have parted, as the row says).

The 2-rank form runs the same scenarios on two gloo ranks, each with the same data: every rank
must equal torch at world size 1 the same way.

CI runs `EXAMPLES` scenarios in one process and `RANK_EXAMPLES` on two ranks
(`SHARDSCALE_DIFF_EXAMPLES`, `SHARDSCALE_DIFF_RANK_EXAMPLES` set others).
"""

from __future__ import annotations

import math
import os
import pickle
import random
import re
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from shardscale import ShardedGradScaler, ShardScaleNonFiniteError
from tests.drawn import derandomized
from tests.harness import run_ranks
from tests.test_torch_protocol import TorchBodyScaler

EXAMPLES = int(os.environ.get("SHARDSCALE_DIFF_EXAMPLES", "500"))
RANK_EXAMPLES = int(os.environ.get("SHARDSCALE_DIFF_RANK_EXAMPLES", "60"))
TABLE = Path(__file__).resolve().parents[1] / "docs" / "migration.md"
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
MIN_SCALE = 2.0**-24

FLAVOURS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, foreach=False),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=True),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01, foreach=True),
    "sgd-fused": lambda groups: torch.optim.SGD(groups, lr=0.1, fused=True),
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, lr=0.01, fused=True),
    "adagrad-fused": lambda groups: torch.optim.Adagrad(groups, lr=0.1, fused=True),
}
# On CUDA (tests/test_gpu.py): Adagrad's fused kernel is the CPU's alone, and the capturable
# flavours exist there only; a drawn scenario's flavours are swapped so, the rest kept.
CUDA_FLAVOURS = {
    "adam-capturable": lambda groups: torch.optim.Adam(groups, lr=0.01, capturable=True),
    "adamw-fused-capturable": lambda groups: torch.optim.AdamW(
        groups, lr=0.01, fused=True, capturable=True
    ),
}
ON_CUDA = {"adam": "adam-capturable", "adagrad-fused": "adamw-fused-capturable"}
BACKWARDS = ("fp32", "fp16", "fp16", "fp16-overflow", "inf", "nan", "nan-loss")


# ---------------------------------------------------------------- scenarios


# The calls, by how often a scenario draws them: the protocol's own most often (a scenario then
# goes deep), those that end it where they differ (documented) seldom.
CALLS = {
    "backward": 24,
    "zero_grad": 8,
    "unscale_": 10,
    "clip": 4,
    "step": 18,
    "update": 12,
    "update_to": 2,
    "save": 2,
    "pickle": 1,
    "scale_only": 1,
    "get_scale": 1,
    "set": 1,
    "load": 1,
    "closure": 0.5,
    "step_list": 0.5,
}
SETTINGS = [("growth_factor", v) for v in (2.0, 3.0, 0.5)]
SETTINGS += [("backoff_factor", v) for v in (0.5, 0.25, 1.5)]
SETTINGS += [("growth_interval", v) for v in (1, 2, 3, 0)]


def draw_calls(seed: int, count: int) -> list[tuple[Any, ...]]:
    """`count` calls, drawn from `seed` (Hypothesis draws the seed and the count)."""
    rng = random.Random(seed)
    names, weights = list(CALLS), list(CALLS.values())
    calls: list[tuple[Any, ...]] = []
    for name in rng.choices(names, weights, k=count):
        layer = rng.randrange(3)
        if name == "backward":
            layers = (
                {0, 1, 2} if rng.random() < 0.5 else set(rng.sample(range(3), rng.randint(1, 3)))
            )
            calls.append((name, rng.choice(BACKWARDS), layers, rng.randrange(2**16), layer))
        elif name in ("unscale_", "clip", "step", "closure"):
            calls.append((name, layer))
        elif name == "zero_grad":
            calls.append((name, layer, rng.random() < 0.5))
        elif name == "update_to":
            calls.append((name, rng.choice((1.0, 3.0, 2.0**20, 0.0)), rng.random() < 0.5))
        elif name == "set":
            calls.append((name, *rng.choice(SETTINGS)))
        elif name == "load":
            calls.append((name, rng.randrange(4)))
        else:
            calls.append((name,))
    return calls


SCENARIOS = st.fixed_dictionaries(
    {
        "init_scale": st.sampled_from((2.0**16, 6553.6, 1.0, 2.0**-20, 1024.0)),
        "growth_factor": st.sampled_from((2.0, 3.0)),
        "backoff_factor": st.sampled_from((0.5, 0.25)),
        "growth_interval": st.sampled_from((1, 2, 3, 2000)),
        "enabled": st.sampled_from((True, True, True, False)),
        "optimizers": st.lists(
            st.tuples(st.sampled_from(sorted(FLAVOURS)), st.sampled_from((1, 2))),
            min_size=1,
            max_size=3,
        ),
        "body": st.sampled_from(("ours", "ours", "torch", "subclass")),
        "ops": st.builds(draw_calls, st.integers(0, 2**32), st.integers(12, 48)),
    }
)


def on_cuda(scenario: dict[str, Any]) -> dict[str, Any]:
    """`scenario` on the GPU: its tensors, scalers and autocast there, its flavours CUDA's."""
    optimizers = [
        (ON_CUDA.get(flavour, flavour), groups) for flavour, groups in scenario["optimizers"]
    ]
    return {**scenario, "optimizers": optimizers, "device": "cuda"}


# ---------------------------------------------------------------- one side


@dataclass
class Side:
    """One scaler with its own twin model and optimizers."""

    scaler: Any
    layers: nn.ModuleList
    optimizers: list[torch.optim.Optimizer]
    body: str = "ours"
    device: str = "cpu"
    saved: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, scenario: dict[str, Any], ours: bool, **options: Any) -> Side:
        device = scenario.get("device", "cpu")
        torch.manual_seed(0)
        layers = nn.ModuleList(nn.Linear(4, 4) for _ in scenario["optimizers"]).to(device)
        optimizers = []
        for layer, (flavour, groups) in zip(layers, scenario["optimizers"], strict=True):
            params = [{"params": [layer.weight]}, {"params": [layer.bias], "lr": 0.05}]
            if groups == 1:
                params = [{"params": list(layer.parameters())}]
            optimizers.append({**FLAVOURS, **CUDA_FLAVOURS}[flavour](params))
        settings_ = {k: scenario[k] for k in ("init_scale", "growth_factor", "backoff_factor")}
        settings_ |= {"growth_interval": scenario["growth_interval"]}
        settings_["enabled"] = scenario["enabled"]
        if ours:
            kind = TorchBodyScaler if scenario["body"] == "subclass" else ShardedGradScaler
            scaler = kind(device, **settings_, **options)
        else:
            scaler = torch.amp.GradScaler(device, **settings_)
        return cls(scaler, layers, optimizers, scenario["body"] if ours else "ours", device)

    def loss(self, kind: str, layers: set[int], seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(2, 4, generator=generator).to(self.device)
        if kind == "fp16-overflow":
            inputs = inputs * 3e3
        used = [self.layers[i % len(self.layers)] for i in sorted(layers)]
        with torch.autocast(self.device, dtype=torch.float16, enabled=kind != "fp32"):
            loss = sum(layer(inputs).float().pow(2).mean() for layer in used)
        return loss * math.nan if kind == "nan-loss" else loss

    def apply(self, op: tuple[Any, ...]) -> Any:
        """Run one call; return what it returned (a comparable form)."""
        name, *args = op
        count = len(self.optimizers)
        scaler = self.scaler
        if name == "backward":
            kind, layers, seed, planted = args
            loss = self.loss(kind, layers, seed)
            scaler.scale(loss).backward()
            if kind in ("inf", "nan"):
                grad = self.layers[planted % count].weight.grad
                if grad is not None:
                    grad[0, 0] = math.inf if kind == "inf" else math.nan
            return bool(loss.isfinite())  # the rules need it (a forward overflow)
        if name == "zero_grad":
            self.optimizers[args[0] % count].zero_grad(set_to_none=args[1])
            return None
        if name == "unscale_":
            return scaler.unscale_(self.optimizers[args[0] % count])
        if name == "clip":
            params = list(self.layers[args[0] % count].parameters())
            return _value(torch.nn.utils.clip_grad_norm_(params, 1.0))
        if name == "step":
            return self.step(self.optimizers[args[0] % count])
        if name == "closure":
            optimizer = self.optimizers[args[0] % count]
            return scaler.step(optimizer, closure=lambda: self._closure(optimizer))
        if name == "step_list":
            return scaler.step(list(self.optimizers))
        return self._apply_state(name, args)

    def step(self, optimizer: torch.optim.Optimizer) -> Any:
        if self.body == "torch":  # torch's own body, run on ours
            return torch.amp.GradScaler.step(self.scaler, optimizer)
        return self.scaler.step(optimizer)

    def _closure(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = self.loss("fp32", {0, 1, 2}, 7)
        self.scaler.scale(loss).backward()
        return loss

    def _apply_state(self, name: str, args: list[Any]) -> Any:
        scaler = self.scaler
        if name == "update":
            return scaler.update()
        if name == "update_to":
            value, as_tensor = args
            return scaler.update(
                torch.tensor(value, device=self.device) if as_tensor else float(value)
            )
        if name == "set":
            setting, value = args
            return getattr(scaler, f"set_{setting}")(value)
        if name == "save":
            self.saved.append(scaler.state_dict())
            return None
        if name == "load":
            state = self.saved[args[0] % len(self.saved)] if self.saved else scaler.state_dict()
            return scaler.load_state_dict(dict(state))
        if name == "pickle":
            self.scaler = pickle.loads(pickle.dumps(scaler))
            return None
        if name == "scale_only":
            return _value(scaler.scale(torch.tensor(1.5, device=self.device)))
        assert name == "get_scale"
        return scaler.get_scale()

    def snapshot(self) -> dict[str, Any]:
        """What must be equal after every call."""
        state = self.scaler.state_dict()
        return {
            "params": [_value(p) for p in self.layers.parameters()],
            "grads": [None if p.grad is None else _value(p.grad) for p in self.layers.parameters()],
            "optimizers": [_value(o.state_dict()) for o in self.optimizers],
            "scale": self.scaler.get_scale(),
            "state_dict": {k: state[k] for k in TORCH_KEYS if k in state},
        }


def _value(value: Any) -> Any:
    """A comparable form: tensors as (dtype, bits), NaNs included; containers recursively."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.is_floating_point():
            bits = tensor.to(torch.float64).reshape(-1).tolist()
            return (str(tensor.dtype), [repr(v) for v in bits])
        return (str(tensor.dtype), tensor.reshape(-1).tolist())
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_value(v) for v in value]
    if isinstance(value, float):
        return repr(value)
    return value


# ---------------------------------------------------------------- the table's rules


@dataclass
class Call:
    """One call on both sides: what each returned or raised, and what went before."""

    op: tuple[Any, ...]
    torch_outcome: tuple[str, Any]
    our_outcome: tuple[str, Any]
    context: dict[str, Any]
    torch_scale: float


def _raised(outcome: tuple[str, Any], kind: type[BaseException] = BaseException) -> bool:
    return outcome[0] == "raised" and isinstance(outcome[1], kind)


def _same_words(call: Call) -> bool:
    """torch asserted; ours raised an exception that survives -O, torch's words first."""
    if not (_raised(call.torch_outcome, AssertionError) and _raised(call.our_outcome)):
        return False
    theirs = str(call.torch_outcome[1]).split(".")[0].split(":")[0]
    return str(call.our_outcome[1]).startswith(theirs)


def _checked_setting(call: Call) -> bool:
    name, *args = call.op
    if name != "set" or not _raised(call.our_outcome, (ValueError, TypeError)):
        return False
    setting, value = args
    return {
        "growth_factor": not value > 1,
        "backoff_factor": not 0 < value < 1,
        "growth_interval": isinstance(value, float) or value < 1,
    }[setting]


def _checked_new_scale(call: Call) -> bool:
    name, *args = call.op
    bad = name == "update_to" and not (MIN_SCALE <= args[0] < math.inf) and not args[1]
    return bad and _raised(call.our_outcome, ValueError)


RULES: dict[str, Callable[[Call], bool]] = {
    "exception-types": _same_words,
    "forward-overflow": lambda call: call.op[0] == "update" and call.context["nonfinite_loss"],
    "floor": lambda call: (
        call.torch_scale < MIN_SCALE or _raised(call.our_outcome, ShardScaleNonFiniteError)
    ),
    "checked-settings": _checked_setting,
    "checked-new-scale": _checked_new_scale,
    "load-mid-iteration": lambda call: (
        call.op[0] == "load"
        and _raised(call.our_outcome, RuntimeError)
        and "may only be loaded at the beginning" in str(call.our_outcome[1])
    ),
    "closure": lambda call: (
        call.op[0] == "closure"
        and "Closure use is not currently supported" in str(call.torch_outcome[1])
    ),
    "list-of-optimizers": lambda call: (
        call.op[0] == "step_list" and _raised(call.torch_outcome, AttributeError)
    ),
    "fused-unscaled-without-gradients": lambda call: (
        call.op[0] == "step"
        and _raised(call.our_outcome, RuntimeError)
        and "No inf checks were recorded for this optimizer" in str(call.our_outcome[1])
        and not _raised(call.torch_outcome, AssertionError)
    ),
    "fp16-gradients": lambda call: (
        "Attempting to unscale FP16 gradients" in str(call.torch_outcome[1])
    ),
}
# Rules under which both sides go on alike: a difference of exception type only.
CONTINUES = {"exception-types"}


def table_ids() -> list[str]:
    """The ids of docs/migration.md's table of differences (its first column)."""
    text = TABLE.read_text()
    header = "| id | where | `torch.amp.GradScaler` | shardscale | why |"
    start = text.index(header)
    rows = text[start:].split("\n\n")[0].splitlines()[2:]
    return [re.match(r"\| `([^`]+)` \|", row).group(1) for row in rows]  # type: ignore[union-attr]


# ---------------------------------------------------------------- the comparison


def _outcome(side: Side, op: tuple[Any, ...]) -> tuple[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ("returned", _value(side.apply(op)))
        except Exception as error:  # the exception type at the same call
            return ("raised", error)


def _same_outcome(theirs: tuple[str, Any], ours: tuple[str, Any]) -> bool:
    if theirs[0] != ours[0]:
        return False
    if theirs[0] == "returned":
        return bool(theirs[1] == ours[1])
    return type(theirs[1]) is type(ours[1])


def _track(context: dict[str, Any], op: tuple[Any, ...], outcome: tuple[str, Any]) -> None:
    """What the rules need to know of the calls so far: a non-finite loss in this iteration
    (what torch's backward said of its loss)."""
    if op[0] in ("update", "update_to") and outcome[0] == "returned":
        context["nonfinite_loss"] = False
    elif op[0] == "backward" and outcome == ("returned", False):
        context["nonfinite_loss"] = True


def run_scenario(scenario: dict[str, Any], **options: Any) -> list[str]:
    """Both scalers through `scenario`; the documented differences met (row ids, in order).

    Raises:
        AssertionError: a difference that no row of docs/migration.md's table accounts for.
    """
    theirs, ours = Side.build(scenario, False), Side.build(scenario, True, **options)
    met: list[str] = []
    context = {"nonfinite_loss": False}
    for index, op in enumerate(scenario["ops"]):
        torch_outcome, our_outcome = _outcome(theirs, op), _outcome(ours, op)
        if op[0] == "backward":
            _track(context, op, torch_outcome)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            before_theirs, before_ours = theirs.snapshot(), ours.snapshot()
        same = _same_outcome(torch_outcome, our_outcome) and before_theirs == before_ours
        call = Call(op, torch_outcome, our_outcome, dict(context), float(before_theirs["scale"]))
        _track(context, op, torch_outcome)
        if same:
            continue
        rows = [row for row, rule in RULES.items() if rule(call)]
        if not rows:
            differing = [k for k in before_theirs if before_theirs[k] != before_ours[k]]
            raise AssertionError(
                f"call {index} {op}: an undocumented difference from torch.amp.GradScaler: "
                f"torch {torch_outcome!r}, ours {our_outcome!r}; differing {differing}; "
                f"scenario {scenario}"
            )
        met.append(rows[0])
        if rows[0] in CONTINUES and before_theirs == before_ours:
            continue
        break
    return met


def test_differential_table_rows_each_have_a_rule() -> None:
    """The table the test reads and the rules it holds are the same set: a row nobody can meet
    without a rule, or a rule for a row the docs do not have, fails."""
    assert sorted(table_ids()) == sorted(RULES)


def test_differential_against_torch_amp_grad_scaler_at_world_size_one() -> None:
    met: Counter[str] = Counter()
    ended = 0  # scenarios a documented difference ended early
    for scenario in derandomized(SCENARIOS, EXAMPLES):
        rows = run_scenario(scenario)
        met.update(set(rows))
        ended += any(row not in CONTINUES for row in rows)
    # the search reaches the protocol's corners, and most scenarios run to their end
    assert met["exception-types"] > 0
    assert ended < EXAMPLES / 2, met


# ---------------------------------------------------------------- on two ranks


def rank_differential(rank: int, world_size: int, scenarios: list[dict[str, Any]]) -> list[Any]:
    results: list[Any] = []
    for scenario in scenarios:
        try:
            results.append(run_scenario(scenario, sync_timeout=30.0))
        except AssertionError as error:
            results.append(str(error)[:2000])
    return results


def test_differential_on_two_ranks_every_rank_equals_torch_at_world_size_one() -> None:
    """The same data on every rank: each rank's scaler, agreeing with the other over gloo,
    must equal torch's at world size 1 call for call (pickling left out: a scaler bound to the
    world group pickles, but its copy would be a new one on one rank only here)."""
    scenarios = [
        {**scenario, "ops": [op for op in scenario["ops"] if op[0] != "pickle"]}
        for scenario in derandomized(SCENARIOS, RANK_EXAMPLES)
    ]
    rank0, rank1 = run_ranks(rank_differential, 2, scenarios, timeout_s=120 + 3 * len(scenarios))
    for scenario, mine, theirs in zip(scenarios, rank0, rank1, strict=True):
        assert isinstance(mine, list), mine
        assert mine == theirs, scenario
