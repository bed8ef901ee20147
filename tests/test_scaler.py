"""ShardedGradScaler in one process: a drop-in for torch.amp.GradScaler, plus its extras."""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardscale import ShardedGradScaler, ShardScaleWarning, count_collectives
from tests.setups import mlp

INF_STEPS = (2, 3, 6)


def _train(
    scaler: Any, flavour: str, steps: int = 9, inf_steps: tuple[int, ...] = INF_STEPS
) -> tuple[list[float], list[torch.Tensor], list[int]]:
    """Train a small MLP with infs planted at ``inf_steps``; return scales, params, collectives."""
    model = mlp()
    options = {
        "for-loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options[flavour])
    scales, collectives = [], []
    for step in range(steps):
        optimizer.zero_grad()
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(inputs).pow(2).mean()).backward()
        if step in inf_steps:
            with torch.no_grad():
                model[2].weight.grad[0, 0] = math.inf
        with count_collectives() as counts:
            scaler.step(optimizer)
            scaler.update()
        scales.append(scaler.get_scale())
        collectives.append(sum(counts.values()))
    return scales, [p.detach().clone() for p in model.parameters()], collectives


def _assert_same_training(flavour: str) -> list[int]:
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "growth_interval": 2}
    torch_scales, torch_params, _ = _train(torch.amp.GradScaler("cpu", **kwargs), flavour)
    our_scales, our_params, collectives = _train(ShardedGradScaler(**kwargs), flavour)
    assert our_scales == torch_scales
    for ours, theirs in zip(our_params, torch_params, strict=True):
        assert torch.equal(ours, theirs)
    return collectives


@pytest.mark.parametrize("flavour", ["for-loop", "foreach", "fused"])
def test_scaler_without_process_group_matches_torch_bit_for_bit(flavour: str) -> None:
    assert not dist.is_initialized()
    assert _assert_same_training(flavour) == [0] * 9


@pytest.mark.parametrize("flavour", ["for-loop", "fused"])
@pytest.mark.usefixtures("world_of_one")
def test_scaler_world_size_one_matches_torch_and_issues_no_collective(flavour: str) -> None:
    assert _assert_same_training(flavour) == [0] * 9


# ---------------------------------------------------------------- scale()


def test_scale_nested_lists_and_tuples_keep_structure_and_dtype() -> None:
    scaler = ShardedGradScaler(init_scale=4.0)
    half = torch.tensor(1.5, dtype=torch.float16)
    bf16 = torch.tensor(2.0, dtype=torch.bfloat16)
    scaled = scaler.scale([half, (bf16, [torch.tensor(3.0)])])
    assert isinstance(scaled, list)
    assert isinstance(scaled[1], tuple)
    assert scaled[0].dtype == torch.float16
    assert scaled[0].item() == 6.0
    assert scaled[1][0].dtype == torch.bfloat16
    assert scaled[1][1][0].item() == 12.0


def test_scale_other_iterables_are_scaled_lazily() -> None:
    scaler = ShardedGradScaler(init_scale=2.0)
    scaled = scaler.scale(t for t in [torch.tensor(1.0), torch.tensor(2.0)])
    assert [t.item() for t in scaled] == [2.0, 4.0]


@pytest.mark.parametrize(
    ("outputs", "error", "match"),
    [
        (
            "loss",
            TypeError,
            r"scale\(\) takes a Tensor or a \(nested\) list/tuple of Tensors, got str",
        ),
        ({"loss": torch.tensor(1.0)}, TypeError, r"got dict"),
        (3.0, TypeError, r"got float"),
        ([torch.tensor(1.0), None], TypeError, r"got NoneType"),
        (torch.tensor(3), TypeError, r"floating-point tensors, got dtype torch.int64"),
    ],
)
def test_scale_bad_output_raises(outputs: Any, error: type[Exception], match: str) -> None:
    scaler = ShardedGradScaler()
    with pytest.raises(error, match=match):
        scaler.scale(outputs)
    assert scaler.get_scale() == 2.0**16


def test_scale_tensor_on_other_device_than_named_raises() -> None:
    scaler = ShardedGradScaler("meta")
    with pytest.raises(ValueError, match=r"got a tensor on cpu, but this scaler was built with"):
        scaler.scale(torch.tensor(1.0))


def test_scale_device_unset_follows_the_loss() -> None:
    scaler = ShardedGradScaler()
    scaler.scale(torch.tensor(1.0, device="meta"))
    assert scaler._get_scale_async() is not None
    assert scaler._get_scale_async().device.type == "meta"


# ---------------------------------------------------------------- call order


def _scaled_backward(scaler: ShardedGradScaler) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    return model, optimizer


def _unscale_twice(scaler: Any, optimizer: Any) -> None:
    scaler.unscale_(optimizer)
    scaler.unscale_(optimizer)


def _unscale_after_step(scaler: Any, optimizer: Any) -> None:
    scaler.step(optimizer)
    scaler.unscale_(optimizer)


def _step_twice(scaler: Any, optimizer: Any) -> None:
    scaler.step(optimizer)
    scaler.step(optimizer)


def _step_with_closure(scaler: Any, optimizer: Any) -> None:
    scaler.step(optimizer, closure=lambda: 0.0)


@pytest.mark.parametrize(
    "mistake", [_unscale_twice, _unscale_after_step, _step_twice, _step_with_closure]
)
def test_call_order_mistake_raises_torch_error(mistake: Any) -> None:
    torch_scaler = torch.amp.GradScaler("cpu")
    _, torch_optimizer = _scaled_backward(torch_scaler)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError) as torch_error:
        mistake(torch_scaler, torch_optimizer)
    scaler = ShardedGradScaler()
    _, optimizer = _scaled_backward(scaler)
    with pytest.raises(RuntimeError) as our_error:
        mistake(scaler, optimizer)
    assert str(our_error.value) == str(torch_error.value)


@pytest.mark.parametrize(
    "mistake", [_unscale_twice, _unscale_after_step, _step_twice, _step_with_closure]
)
def test_call_order_mistake_leaves_scaler_usable(mistake: Any) -> None:
    """After the error, finishing the iteration and training on works, with unchanged state."""
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=2)
    model, optimizer = _scaled_backward(scaler)
    before = {k: v for k, v in scaler.state_dict().items()}
    with pytest.raises(RuntimeError):
        mistake(scaler, optimizer)
    assert scaler.state_dict() == before
    if mistake is _step_with_closure:
        scaler.step(optimizer)
    scaler.update()
    for _ in range(2):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.state_dict()["steps"] == 3
    assert scaler.get_scale() == 16.0  # grew after two clean steps: the policy still runs


@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_call_before_scale_raises(method: str) -> None:
    scaler = ShardedGradScaler()
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    args = () if method == "update" else (optimizer,)
    with pytest.raises(RuntimeError, match=rf"Attempted {method} but _scale is None"):
        getattr(scaler, method)(*args)


def test_update_without_step_raises() -> None:
    scaler = ShardedGradScaler()
    _scaled_backward(scaler)
    with pytest.raises(RuntimeError, match=r"No inf checks were recorded prior to update"):
        scaler.update()


def test_step_without_any_gradient_raises() -> None:
    scaler = ShardedGradScaler()
    scaler.scale(torch.tensor(1.0))
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(
        RuntimeError, match=r"none of its parameters has a gradient on any of the 1"
    ):
        scaler.step(optimizer)


def test_step_returns_what_the_optimizer_returns() -> None:
    class Reporting(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            super().step()
            return "stepped"

    scaler = ShardedGradScaler()
    model = mlp()
    optimizer = Reporting(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 16)).sum()).backward()
    assert scaler.step(optimizer) == "stepped"


def test_unscale_then_fused_step_hands_agreed_flag_of_shape_scalar() -> None:
    """torch's ShardedGradScaler passes a (1,)-shaped found_inf here and the fused kernel fails."""
    scaler = ShardedGradScaler(init_scale=4.0)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for planted in (None, math.inf):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).sum()).backward()
        if planted is not None:
            model[0].bias.grad[0] = planted
        scaler.unscale_(optimizer)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        changed = any(
            not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)
        )
        assert changed is (planted is None)
        assert scaler.last_step_skipped is (planted is not None)
    assert scaler.get_scale() == 2.0


def test_two_optimizers_each_decide_and_update_backs_off_once() -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    model = mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    model[2].weight.grad[0, 0] = math.nan
    before_first = model[0].weight.detach().clone()
    before_second = model[2].weight.detach().clone()
    scaler.step(first)
    assert not scaler.last_step_skipped
    scaler.step(second)
    assert scaler.last_step_skipped
    scaler.update()
    assert not torch.equal(model[0].weight, before_first)
    assert torch.equal(model[2].weight, before_second)
    assert scaler.get_scale() == 4.0
    assert scaler.state_dict()["skipped_steps"] == 1


# ---------------------------------------------------------------- the policy, through the scaler


def _overflow_steps(scaler: ShardedGradScaler, pattern: list[bool]) -> list[float]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = []
    for overflow in pattern:
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16)).mean()).backward()
        if overflow:
            model[0].weight.grad[0, 0] = math.inf
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_scaler_grows_after_interval_and_backs_off() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=2)
    assert _overflow_steps(scaler, [False, False, True, False]) == [8.0, 16.0, 8.0, 8.0]


def test_scaler_hysteresis_tolerates_overflows() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=100, hysteresis=2)
    assert _overflow_steps(scaler, [True, True, True]) == [8.0, 4.0, 2.0]


def test_scaler_at_floor_holds_keeps_skipping_and_warns_once() -> None:
    scaler = ShardedGradScaler(init_scale=4.0, min_scale=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales = _overflow_steps(scaler, [True] * 5)
    assert scales == [2.0] * 5
    floor_warnings = [w for w in caught if issubclass(w.category, ShardScaleWarning)]
    assert len(floor_warnings) == 1
    assert "min_scale=2.0" in str(floor_warnings[0].message)
    state = scaler.state_dict()
    assert (state["skipped_steps"], state["consecutive_skips"]) == (5, 5)


def test_scaler_default_floor_stops_collapse_to_zero() -> None:
    """torch.amp.GradScaler halves to 0.0 after ~166 overflows; ours stops at min_scale=1."""
    scaler = ShardedGradScaler(init_scale=2.0**4)
    with pytest.warns(ShardScaleWarning):
        assert _overflow_steps(scaler, [True] * 8)[-1] == 1.0


def test_scaler_static_skips_nonfinite_but_never_moves() -> None:
    scaler = ShardedGradScaler(dynamic=False, growth_interval=1)
    assert scaler.get_scale() == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardScaleWarning)  # no floor warning: static by design
        assert _overflow_steps(scaler, [True, False, False, True]) == [1.0] * 4
    assert scaler.state_dict()["skipped_steps"] == 2


def test_scaler_max_scale_caps_growth() -> None:
    scaler = ShardedGradScaler(init_scale=4.0, growth_interval=1, max_scale=16.0)
    assert _overflow_steps(scaler, [False] * 4) == [8.0, 16.0, 16.0, 16.0]


def test_update_new_scale_sets_it() -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    _overflow_steps(scaler, [False])
    scaler.update(32.0)
    assert scaler.get_scale() == 32.0
    scaler.update(torch.tensor([64.0]))
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize(
    ("new_scale", "error", "match"),
    [
        (0.5, ValueError, r"new_scale must be in \[min_scale, max_scale\] = \[1.0, inf\], got 0.5"),
        (math.nan, ValueError, r"new_scale must be finite, got nan"),
        (torch.ones(2), ValueError, r"one-element tensor .* got shape \(2,\)"),
        ("8", TypeError, r"new_scale must be a float or a tensor, got str"),
    ],
)
def test_update_bad_new_scale_raises_and_keeps_scale(
    new_scale: Any, error: type[Exception], match: str
) -> None:
    scaler = ShardedGradScaler(init_scale=8.0)
    _overflow_steps(scaler, [False])
    with pytest.raises(error, match=match):
        scaler.update(new_scale)
    assert scaler.get_scale() == 8.0


# ---------------------------------------------------------------- state


def test_state_dict_ours_loads_into_torch() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3)
    _overflow_steps(scaler, [False, False, True, False])
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(scaler.state_dict())
    assert theirs.state_dict() == {k: scaler.state_dict()[k] for k in theirs.state_dict()}
    assert theirs.get_scale() == 4.0


def test_state_dict_torch_loads_into_ours_with_our_settings_kept() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    _overflow_steps(theirs, [False, True, False])  # type: ignore[arg-type]
    scaler = ShardedGradScaler(hysteresis=2, min_scale=0.5)
    scaler.load_state_dict(theirs.state_dict())
    state = scaler.state_dict()
    assert {k: state[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert (state["hysteresis"], state["_hysteresis_tracker"], state["min_scale"]) == (2, 2, 0.5)
    assert state["steps"] == 0


def test_state_dict_round_trip_keeps_counters_and_trackers() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=5, hysteresis=3)
    _overflow_steps(scaler, [False, True, False])
    restored = ShardedGradScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    assert restored.state_dict()["_hysteresis_tracker"] == 2


def test_load_state_dict_before_first_scale_is_used_by_it() -> None:
    scaler = ShardedGradScaler()
    scaler.load_state_dict({**ShardedGradScaler(init_scale=32.0).state_dict()})
    assert scaler.scale(torch.tensor(1.0)).item() == 32.0


_GOOD = ShardedGradScaler(init_scale=8.0, growth_interval=4, hysteresis=2).state_dict()


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({}, RuntimeError, r"The source state dict is empty"),
        (
            {k: v for k, v in _GOOD.items() if k != "scale"},
            ValueError,
            r"missing required key\(s\) \['scale'\]",
        ),
        ({**_GOOD, "extra": 1}, ValueError, r"unknown key\(s\) \['extra'\]"),
        (
            {k: v for k, v in _GOOD.items() if k != "steps"},
            ValueError,
            r"some of shardscale's keys but not \['steps'\]",
        ),
        ({**_GOOD, "scale": "8"}, TypeError, r"state_dict\['scale'\] must be a float, got str"),
        (
            {**_GOOD, "scale": math.nan},
            ValueError,
            r"state_dict\['scale'\] must be finite and > 0, got nan",
        ),
        ({**_GOOD, "scale": 0.0}, ValueError, r"must be finite and > 0, got 0.0"),
        ({**_GOOD, "scale": -2.0}, ValueError, r"got -2.0"),
        ({**_GOOD, "scale": math.inf}, ValueError, r"got inf"),
        ({**_GOOD, "scale": 0.5}, ValueError, r"scale must be in \[min_scale, max_scale\]"),
        (
            {**_GOOD, "_growth_tracker": 4},
            ValueError,
            r"_growth_tracker must be in \[0, growth_interval\) = \[0, 4\), got 4",
        ),
        ({**_GOOD, "_growth_tracker": 1.5}, TypeError, r"must be an int, got 1.5"),
        (
            {**_GOOD, "_hysteresis_tracker": 3},
            ValueError,
            r"_hysteresis_tracker must be in \[1, hysteresis\] = \[1, 2\], got 3",
        ),
        (
            {**_GOOD, "growth_factor": 0.5},
            ValueError,
            r"growth_factor must be a finite number > 1.0, got 0.5",
        ),
        ({**_GOOD, "dynamic": "yes"}, TypeError, r"state_dict\['dynamic'\] must be a bool"),
        ({**_GOOD, "steps": True}, TypeError, r"state_dict\['steps'\] must be an int, got bool"),
        (
            {**_GOOD, "skipped_steps": 3, "steps": 2},
            ValueError,
            r"consecutive_skips <= skipped_steps <= steps",
        ),
        (
            {**_GOOD, "last_overflow_step": 1},
            ValueError,
            r"last_overflow_step'\] must be 0 when no step was skipped.*got last_overflow_step=1",
        ),
        ([("scale", 1.0)], TypeError, r"state_dict must be a mapping, got list"),
        (
            {**_GOOD, "format_version": 2},
            ValueError,
            r"format_version'\] must be one of \[0, 1\], got 2: a newer shardscale saved it",
        ),
        (
            {k: v for k, v in _GOOD.items() if k != "format_version"} | {"new_key": 1},
            ValueError,
            r"unknown key\(s\) \['new_key'\] for format version 0",
        ),
        (
            {k: v for k, v in _GOOD.items() if k != "hysteresis"},
            ValueError,
            r"some of shardscale's keys but not \['hysteresis'\]",
        ),
    ],
)
def test_load_bad_state_dict_raises_and_leaves_scaler_unchanged(
    state: Any, error: type[Exception], match: str
) -> None:
    scaler = ShardedGradScaler(init_scale=16.0, growth_interval=3)
    _overflow_steps(scaler, [False, True])
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before
    assert scaler.get_growth_interval() == 3


def test_state_dict_is_versioned_and_the_first_format_still_loads() -> None:
    """shardscale 0.1 saved no format_version (format 0): its checkpoints keep loading."""
    scaler = ShardedGradScaler(init_scale=16.0, growth_interval=3, hysteresis=2)
    _overflow_steps(scaler, [False, True, False])
    saved = scaler.state_dict()
    assert saved["format_version"] == 1
    old = {k: v for k, v in saved.items() if k != "format_version"}
    loaded = ShardedGradScaler(hysteresis=2)
    loaded.load_state_dict(old)
    assert loaded.state_dict() == saved


def test_pickle_and_deepcopy_keep_state() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3, hysteresis=2)
    _overflow_steps(scaler, [False, True])
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == scaler.state_dict()
        assert clone.scale(torch.tensor(1.0)).item() == 8.0


def test_pickle_mid_iteration_raises() -> None:
    scaler = ShardedGradScaler()
    _, optimizer = _scaled_backward(scaler)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"may only be pickled at the beginning"):
        pickle.dumps(scaler)


def test_setters_validate_and_apply() -> None:
    scaler = ShardedGradScaler()
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert scaler.get_growth_interval() == 7
    with pytest.raises(ValueError, match=r"growth_factor must be a finite number > 1.0, got 0.9"):
        scaler.set_growth_factor(0.9)
    assert scaler.get_growth_factor() == 3.0


# ---------------------------------------------------------------- disabled, arguments


def test_disabled_is_a_no_op() -> None:
    scaler = ShardedGradScaler(enabled=False)
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 16)).sum().backward()
    before = model[0].weight.detach().clone()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(before, model[0].weight)
    assert (scaler.get_scale(), scaler.state_dict(), scaler.is_enabled()) == (1.0, {}, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_named_without_cuda_warns_and_disables_like_torch() -> None:
    with pytest.warns(ShardScaleWarning, match=r"CUDA is not available. Disabling"):
        scaler = ShardedGradScaler("cuda")
    assert not scaler.is_enabled()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"enabled": 1}, TypeError, r"enabled must be a bool, got int"),
        ({"device": 0}, TypeError, r"device must be a str, a torch.device or None, got int"),
        ({"device": "gpu"}, ValueError, r"device must name a torch device type, got 'gpu'"),
        (
            {"process_group": "world"},
            TypeError,
            r"process_group must be a torch.distributed.ProcessGroup",
        ),
        ({"init_scale": -1.0}, ValueError, r"init_scale must be in \[min_scale, max_scale\]"),
        (
            {"growth_factor": 0.5},
            ValueError,
            r"growth_factor must be a finite number > 1.0, got 0.5",
        ),
        ({"hysteresis": 0}, ValueError, r"hysteresis must be >= 1, got 0"),
        ({"max_scale": 0.1}, ValueError, r"max_scale must be >= min_scale"),
    ],
)
def test_constructor_bad_argument_raises_rule_and_value(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ShardedGradScaler(**kwargs)


def test_constructor_extras_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ShardedGradScaler("cpu", 2.0**16)  # type: ignore[misc]


# ---------------------------------------------------------------- sparse


def test_sparse_fp16_duplicates_that_overflow_when_coalesced_are_caught() -> None:
    """Each value is finite; the coalesced sum of the duplicate index is not (fp16 max 65504)."""
    weight = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    weight.grad = torch.sparse_coo_tensor(
        torch.tensor([[1, 1, 2]]), torch.tensor([60000.0, 60000.0, 1.0], dtype=torch.float16), (4,)
    )
    scaler = ShardedGradScaler(init_scale=1.0)
    scaler.scale(torch.tensor(1.0))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler.step(optimizer)
    assert scaler.last_step_skipped
    assert weight.grad.is_coalesced()
    assert torch.equal(weight, torch.zeros(4, dtype=torch.float16))


def test_integer_gradient_raises_type_error() -> None:
    weight = torch.zeros(3, dtype=torch.int32)
    weight.grad = torch.ones(3, dtype=torch.int32)
    scaler = ShardedGradScaler()
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"gradients must be floating point .* got torch.int32"):
        scaler.step(_Holder([weight]))  # type: ignore[arg-type]


class _Holder:
    """The least an optimizer needs for the scaler: param_groups and step()."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]

    def step(self) -> None:
        return None
