"""PyTorch's own grad-scaler tests, run against shardscale's scalers.

Ported from PyTorch (BSD-3-Clause licence, (c) Meta Platforms, Inc. and affiliates and the
PyTorch contributors), with torch's scaler replaced by ours and nothing else changed in what is
asserted:

* ``test/test_torch.py``, ``TestTorchDeviceType``: every ``test_grad_scaling_*``,
  ``test_grad_scaler_pass_itself``, ``test_grad_scale_will_not_overflow``,
  ``test_pickle_gradscaler``, ``test_params_invalidated_with_grads_invalidated_between_unscale_
  and_step`` (device-generic; torch runs them on the CPU). ``test_grad_scaling_update_scale``
  and the raw-kernel half of ``test_grad_scaling_unscale`` test torch's kernels, not a scaler:
  left out. ``test_grad_scaler_deprecated_warning`` tests ``torch.cpu.amp.GradScaler``'s
  constructor: left out.
* ``test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py``, ``TestShardGradScaler`` (torch
  skips it without CUDA; ours needs none). ``TestShardedGradScalerParityWithDDP`` needs 2 GPUs.

``test/test_cuda.py``'s copies of these tests run only with CUDA (torch skips the module on a
CPU). Each test runs against ``ShardedGradScaler``, and against ``AsyncShardedGradScaler`` too
except where the async scaler refuses by design what the test does: pickling (it holds a lock),
``load_state_dict`` with an iteration in flight, two optimizers, and the ``grad_scaler=``
protocol (tested in ``test_compat``). The source's ``test_params_invalidated_...`` iterates
torch's ``optim_db`` inputs; here, the CPU-capable kinds among them, parametrised.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import Any

import pytest
import torch

import shardscale

DEVICE = "cpu"
SCALERS = [shardscale.ShardedGradScaler, shardscale.AsyncShardedGradScaler]


@pytest.fixture(params=SCALERS, ids=lambda cls: cls.__name__)
def GradScaler(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """torch's ``partial(torch.GradScaler, device=...)``, as ours."""
    return partial(request.param, device=DEVICE)


@pytest.fixture
def SyncGradScaler() -> Callable[..., Any]:
    """The synchronous scaler alone, for tests that pickle it or load a state dict mid-iteration:
    the async scaler refuses both by design (a lock and threads; iterations in flight)."""
    return partial(shardscale.ShardedGradScaler, device=DEVICE)


def assert_equal(
    actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """``TestCase.assertEqual`` for what these tests compare (tensors, numbers, None)."""
    if actual is None or expected is None:
        assert actual is expected
        return
    if not isinstance(actual, torch.Tensor):
        actual = torch.tensor(actual)
    if not isinstance(expected, torch.Tensor):
        expected = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(
        actual,
        expected.to(actual.dtype).expand_as(actual) if expected.numel() == 1 else expected,
        rtol=rtol,
        atol=atol,
        equal_nan=False,
        check_dtype=False,
    )


# torch.testing._internal's helpers, as torch has them (importing that package needs torch's
# test-only dependencies): common_cuda._create_scaling_case and its models, common_fsdp's
# DummyProcessGroup (its allreduce, never called at size 1, left out).


def _create_scaling_models_optimizers(
    device: str = "cuda", optimizer_ctor: Any = torch.optim.SGD, optimizer_kwargs: Any = None
) -> tuple[Any, Any, Any, Any]:
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)
    kwargs = {"lr": 1.0}
    if optimizer_kwargs is not None:
        kwargs.update(optimizer_kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    opt_scaling = optimizer_ctor(mod_scaling.parameters(), **kwargs)
    return mod_control, mod_scaling, opt_control, opt_scaling


def _create_scaling_case(
    device: str = "cuda",
    dtype: torch.dtype = torch.float,
    optimizer_ctor: Any = torch.optim.SGD,
    optimizer_kwargs: Any = None,
) -> tuple[Any, ...]:
    data = [
        (
            torch.randn((8, 8), dtype=dtype, device=device),
            torch.randn((8, 8), dtype=dtype, device=device),
        )
        for _ in range(4)
    ]
    loss_fn = torch.nn.MSELoss().to(device)
    skip_iter = 2
    return (
        *_create_scaling_models_optimizers(
            device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
        ),
        data,
        loss_fn,
        skip_iter,
    )


class DummyProcessGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


# ---------------------------------------------------------------------- test_torch.py


def test_pickle_gradscaler(SyncGradScaler: Callable[..., Any]) -> None:
    GradScaler = SyncGradScaler
    for lazy_init_scale in (True, False):
        a = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        assert a.is_enabled()
        if lazy_init_scale:
            a.scale(torch.tensor([4.0], dtype=torch.float32, device=DEVICE))
            assert a._scale.device.type == DEVICE
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() == a.is_enabled()
        assert b.get_scale() == 3.0
        assert b.get_growth_factor() == 4.0
        assert b.get_backoff_factor() == 0.5
        assert b.get_growth_interval() == 2
        assert b._init_growth_tracker == 0
        # a dummy key tests the defaultdict's default_factory
        assert (
            b._per_optimizer_states["fdsa"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
        )
        if lazy_init_scale:
            assert_equal(b.scale(torch.tensor([4.0], dtype=torch.float32, device=DEVICE)), 12.0)


@pytest.mark.parametrize("dtype", [torch.float, torch.double])
def test_grad_scaling_unscale(GradScaler: Callable[..., Any], dtype: torch.dtype) -> None:
    inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=DEVICE)
    size = 20
    g = torch.full((size, size), 4.0, dtype=dtype, device=DEVICE)

    def perfect_storm_grads(inject_inf: int) -> list[torch.Tensor]:
        grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf")
        return grads

    scaler = GradScaler()
    dummy_params = [torch.empty_like(g) for g in perfect_storm_grads(-1)]
    dummy_opt = torch.optim.SGD(dummy_params, lr=1.0)
    for inject_inf in range(-1, len(dummy_params)):
        found_inf = torch.full((1,), 0.0, dtype=torch.float, device=DEVICE)
        grads = perfect_storm_grads(inject_inf)
        for i, p in enumerate(dummy_params):
            p.grad = grads[i]
        found_inf_per_device = scaler._unscale_grads_(dummy_opt, inv_scale, found_inf, True)
        if inject_inf < 0:
            assert sum(v.item() for v in found_inf_per_device.values()) == 0
            for grad in grads:
                assert_equal(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            assert sum(v.item() for v in found_inf_per_device.values()) == 1


def test_grad_scaling_unscale_sparse(GradScaler: Callable[..., Any]) -> None:
    dtype = torch.float
    scaler = GradScaler()
    inv_scale = torch.full((1,), 0.25, dtype=dtype, device=DEVICE)
    found_inf = torch.empty((1,), dtype=dtype, device=DEVICE)
    cur = found_inf.device
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=DEVICE, dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], device=DEVICE, dtype=torch.float)
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=dtype)

    p = s.clone()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    assert_equal(found_inf, 0.0)
    assert_equal(p.grad.to_dense(), (s / 4).to_dense())

    v = torch.FloatTensor([16.0, 32.0, float("inf")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    assert_equal(found_inf, 1.0)

    v = torch.FloatTensor([16.0, 32.0, float("nan")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    assert_equal(found_inf, 1.0)

    p = s.clone().half()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone().half()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    assert_equal(found_inf, 0.0)
    assert_equal(p.grad.to_dense(), (s.half() / 4).to_dense())

    # Uncoalesced fp16 values that overflow only once coalesced (64000 + 64000 > fp16 max).
    i = torch.LongTensor([[0, 1, 0], [2, 0, 2]])
    v = torch.FloatTensor([64000.0, 32.0, 64000.0])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=DEVICE, dtype=torch.float16)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    assert_equal(found_inf, 1.0)


def test_grad_scaling_unscale_fp16_refused(GradScaler: Callable[..., Any]) -> None:
    """torch's ``allow_fp16=False`` branch (exercised by its CUDA tests): its words."""
    p = torch.zeros(2, dtype=torch.float16)
    p.grad = torch.ones(2, dtype=torch.float16)
    one = torch.ones((1,))
    with pytest.raises(ValueError, match=r"Attempting to unscale FP16 gradients\."):
        GradScaler()._unscale_grads_(torch.optim.SGD([p], lr=1.0), one, torch.zeros(1), False)


def test_grad_scaling_state_dict(SyncGradScaler: Callable[..., Any]) -> None:
    GradScaler = SyncGradScaler
    for lazy_init_scale in (True, False):
        s0 = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = GradScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        # sets a random value for load_state_dict to overwrite
        s1._init_growth_tracker = 7
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE))
            assert isinstance(s1._scale, torch.FloatTensor)
        s1.load_state_dict(s0.state_dict())
        assert s1.get_scale() == 3.0
        assert s1.get_growth_factor() == 4.0
        assert s1.get_backoff_factor() == 0.5
        assert s1.get_growth_interval() == 2
        assert s1._init_growth_tracker == 0


Run = Callable[..., Any]


def _run_scaling_case(
    scaler_cls: Callable[..., Any],
    run: Run,
    unskipped: int,
    skipped: int,
    atol: float = 1e-7,
    optimizer_ctor: Any = torch.optim.SGD,
    optimizer_kwargs: dict[str, Any] | None = None,
) -> None:
    for enabled in (True, False):
        (mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter) = (
            _create_scaling_case(
                device=DEVICE, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
            )
        )
        scaler = scaler_cls(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        _ = run(DEVICE, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(DEVICE, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == (128.0 * net_growth * net_backoff)
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            assert_equal(c.grad, s.grad, atol=atol, rtol=1e-05)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                assert_equal(c_state[k], s_state[k], atol=atol, rtol=1e-05)
            assert_equal(c, s, atol=atol, rtol=1e-05)


@pytest.mark.parametrize(("foreach", "fused"), [(None, None), (True, None), (None, True)])
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_grad_scaling_autocast(
    SyncGradScaler: Callable[..., Any],
    optimizer_ctor: Any,
    foreach: bool | None,
    fused: bool | None,
) -> None:
    try_pickle = False

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.half, enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    # torch's note: Adam/AdamW differ between pure fp32 and autocast beyond atol 1e-3, so the
    # test expects the comparison to fail for them, and to pass for SGD.
    context: Callable[[], Any] = contextlib.nullcontext
    if optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW):
        context = partial(pytest.raises, AssertionError)
    scaler_cls = SyncGradScaler.func  # type: ignore[attr-defined]
    kwargs = {"device": DEVICE}
    with context():
        _run_scaling_case(
            partial(scaler_cls, **kwargs),
            run,
            unskipped=3,
            skipped=1,
            atol=1e-3,
            optimizer_ctor=optimizer_ctor,
            optimizer_kwargs={"foreach": foreach, "fused": fused},
        )
        try_pickle = True
        _run_scaling_case(
            partial(scaler_cls, **kwargs),
            run,
            unskipped=3,
            skipped=1,
            atol=1e-3,
            optimizer_ctor=optimizer_ctor,
            optimizer_kwargs={"foreach": foreach, "fused": fused},
        )


@pytest.mark.parametrize(
    "optimizer_kwargs",
    [{}, {"foreach": True}, {"fused": True}, {"weight_decay": 0.1}, {"maximize": True}],
    ids=str,
)
@pytest.mark.parametrize("optimizer_ctor", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(
    GradScaler: Callable[..., Any],
    optimizer_ctor: Any,
    optimizer_kwargs: dict[str, Any],
) -> None:
    # torch iterates its optim_db inputs; these are the CPU-capable kinds among them.
    model, _, optimizer, _, data, loss_fn, _ = _create_scaling_case(
        DEVICE, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
    )
    scaler = GradScaler(init_scale=128.0)
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type=DEVICE, dtype=torch.half):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):  # deliberately break grads
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        scaler.step(optimizer)
        scaler.update()
    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())


def test_grad_scale_will_not_overflow(GradScaler: Callable[..., Any]) -> None:
    model = torch.nn.Linear(5, 1).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = GradScaler(growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5).to(DEVICE)
    y = 1e-30 * torch.randn(1, 1).to(DEVICE)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler._scale != float("inf")
    assert scaler._scale == scaler._scale  # not NaN


def test_grad_scaling_clipping(GradScaler: Callable[..., Any]) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(GradScaler, run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale(GradScaler: Callable[..., Any]) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), max_norm, error_if_nonfinite=False
                )
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(GradScaler, run, unskipped=3, skipped=1)


def test_grad_scaling_penalty(GradScaler: Callable[..., Any]) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(
                    scaler.scale(loss), model.parameters(), create_graph=True
                )
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(GradScaler, run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation(GradScaler: Callable[..., Any]) -> None:
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):  # type: ignore[no-untyped-def]
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    _run_scaling_case(GradScaler, run, unskipped=2, skipped=0)


def test_grad_scaling_multiple() -> None:
    # Two optimizers in one iteration: the synchronous scaler only (the async one serves one).
    for enabled in (True, False):
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = (
            _create_scaling_case(DEVICE)
        )
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers(
            DEVICE
        )
        scaler = shardscale.ShardedGradScaler(
            device=DEVICE, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
        )

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):  # type: ignore[no-untyped-def]
            for i, (input, target) in enumerate(data):  # noqa: B023 (torch's closure)
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0 = model0(input)
                output1 = model1(input)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)  # noqa: B023
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)  # noqa: B023
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)  # noqa: B023
                    scaler.scale(loss1).backward()  # noqa: B023
                    if i == skip_iter and scaler.is_enabled():  # noqa: B023
                        model1[1].weight.grad.data.fill_(float("inf"))
                    scaler.unscale_(optimizer0)  # noqa: B023
                    scaler.step(optimizer0)  # noqa: B023
                    scaler.step(optimizer1)  # noqa: B023
                    scaler.update()  # noqa: B023
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if (not scaler.is_enabled()) or (i != skip_iter):  # noqa: B023
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
        expected = (
            128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() ** 1
            if enabled
            else 1.0
        )
        assert scaler.get_scale() == expected
        for c, s in zip(
            chain(mod_control0.parameters(), mod_control1.parameters()),
            chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
            strict=True,
        ):
            assert_equal(c, s, rtol=1e-5, atol=1e-7)


def test_grad_scaler_pass_itself() -> None:
    # torch's optimizers of the deprecated protocol: the synchronous scaler (the async one
    # refuses the protocol, tested in test_compat).
    class _PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params: Any, defaults: dict[str, Any] | None = None) -> None:
            super().__init__(params, defaults if defaults is not None else {})
            self._step_supports_amp_scaling = True

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:  # type: ignore[override]
            assert isinstance(grad_scaler, torch.amp.GradScaler)
            assert not hasattr(self, "grad_scale")
            assert not hasattr(self, "found_inf")

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            assert isinstance(self.grad_scale, torch.Tensor)
            assert isinstance(self.found_inf, torch.Tensor)

    x = torch.randn(4, 4).to(DEVICE)
    m = torch.nn.Linear(4, 1).to(DEVICE)
    o1 = Optimizer1(m.parameters())
    o2 = Optimizer2(m.parameters())
    scaler = shardscale.ShardedGradScaler(device=DEVICE, init_scale=2.0)
    with torch.autocast(device_type=DEVICE, dtype=torch.half):
        y = m(x)
        loss = y.mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()


# ---------------------------------------------------------- test_fsdp_sharded_grad_scaler.py


@pytest.fixture(params=SCALERS, ids=lambda cls: cls.__name__)
def ShardedGradScaler(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """torch's ``ShardedGradScaler`` (its default device is "cuda"; ours follows the loss)."""
    return request.param  # type: ignore[no-any-return]


def test_grad_scaling(ShardedGradScaler: Callable[..., Any]) -> None:
    pg = DummyProcessGroup(0, 1)
    scaler = ShardedGradScaler(init_scale=2.0, process_group=pg, enabled=True)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    t1 = torch.full((1,), 8.0, dtype=torch.float32, device="cpu")
    outputs = [t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]]
    outputs = scaler.scale(outputs)
    assert outputs[0] == 16.0
    assert outputs[1][0] == 8.0
    assert outputs[1][1] == 16.0
    assert outputs[2][0] == 8.0
    assert outputs[2][1] == 16.0
    assert scaler._scale.device == t1.device


def test_scaling_unscaling_sparse(ShardedGradScaler: Callable[..., Any]) -> None:
    pg = DummyProcessGroup(0, 1)
    scaler = ShardedGradScaler(init_scale=2.0, process_group=pg, enabled=True)
    inv_scale = torch.full((1,), 0.5, dtype=torch.float, device="cpu")
    found_inf = torch.full((1,), 0, dtype=torch.float, device="cpu")

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device="cpu", dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], dtype=torch.float, device="cpu")
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float)

    s1 = s.clone()
    s1.grad = s.clone()
    opt = torch.optim.SGD([s1], lr=1.0)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    assert_equal(found_inf, 0.0)
    assert_equal(s1.grad.to_dense(), (s / 2).to_dense())

    v = torch.tensor([16.0, 32.0, float("inf")], dtype=torch.float, device="cpu")
    s1.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    assert_equal(found_inf, 1.0)

    i = torch.tensor([[1, 1, 1], [0, 0, 2]], device="cpu", dtype=torch.int64)
    v = torch.tensor([2**15, 2**15, 1.0], dtype=torch.float16, device="cpu")
    s1 = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float16)
    s1.grad = s1.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    assert_equal(found_inf, 1.0)


def test_inf_gradients_skip_optim_step(ShardedGradScaler: Callable[..., Any]) -> None:
    pg = DummyProcessGroup(0, 1)
    scaler = ShardedGradScaler(init_scale=2.0, process_group=pg, enabled=True)
    loss = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    t0 = torch.tensor([float("inf")], dtype=torch.float32, device="cpu")
    t0.grad = t0.clone()
    opt = torch.optim.SGD([t0], lr=1.0)
    scaler.scale(loss)
    ret_val = scaler.step(opt)
    assert ret_val is None
