"""Drop-in as torch's scalers are used in the wild: isinstance, torch's private members, duck-typed
groups and the ``step(grad_scaler=...)`` protocol, answered from the agreed state."""

from __future__ import annotations

import inspect
import math
import pickle
import re
import warnings
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.distributed.tensor import DTensor

from shardscale import (
    AsyncShardedGradScaler,
    ShardedGradScaler,
    ShardScaleWarning,
    _compat,
    count_collectives,
)
from tests import setups
from tests.harness import run_ranks

SCALERS = [ShardedGradScaler, AsyncShardedGradScaler]

# object's members, which torch's GradScaler inherits and neither class defines.
_OBJECT_MEMBERS = frozenset(
    name for name in dir(object) if name not in vars(torch.amp.GradScaler)
) | {"__dict__", "__weakref__", "__module__", "__doc__"}


class DummyProcessGroup:
    """torch's ``torch.testing._internal.common_fsdp.DummyProcessGroup``: rank() and size()."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _overflowing_step(scaler: ShardedGradScaler, overflow: bool) -> tuple[Any, Any]:
    model, optimizer = setups.scaled_backward(scaler)
    if overflow:
        model[0].weight.grad[0, 0] = math.inf
    scaler.step(optimizer)
    return model, optimizer


def _skipped(scaler: ShardedGradScaler, optimizer: torch.optim.Optimizer) -> float:
    """The idiom of public training code: sum the per-device flags of torch's private state."""
    states = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return sum(v.item() for v in states.values())


# ------------------------------------------------------------------ isinstance and torch's members


@pytest.mark.parametrize("cls", SCALERS)
def test_isinstance_torch_grad_scaler_true(cls: type[ShardedGradScaler]) -> None:
    assert isinstance(cls(), torch.amp.GradScaler)


@pytest.mark.parametrize("cls", SCALERS)
def test_isinstance_torch_sharded_grad_scaler_false_by_decision(
    cls: type[ShardedGradScaler],
) -> None:
    # docs/migration.md says why: code that asks for torch's sharded class relies on its
    # internals (its per-device all_reduce in unscale_, _amp_update_scale_cpu_).
    assert not isinstance(cls(), TorchShardedGradScaler)


@pytest.mark.parametrize("cls", SCALERS)
def test_torch_grad_scaler_members_every_one_defined_by_shardscale(
    cls: type[ShardedGradScaler],
) -> None:
    """No member of torch's GradScaler runs torch's logic on our state: each is ours (defined
    by a shardscale class), or one of object's. A torch adding a member fails here."""
    inherited = []
    for name in dir(torch.amp.GradScaler):
        if name in _OBJECT_MEMBERS:
            continue
        owner = next(klass for klass in cls.__mro__ if name in vars(klass))
        if not owner.__module__.startswith("shardscale"):
            inherited.append(f"{name} (from {owner.__module__}.{owner.__qualname__})")
    assert not inherited, f"torch's members not defined by {cls.__name__}: {inherited}"


def test_torch_private_members_set_from_compat_not_written_in_the_class_body() -> None:
    """The scaler's class body reads as its public API: torch's private members are set on the
    class from `shardscale._compat`'s table, not written in it, and its only base is torch's
    (no shardscale mixin for the API page to show)."""
    assert ShardedGradScaler.__bases__ == (torch.amp.GradScaler,)
    torchs = set(dir(torch.amp.GradScaler)) | set(vars(torch.amp.GradScaler("cpu")))
    private = {name for name in torchs if name.startswith("_") and not name.startswith("__")}
    body = inspect.getsource(ShardedGradScaler)
    written = [name for name in private if re.search(rf"^    (def )?{name}\b", body, re.M)]
    assert not written, written
    # each is set on the class (the table's) or an instance's own attribute (`_enabled`)
    unanswered = private - set(vars(ShardedGradScaler)) - set(vars(ShardedGradScaler()))
    assert not unanswered, sorted(unanswered)


@pytest.mark.parametrize("cls", SCALERS)
def test_torch_grad_scaler_instance_attributes_every_one_answered(
    cls: type[ShardedGradScaler],
) -> None:
    """The attributes torch's __init__ sets (never run for ours) are ours too."""
    torch_attributes = vars(torch.amp.GradScaler("cpu"))
    scaler = cls()
    for name in torch_attributes:
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        assert name in vars(scaler) or (
            owner is not None and owner.__module__.startswith("shardscale")
        ), name
        getattr(scaler, name)  # readable


def test_isinstance_guarded_resume_restores_state() -> None:
    trained = ShardedGradScaler(init_scale=1024.0, growth_interval=3)
    for overflow in (False, True, False, False):
        _overflowing_step(trained, overflow)
        trained.update()
    saved = pickle.loads(pickle.dumps(trained.state_dict()))
    resumed: Any = ShardedGradScaler(init_scale=1024.0, growth_interval=3)
    if isinstance(resumed, torch.amp.GradScaler):  # the guard of public training scripts
        resumed.load_state_dict(saved)
    assert resumed.get_scale() == trained.get_scale() == 512.0
    assert resumed._get_growth_tracker() == trained._get_growth_tracker() == 2
    assert resumed.stats.skipped_steps == 1


# ------------------------------------------------------------------ the views


@pytest.mark.parametrize("overflow", [False, True])
def test_per_optimizer_states_after_step_agreed_flag_and_stage(overflow: bool) -> None:
    scaler = ShardedGradScaler()
    _, optimizer = _overflowing_step(scaler, overflow)
    state = scaler._per_optimizer_states[id(optimizer)]
    assert state["stage"] is OptState.STEPPED
    assert _skipped(scaler, optimizer) == float(overflow)
    assert scaler._found_inf_per_device(optimizer) == state["found_inf_per_device"]
    assert list(scaler._per_optimizer_states) == [id(optimizer)]


@pytest.mark.parametrize("overflow", [False, True])
def test_maybe_opt_step_torch_step_body_steps_as_agreed(overflow: bool) -> None:
    """torch.amp's step body, as subclasses and framework scalers run it: `unscale_`, then
    `_maybe_opt_step` with the optimizer's state; it steps (or skips) as `step()` would, and
    leaves the optimizer STEPPED, so that update() moves the scale."""
    scaler = ShardedGradScaler(init_scale=2.0**10)
    model, optimizer = setups.scaled_backward(scaler)
    if overflow:
        model[0].weight.grad[0, 0] = math.inf
    calls: list[int] = []
    optimizer.step = lambda: calls.append(1)  # type: ignore[assignment,method-assign,return-value]
    scaler.unscale_(optimizer)
    scaler._maybe_opt_step(optimizer, scaler._per_optimizer_states[id(optimizer)])
    assert len(calls) == (0 if overflow else 1)
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.STEPPED
    scaler.update()
    assert scaler.get_scale() == (2.0**9 if overflow else 2.0**10)


def test_per_optimizer_states_after_update_empty_as_torch() -> None:
    scaler = ShardedGradScaler()
    _, optimizer = _overflowing_step(scaler, True)
    kept = scaler._per_optimizer_states
    scaler.update()
    assert len(scaler._per_optimizer_states) == 0
    assert scaler._per_optimizer_states[id(optimizer)] == {
        "stage": OptState.READY,
        "found_inf_per_device": {},
    }
    assert scaler._per_optimizer_states.get(id(optimizer)) is None
    # like a reference to torch's old dict, a kept view still reads the finished iteration
    assert kept[id(optimizer)]["stage"] is OptState.STEPPED


def test_per_optimizer_states_after_unscale_reads_the_flag_at_world_size_one() -> None:
    """Between `unscale_()` and the call that agrees, a read gets this rank's own flag, as
    torch.amp's (a read never communicates): at world size 1 it is the group's, and nothing
    warns; after `step()`, the agreed one. The state is live, as torch's dict: one read before
    `unscale_()` answers what it did after."""
    scaler = ShardedGradScaler()
    _overflowing_step(scaler, False)  # the first unscale_ agrees at once: this one defers
    scaler.update()
    model, optimizer = setups.scaled_backward(scaler)
    model[2].bias.grad[0] = math.nan
    state = scaler._per_optimizer_states[id(optimizer)]  # read before, as torch's body does
    assert state["stage"] is OptState.READY
    scaler.unscale_(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert state["stage"] is OptState.UNSCALED
        assert sum(v.item() for v in state["found_inf_per_device"].values()) == 1.0
        assert _skipped(scaler, optimizer) == 1.0
        assert sum(v.item() for v in scaler._found_inf_per_device(optimizer).values()) == 1.0
    assert scaler.step(optimizer) is None
    assert scaler.last_step_skipped
    assert state["stage"] is OptState.STEPPED
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # agreed now: no warning
        assert _skipped(scaler, optimizer) == 1.0


def _rank_private_read_between_unscale_and_step(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's gradients overflow; rank 0 alone reads torch's private flag between unscale_
    and step (as a script logging on rank 0 does): its own flag, no collective of its own."""
    scaler = ShardedGradScaler(sync_timeout=10.0)
    seen = []
    for step in range(3):  # the first unscale_ agrees at once; the later ones defer
        model, optimizer = setups.scaled_backward(scaler)
        if rank == 1 and step == 2:
            model[0].weight.grad[0, 0] = math.inf
        scaler.unscale_(optimizer)
        if rank == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ShardScaleWarning)
                seen.append(_skipped(scaler, optimizer))
            seen.append(any("THIS rank's own flag" in str(w.message) for w in caught))
        scaler.step(optimizer)
        seen.append(scaler.last_step_skipped)
        scaler.update()
    return {"seen": seen, "scale": scaler.get_scale()}


def test_private_read_between_unscale_and_step_on_one_rank_communicates_nothing() -> None:
    rank0, rank1 = run_ranks(_rank_private_read_between_unscale_and_step, 2)
    # rank 0's own flag at step 3 says clean, the group's says skip: both ranks skipped; a
    # read between unscale_ and its agreement says it is this rank's own (the first step's
    # unscale_ agreed at once: no warning there)
    assert rank0["seen"] == [0.0, False, False, 0.0, True, False, 0.0, True, True]
    assert rank1["seen"] == [False, False, True]
    assert rank0["scale"] == rank1["scale"]


def test_per_optimizer_states_write_refused_but_torchs_stepped_stage() -> None:
    scaler = ShardedGradScaler()
    _, optimizer = _overflowing_step(scaler, False)
    states = scaler._per_optimizer_states
    with pytest.raises(TypeError, match="only 'stage' may be set"):
        states[id(optimizer)] = {}
    with pytest.raises(TypeError, match="only 'stage' may be set"):
        states[id(optimizer)]["stage"] = OptState.READY
    with pytest.raises(TypeError, match="only 'stage' may be set"):
        states[id(optimizer)]["found_inf_per_device"] = {}
    with pytest.raises(TypeError, match="only 'stage' may be set"):
        states[id(optimizer)]["found_inf_per_device"].clear()
    with pytest.raises(TypeError, match="only 'stage' may be set"):  # an optimizer not seen
        states[id(object())]["stage"] = OptState.STEPPED
    states[id(optimizer)]["stage"] = OptState.STEPPED  # torch's step body's last write
    assert states[id(optimizer)]["stage"] is OptState.STEPPED
    with pytest.raises(AttributeError, match=r"_per_optimizer_states .*cannot be assigned"):
        scaler._per_optimizer_states = {}  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("name", "value"), [("_scale", torch.ones(())), ("_growth_tracker", None), ("_device", "cpu")]
)
def test_private_tensor_attributes_assignment_refused(name: str, value: object) -> None:
    with pytest.raises(AttributeError, match=f"{name} mirrors shardscale's agreed state"):
        setattr(ShardedGradScaler(), name, value)


def test_private_scale_and_tracker_are_the_live_tensors() -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    assert scaler._scale is None
    assert scaler._growth_tracker is None
    assert scaler._init_scale == 8.0
    assert scaler._init_growth_tracker == 0
    scaler._lazy_init_scale_growth_tracker("cpu")
    assert scaler._scale is not None
    assert scaler._growth_tracker is not None
    assert scaler._check_scale_growth_tracker("update") == (scaler._scale, scaler._growth_tracker)
    scaler._scale.fill_(4.0)  # torch's in-place idiom sets the scale
    assert scaler.get_scale() == 4.0
    assert scaler._init_scale == 8.0  # torch's meaning: where the state started


def test_private_init_values_written_before_scale_take_effect() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3)
    scaler._init_scale = 32.0
    scaler._init_growth_tracker = 2
    _overflowing_step(scaler, False)
    scaler.update()
    assert scaler.get_scale() == 64.0  # the third clean step in a row grew it
    with pytest.raises(ValueError, match="_init_growth_tracker must be an int >= 0, got -1"):
        scaler._init_growth_tracker = -1


def test_private_policy_attributes_write_through_the_checked_setters() -> None:
    scaler = ShardedGradScaler()
    scaler._growth_factor = 4.0
    scaler._backoff_factor = 0.25
    scaler._growth_interval = 7
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)
    assert scaler.get_growth_interval() == scaler._growth_interval == 7
    with pytest.raises(ValueError, match=r"growth_factor must be a finite number > 1\.0, got 0\.5"):
        scaler._growth_factor = 0.5


def test_check_scale_growth_tracker_before_scale_raises_torchs_words() -> None:
    with pytest.raises(RuntimeError, match="Attempted update but _scale is None"):
        ShardedGradScaler()._check_scale_growth_tracker("update")


def test_views_not_built_on_steps_nobody_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The views cost nothing on a step: none of their code runs unless they are read."""

    def built(*args: object) -> None:
        raise AssertionError("a compatibility view was built on a step nobody read it")

    monkeypatch.setattr(_compat, "flags_of", built)
    monkeypatch.setattr(_compat, "OptimizerStates", built)
    for flavour in ({}, {"fused": True}):
        scaler = ShardedGradScaler()
        model = setups.mlp()
        optimizer = torch.optim.AdamW(model.parameters(), **flavour)  # type: ignore[arg-type]
        for overflow in (False, True):
            scaler.scale(model(torch.ones(2, 16)).sum()).backward()
            if overflow:
                model[0].weight.grad[0, 0] = math.inf
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


# ------------------------------------------------------------------ process groups


def test_duck_typed_group_of_one_works_without_init_process_group() -> None:
    assert not torch.distributed.is_initialized()
    group = DummyProcessGroup(0, 1)
    scaler = ShardedGradScaler(init_scale=4.0, process_group=group)  # type: ignore[arg-type]
    _overflowing_step(scaler, True)
    assert scaler.last_step_skipped
    scaler.update()
    assert scaler.get_scale() == 2.0
    assert scaler.process_group is group
    scaler.verify_agreement()  # world size 1: nothing to compare


def test_duck_typed_group_larger_than_one_raises_value_error() -> None:
    with pytest.raises(
        ValueError, match=r"must have size\(\) == 1.*not initialised.*Got size\(\) = 2"
    ):
        ShardedGradScaler(process_group=DummyProcessGroup(0, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("group", [object(), "world", 1])
def test_non_group_raises_type_error_with_rule_and_type(group: object) -> None:
    with pytest.raises(TypeError, match=rf"rank\(\) and size\(\).*got {type(group).__name__}"):
        ShardedGradScaler(process_group=group)  # type: ignore[arg-type]


# ------------------------------------------------------------------ step(grad_scaler=...)


class _ProtocolOptimizer(torch.optim.SGD):
    """A custom optimizer of torch's deprecated protocol: it checks and unscales itself."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self._step_supports_amp_scaling = True
        self.seen: dict[str, Any] = {}

    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        flags = grad_scaler._check_inf_per_device(self)
        self.seen = {
            "found_inf": sum(v.item() for v in flags.values()),
            "same": flags == grad_scaler._found_inf_per_device(self),
            "scale": grad_scaler._get_scale_async().item(),
        }
        if self.seen["found_inf"]:
            return "skipped"
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(1.0 / self.seen["scale"])
        super().step()
        return "stepped"


@pytest.mark.parametrize("overflow", [False, True])
def test_grad_scaler_protocol_passes_itself_and_warns_torchs_words(overflow: bool) -> None:
    scaler = ShardedGradScaler(init_scale=4.0)
    model = setups.mlp()
    optimizer = _ProtocolOptimizer(model.parameters())
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    if overflow:
        model[0].weight.grad[0, 0] = math.inf
    with pytest.warns(FutureWarning, match=r"GradScaler is going to stop passing itself"):
        result = scaler.step(optimizer)
    assert result == ("skipped" if overflow else "stepped")
    assert optimizer.seen == {"found_inf": float(overflow), "same": True, "scale": 4.0}
    assert scaler.last_step_skipped is overflow or bool(scaler.last_step_skipped) is overflow
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.STEPPED
    scaler.update()  # the flag the optimizer asked for is the iteration's
    assert scaler.get_scale() == (2.0 if overflow else 4.0)


def test_grad_scaler_protocol_warns_once_per_location() -> None:
    scaler = ShardedGradScaler()
    model = setups.mlp()
    optimizer = _ProtocolOptimizer(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: once per location
        for _ in range(3):
            scaler.scale(model(torch.ones(2, 16)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert [w.category for w in caught] == [FutureWarning]
    assert caught[0].filename == __file__


def test_grad_scaler_protocol_async_refused() -> None:
    scaler = AsyncShardedGradScaler()
    model = setups.mlp()
    optimizer = _ProtocolOptimizer(model.parameters())
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    with pytest.raises(NotImplementedError, match=r"does not pass itself.*grad_scaler"):
        scaler.step(optimizer)
    with pytest.raises(NotImplementedError, match="_check_inf_per_device"):
        scaler._check_inf_per_device(optimizer)


# ------------------------------------------------------------------ two ranks


def _rank_private_skip_detection(rank: int, world_size: int) -> list[dict[str, Any]]:
    """FSDP2: only rank 1's shard overflows at step 2; public code's skip detection reads
    torch's private state, and a protocol optimizer asks ``_check_inf_per_device``."""
    setup = setups.build("fsdp2", "foreach", world_size)
    scaler = ShardedGradScaler(init_scale=2.0**10)
    seen = []
    for step in range(3):
        setup.optimizer.zero_grad()
        scaler.scale(setup.loss(step, rank)).backward()
        if step == 1 and rank == 1:
            setups.plant(setup.optimizer, math.inf)
        scaler.step(setup.optimizer)
        state = scaler._per_optimizer_states[id(setup.optimizer)]
        flags = scaler._found_inf_per_device(setup.optimizer)
        seen.append(
            {
                "skipped": sum(v.item() for v in state["found_inf_per_device"].values()),
                "stage": state["stage"].name,
                "same": sum(v.item() for v in flags.values()),
            }
        )
        scaler.update()
    return seen


def test_fsdp2_private_skip_detection_agrees_on_every_rank() -> None:
    results = run_ranks(_rank_private_skip_detection, 2)
    expected = [
        {"skipped": float(step == 1), "stage": "STEPPED", "same": float(step == 1)}
        for step in range(3)
    ]
    assert results == [expected, expected]


def _rank_protocol_check_agrees(rank: int, world_size: int) -> list[Any]:
    """Plain replicas, only rank 0 overflows: the protocol optimizer's check is the group's."""
    scaler = ShardedGradScaler(init_scale=4.0)
    model = setups.mlp()
    optimizer = _ProtocolOptimizer(model.parameters())
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    if rank == 0:
        model[0].weight.grad[0, 0] = math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        result = scaler.step(optimizer)
    scaler.update()
    return [result, optimizer.seen["found_inf"], scaler.get_scale()]


def test_grad_scaler_protocol_check_agrees_on_every_rank() -> None:
    assert run_ranks(_rank_protocol_check_agrees, 2) == [["skipped", 1.0, 2.0]] * 2


def _rank_unscale_grads_local_on_dtensor_shards(rank: int, world_size: int) -> list[Any]:
    """torch's ``_unscale_grads_`` on FSDP2's DTensor gradients: each rank's own shard, no
    collective (as torch's), so only the rank that holds the inf raises its flag."""
    setup = setups.build("fsdp2", "foreach", world_size)
    setup.loss(0, rank).backward()
    if rank == 1:
        setups.plant(setup.optimizer, math.inf)
    params = [p for group in setup.optimizer.param_groups for p in group["params"]]
    before = [p.grad.to_local().clone() for p in params if isinstance(p.grad, DTensor)]
    scaler = ShardedGradScaler()
    with count_collectives() as counts:
        flags = scaler._unscale_grads_(setup.optimizer, torch.full((1,), 0.5), torch.zeros(1))
    after = [p.grad.to_local() for p in params if isinstance(p.grad, DTensor)]
    halved = bool(after) and all(
        torch.equal(a[a.isfinite()], (b * 0.5)[a.isfinite()])
        for a, b in zip(after, before, strict=True)
    )
    return [sum(v.item() for v in flags.values()), halved, sum(counts.values())]


def test_unscale_grads_on_fsdp2_shards_is_local_as_torchs() -> None:
    assert run_ranks(_rank_unscale_grads_local_on_dtensor_shards, 2) == [
        [0.0, True, 0],
        [1.0, True, 0],
    ]
