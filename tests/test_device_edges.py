"""The edges of the device path, run on a CPU: what a GPU would do, seen on ``meta``.

The scaler on the ``meta`` device takes every ``device.type != "cpu"`` branch; a dispatch mode
counts what would synchronise the host (``_local_scalar_dense``) and every meta-to-CPU copy (and
whether it blocks), and stands in for their values, which meta has none of. Where meta cannot go
(CUDA events, streams, pinned memory) the scaler runs under ``shardscale.testing.cuda_path()``,
and the one class that calls ``torch.cuda`` there (``shardscale._state.DevicePath``) is tested
against recorders in its place.

Covered here: a fused optimizer over CPU parameters gets its scale and flag on the CPU, copied
blocking (audit W3); the stats copy is read only after its wait, one update late (P7), and the
real path's copy and event are on the stream of the state's own device (M2); ``get_scale``
reads the device once (P6); ``last_step_skipped`` reads once after a fused step and never after
a non-fused one; the accelerate integration reads the skip flag only when asked (P5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler
from shardscale._state import COUNTERS, PACKED_COUNTERS, Count, DevicePath
from shardscale.testing import CudaPathLog, cuda_path
from tests.devicepath import DeviceCounter, install_cuda_stubs

aten = torch.ops.aten
META = torch.device("meta")


class _FusedSpy(torch.optim.Optimizer):
    """What the scaler sees of a fused optimizer: it takes ``grad_scale`` and ``found_inf``.

    Records, inside ``step()``, the devices of what it was handed.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})
        self.handed: list[tuple[torch.device, torch.device]] = []

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        assert grad_scale is not None
        assert found_inf is not None
        self.handed.append((grad_scale.device, found_inf.device))


class _PlainSpy(torch.optim.Optimizer):
    """What the scaler sees of a for-loop/foreach optimizer: it is stepped or skipped."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def _params(device: torch.device) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.ones(s, device=device)) for s in [(8, 4), (8,)]]
    for p in params:
        p.grad = torch.ones_like(p)
    return params


def _fused_cpu_params_step(scaler: ShardedGradScaler, optimizer: _FusedSpy) -> None:
    scaler.scale(torch.ones((), device=META))
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    scaler.step(optimizer)
    scaler.update()


# ---------------------------------------------------------------- W3: fused over CPU parameters


@pytest.fixture
def on_cuda_path() -> Any:
    """The scaler on its CUDA path (``shardscale.testing.cuda_path()``), and that path's log."""
    with cuda_path() as log:
        yield log


# The copy every fused step's update() makes of the alarms' streaks: non-blocking, waited for
# an update later (docs/guides.md, the device path). The copies of the tests below come before it.
_WATCH = [True]


@pytest.mark.usefixtures("on_cuda_path")
def test_step_fused_optimizer_over_cpu_params_gets_scale_and_flag_on_cpu_blocking() -> None:
    optimizer = _FusedSpy(_params(torch.device("cpu")))
    scaler = ShardedGradScaler()
    with DeviceCounter() as counter:
        _fused_cpu_params_step(scaler, optimizer)  # warm-up: constants made once
        counter.copies.clear()
        _fused_cpu_params_step(scaler, optimizer)
    cpu = torch.device("cpu")
    assert optimizer.handed == [(cpu, cpu)] * 2
    assert counter.copies == [False, *_WATCH]  # ONE copy to the CPU per step, and it blocks


@pytest.mark.usefixtures("on_cuda_path")
def test_step_fused_optimizer_on_scale_device_gets_no_copy() -> None:
    optimizer = _FusedSpy(_params(META))
    scaler = ShardedGradScaler()
    with DeviceCounter() as counter:
        for _ in range(2):
            scaler.scale(torch.ones((), device=META))
            scaler.step(optimizer)
            scaler.update()
    assert optimizer.handed == [(META, META)] * 2
    assert counter.copies == _WATCH * 2
    assert counter.reads == 0


def test_step_fused_optimizer_over_two_devices_gets_the_scale_device() -> None:
    optimizer = _FusedSpy([*_params(META), *_params(torch.device("cpu"))])
    scaler = ShardedGradScaler()
    with DeviceCounter():
        scaler.scale(torch.ones((), device=META))
        scaler.step(optimizer)
    assert optimizer.handed == [(META, META)]


# ---------------------------------------------------------------- P6: get_scale, last_step_skipped


def _scaled_on_meta(scaler: ShardedGradScaler, optimizer: torch.optim.Optimizer) -> None:
    scaler.scale(torch.ones((), device=META))
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.usefixtures("on_cuda_path")
def test_get_scale_on_device_reads_once() -> None:
    scaler = ShardedGradScaler(init_scale=1024.0, min_scale=1.0)
    with DeviceCounter(1024.0) as counter:
        _scaled_on_meta(scaler, _FusedSpy(_params(META)))
        before = counter.syncs
        assert scaler.get_scale() == 1024.0
        assert counter.syncs - before == 1


@pytest.mark.usefixtures("on_cuda_path")
@pytest.mark.parametrize(
    ("optimizer_class", "reads"), [(_FusedSpy, 1), (_PlainSpy, 0)], ids=["fused", "plain"]
)
def test_last_step_skipped_on_device_reads_once_after_fused_never_after_plain(
    optimizer_class: type[torch.optim.Optimizer], reads: int
) -> None:
    scaler = ShardedGradScaler()
    with DeviceCounter() as counter:
        _scaled_on_meta(scaler, optimizer_class(_params(META)))  # type: ignore[call-arg]
        before = counter.syncs
        assert scaler.last_step_skipped is False
        assert counter.syncs - before == reads


# ---------------------------------------------------------------- M2, P7: the stats copy on a GPU


def test_stats_hooks_one_update_late_each_after_its_copy_landed(on_cuda_path: CudaPathLog) -> None:
    scaler = ShardedGradScaler(max_consecutive_skips=100)
    delivered: list[int] = []
    scaler.register_stats_hook(lambda stats: delivered.append(stats.steps))
    scaler.register_stats_hook(lambda stats: on_cuda_path.note("hook", stats.steps))
    optimizer = _FusedSpy(_params(META))
    with DeviceCounter() as counter:
        # no collective differed: the mismatch count reads 0, in the stats' copy and the
        # alarms' read of the counters alike
        packed = scaler._home.at(META).packed().numel()
        counter.landed_at = {
            (packed, PACKED_COUNTERS + Count.MISMATCH): 0.0,
            (COUNTERS, Count.MISMATCH): 0.0,
        }
        for step in (1, 2, 3):
            counter.value = float(step)  # what this update's copy brings to the host
            _scaled_on_meta(scaler, optimizer)
            assert delivered == list(range(1, step))  # each step's numbers one update late
        assert scaler.stats.steps == 3  # reading stats delivers the step still in flight
    assert delivered == [1, 2, 3]
    events = [what for what, _ in on_cuda_path.events if what in ("copy", "wait", "hook")]
    # one copy an update (the stats, whose counters the alarms read too); each step's hook
    # after the wait for its copy, never before (a read before it would read NaN)
    assert events == ["copy", "wait", "hook", "copy", "wait", "hook", "copy", "wait", "hook"]


def test_real_path_copies_on_the_states_device_stream_into_pinned_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`DevicePath.copy_late`, the one place that calls CUDA's events and streams: the copy
    under the tensor's own device (not the current one, cuda:0 on a new thread), the event on
    that device's stream, the host buffer pinned, and the read only after the event's wait."""
    stubs = install_cuda_stubs(monkeypatch)
    with DeviceCounter(7.0) as counter:
        counter.log = stubs.log
        landing = DevicePath().copy_late(torch.ones(3, device=META))
        assert stubs.log == [
            ("device", META),
            ("copy", 7.0),
            ("record", META),
            ("device exit", META),
        ]
        assert landing.values() == [7.0, 7.0, 7.0]
        assert landing.values() == [7.0, 7.0, 7.0]  # read once, remembered
    assert stubs.log[-1] == ("synchronize", None)
    assert stubs.log.count(("synchronize", None)) == 1
    assert stubs.pinned == 1
    assert DevicePath().reads_late(torch.device("cuda", 1))
    assert not DevicePath().reads_late(torch.device("cpu"))
    assert not DevicePath().reads_late(META)  # meta is no GPU: the seam, not the library, says so


def test_real_path_checks_capture_on_the_states_device(monkeypatch: pytest.MonkeyPatch) -> None:
    stubs = install_cuda_stubs(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda3 = torch.device("cuda", 3)
    assert DevicePath().capturing(cuda3)
    assert stubs.log == [("device", cuda3), ("device exit", cuda3)]  # its stream, not cuda:0's
    assert not DevicePath().capturing(torch.device("cpu"))  # no stream to capture
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not DevicePath().capturing(cuda3)  # CUDA never started: nothing can capture


# ---------------------------------------------------------------- P5: accelerate asks, or not


@pytest.mark.integration  # runs accelerate itself
@pytest.mark.usefixtures("on_cuda_path")
@pytest.mark.parametrize(
    ("optimizer_class", "step_reads", "asked_reads"),
    [(_FusedSpy, 0, 1), (_PlainSpy, 2, 0)],
    ids=["fused", "plain"],
)
def test_accelerate_step_reads_fused_skip_flag_only_when_asked(
    optimizer_class: type[torch.optim.Optimizer], step_reads: int, asked_reads: int
) -> None:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    from shardscale.integrations.accelerate import use_shardscale

    AcceleratorState._reset_state(True)  # accelerate's state is one per process
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    scaler = use_shardscale(accelerator)
    optimizer = accelerator.prepare(optimizer_class(_params(META)))  # type: ignore[call-arg]
    assert isinstance(optimizer, AcceleratedOptimizer)
    with DeviceCounter(1.0, landing=0.0) as counter:  # every flag read says "skipped"; the
        # alarms' streaks (copied) say no streak is under way
        for _ in range(2):
            scaler.scale(torch.ones((), device=META))
            before = counter.syncs
            optimizer.step()  # a non-fused step reads its decision itself (and, skipped, the
            # streaks at once: the device has drained already); a fused one, neither
            assert counter.syncs - before == step_reads
        before = counter.syncs
        assert optimizer.step_was_skipped is True  # a fused skip is seen as one too
        assert optimizer.step_was_skipped is True
        assert counter.syncs - before == asked_reads  # asked twice, read at most once


# ---------------------------------------------------------------- W2: the GPU tests' harness


def test_harness_nccl_ranks_create_communicator_eagerly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import queue

    import torch.distributed as dist

    from tests import harness

    calls: list[dict[str, Any]] = []
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "KINETO_LOG_LEVEL"):  # a rank sets them
        monkeypatch.setenv(name, "")
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    results: queue.Queue[tuple[int, bool, Any]] = queue.Queue()
    for backend, device_id in [("nccl", torch.device("cuda", 1)), ("gloo", None)]:
        peer = dist.FileStore(str(tmp_path / backend), 2)  # rank 0, up: past the harness's barrier
        peer.set("up/0", "1")
        harness._rank_main(
            lambda rank, world_size: rank, 1, 2, str(tmp_path / backend), results, (), 5.0, backend
        )
        assert results.get_nowait() == (1, True, 1)
        assert calls.pop()["device_id"] == device_id
