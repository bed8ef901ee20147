"""The scaler's collectives as a GPU job would run them, on a CPU: NCCL's errors, NCCL's waits.

gloo cannot produce NCCL's behaviour, so its two backend-specific parts are stood in for here,
and only those: a fake ``Work`` (what ``wait()`` raises, when it returns) and a fake group object
(which device types it runs, which device it is bound to). The ballot on the ``meta`` device
takes every accelerator branch; a dispatch mode counts the host reads and device-to-host copies of
``verify_agreement``, ``locate`` and ``gather_objects`` (``tests.devicepath.DeviceCounter``,
answering with the values the device would have held). Real gloo ranks check the async scaler's
side group.

Covered (audit ids): an NCCL timeout is "late", not "a rank left" (W1); on an accelerator
backend the host never waits at the collective, and ``sync_timeout`` warns there that the
process group's own timeout is the bound (M1/P1; ../shared/research/nccl-inflight-audit.md:
NCCL's watchdog enforces that timeout and frees the GPU, which a host wait cannot); the async
scaler's own group is never made in the way that hangs with a bound device, and carries
``sync_timeout`` to its watchdog (W4); the communication device is the group's bound device,
then the scale's, then the thread's current device (M2); one host transfer for ``locate``, two
for ``gather_objects``, two for ``verify_agreement`` (P3, P6).
"""

from __future__ import annotations

import pickle
import threading
import time
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardscale import ShardScaleDistributedError, ShardScaleWarning
from shardscale._exchange import Exchange
from shardscale._locate import locate
from tests.devicepath import DeviceCounter

aten = torch.ops.aten
META = torch.device("meta")
_NCCL_TIMEOUT = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, Timeout(ms)=30000) ran for "
    "3001 milliseconds before timing out."
)


class _Work:
    """A ``Work`` whose completion and errors the test controls; records every ``wait``."""

    def __init__(
        self,
        *,
        error: RuntimeError | None = None,
        block_s: float = 0.0,
        done_after_s: float | None = 0.0,
    ) -> None:
        self.error = error
        self.block_s = block_s
        self.created = time.monotonic()
        self.done_after_s = done_after_s  # None: never completes
        self.waits: list[timedelta | None] = []

    def is_completed(self) -> bool:
        after = self.done_after_s
        return after is not None and time.monotonic() - self.created >= after

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.block_s:
            time.sleep(self.block_s)
        if self.error is not None:
            raise self.error
        return timeout is None or self.is_completed()


class _Group:
    """What the agreement asks of a process group's backend: its device types, its binding."""

    def __init__(self, device_types: list[str], bound: torch.device | None = None) -> None:
        self._device_types = [torch.device(t) for t in device_types]
        self.bound_device_id = bound


def _agreement(timeout: float | None, group: object | None = None, world_size: int = 2) -> Exchange:
    """An exchange over ``group`` as ``world_size`` ranks would see it, without a process group."""
    exchange = Exchange(None, None if timeout is None else timedelta(seconds=timeout))
    exchange._world_size = world_size
    exchange._group = group  # type: ignore[assignment]
    return exchange


def _ballot(device: torch.device) -> torch.Tensor:
    """A small float32 tensor standing for a ballot (`shardscale._check` makes the real ones):
    the exchange only carries it."""
    return torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], device=device)


def _agree_on_cpu(
    exchange: Exchange, work: Any, monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    """One agreement whose all_reduce returns ``work`` (or calls it, if it is callable)."""

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        return work(kwargs["async_op"]) if callable(work) else work

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    exchange.all_reduce(_ballot(torch.device("cpu")), dist.ReduceOp.MAX, step, "the overflow flag")


# ---------------------------------------------------------------------------- W1: late or gone


def test_collective_nccl_watchdog_timeout_raised_at_once_is_reported_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL's watchdog text never says "timed out"; it can arrive at once (audit §9.2)."""
    work = _Work(error=dist.DistBackendError(_NCCL_TIMEOUT))
    with pytest.raises(ShardScaleDistributedError) as caught:
        _agree_on_cpu(_agreement(3.0), work, monkeypatch, 1)
    message = str(caught.value)
    assert message.startswith("step 1: waited 3 s for all 2 ranks of the process group")
    assert "the overflow flag (all_reduce)" in message
    assert "left" not in message


def test_collective_error_after_the_whole_timeout_is_reported_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the text says: an error raised once the timeout has run out is the timeout."""
    work = _Work(error=RuntimeError("ProcessGroup operation failed"), block_s=0.3)
    with pytest.raises(ShardScaleDistributedError) as caught:
        _agree_on_cpu(_agreement(0.3), work, monkeypatch, 7)
    assert str(caught.value).startswith("step 7: waited 0.3 s for all 2 ranks")


def test_collective_wait_that_runs_out_is_reported_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's ``wait(timeout)`` may also just return False when the time runs out."""
    with pytest.raises(ShardScaleDistributedError, match=r"^step 3: waited 0.2 s for all 2"):
        _agree_on_cpu(_agreement(0.2), _Work(done_after_s=None), monkeypatch, 3)


def test_collective_broken_connection_is_reported_as_a_rank_that_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    work = _Work(error=dist.DistNetworkError("Connection reset by peer"))
    with pytest.raises(ShardScaleDistributedError) as caught:
        _agree_on_cpu(_agreement(3.0), work, monkeypatch, 2)
    message = str(caught.value)
    assert message.startswith("step 2: exchanging the overflow flag (all_reduce) with the other 1")
    assert "a rank left the process group (Connection reset by peer)" in message


def test_collective_without_timeout_nccl_watchdog_error_is_reported_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no ``sync_timeout`` the group's own timeout fires: still late, not gone."""

    def synchronous(async_op: bool) -> None:  # a blocking collective raises from the call
        assert not async_op
        raise dist.DistBackendError(_NCCL_TIMEOUT)

    with pytest.raises(ShardScaleDistributedError) as caught:
        _agree_on_cpu(_agreement(None), synchronous, monkeypatch, 4)
    assert str(caught.value).startswith(
        "step 4: waited out the process group's own timeout for all 2 ranks"
    )


# ------------------------------------------------------- M1/P1: no host wait on NCCL


@pytest.fixture
def nccl_on_meta(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``all_reduce``/``all_gather`` on a meta ballot through an NCCL-like group: each call is
    recorded (with whether it asked for a ``Work`` to wait on)."""
    issued: list[dict[str, Any]] = []

    def collective(*args: Any, **kwargs: Any) -> _Work | None:
        issued.append(kwargs)
        return _Work() if kwargs.get("async_op") else None

    monkeypatch.setattr(dist, "all_reduce", collective)
    monkeypatch.setattr(dist, "all_gather", collective)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    return issued


def _meta_step(exchange: Exchange, step: int) -> None:
    """The agreement's collective on a ballot where the step's scale is (`meta`: a GPU's)."""
    ballot = _ballot(exchange.comm_device(META))
    exchange.all_reduce(ballot, dist.ReduceOp.MAX, step, "the overflow flag")


def test_agree_on_an_accelerator_never_waits_on_the_host(
    nccl_on_meta: list[dict[str, Any]],
) -> None:
    exchange = _agreement(None, _Group(["meta"]))
    for step in (1, 2, 3):
        _meta_step(exchange, step)
    # Stream-ordered (async_op=False): nothing to wait on, no host synchronisation.
    assert [call["async_op"] for call in nccl_on_meta] == [False, False, False]


def test_agree_on_an_accelerator_with_sync_timeout_warns_once_that_the_group_bounds_it(
    nccl_on_meta: list[dict[str, Any]],
) -> None:
    exchange = _agreement(5.0, _Group(["meta"]))
    with pytest.warns(ShardScaleWarning, match=r"sync_timeout=5 s is not applied to the nccl"):
        _meta_step(exchange, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _meta_step(exchange, 2)  # once per device, not per step
    assert [call["async_op"] for call in nccl_on_meta] == [False, False]


# ------------------------------------------------------------ W4: the async scaler's own group


@pytest.fixture
def new_groups(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``dist.new_group`` recorded (a world of 4 ranks); returns a fake group."""
    calls: list[dict[str, Any]] = []

    def new_group(ranks: list[int] | None = None, **kwargs: Any) -> _Group:
        calls.append({"ranks": ranks, **kwargs})
        return _Group(["cuda"])

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    return calls


def _hangs(call: dict[str, Any], bound: torch.device | None) -> bool:
    """members-only creation under a bound device, with a backend that splits communicators"""
    return (
        bool(call.get("use_local_synchronization"))
        and bound is not None
        and (call.get("backend") in (None, "nccl"))
    )


def test_dedicated_world_group_with_bound_device_is_made_by_every_rank(
    monkeypatch: pytest.MonkeyPatch, new_groups: list[dict[str, Any]]
) -> None:
    bound = torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1, 2, 3])
    _agreement(None, _Group(["cuda"], bound), world_size=4).dedicated()
    assert [call["ranks"] for call in new_groups] == [[0, 1, 2, 3]]
    assert not _hangs(new_groups[0], bound)


def test_dedicated_proper_subgroup_with_bound_device_raises_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch, new_groups: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [2, 3])
    agreement = _agreement(None, _Group(["cuda"], torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r'flag_backend="gloo"') as caught:
        agreement.dedicated()
    assert "[2, 3]" in str(caught.value)
    assert "cuda:0" in str(caught.value)
    assert new_groups == []


def test_dedicated_proper_subgroup_with_bound_device_and_gloo_is_made_by_its_members(
    monkeypatch: pytest.MonkeyPatch, new_groups: list[dict[str, Any]]
) -> None:
    bound = torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [2, 3])
    _agreement(None, _Group(["cuda"], bound)).dedicated(backend="gloo")
    assert new_groups == [
        {"ranks": [2, 3], "backend": "gloo", "use_local_synchronization": True, "timeout": None}
    ]
    assert not _hangs(new_groups[0], bound)


def test_dedicated_of_a_gloo_subgroup_with_bound_device_keeps_gloo_and_its_members(
    monkeypatch: pytest.MonkeyPatch, new_groups: list[dict[str, Any]]
) -> None:
    """A scaler on a gloo group in an NCCL world gets a gloo group of its own, as before."""
    bound = torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [2, 3])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    _agreement(None, _Group(["cpu", "cuda"], bound)).dedicated()
    assert new_groups == [
        {"ranks": [2, 3], "backend": "gloo", "use_local_synchronization": True, "timeout": None}
    ]
    assert not _hangs(new_groups[0], bound)


def test_dedicated_without_bound_device_is_made_by_the_groups_members_alone_with_the_timeout(
    monkeypatch: pytest.MonkeyPatch, new_groups: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [2, 3])
    _agreement(7.0, _Group(["cpu", "cuda"])).dedicated()
    assert new_groups == [
        {
            "ranks": [2, 3],
            "backend": None,
            "use_local_synchronization": True,
            "timeout": timedelta(seconds=7),
        }
    ]


def _rank_async_with_a_gloo_flag_group(rank: int, world_size: int) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from shardscale import AsyncShardedGradScaler

    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = AsyncShardedGradScaler(init_scale=4.0, flag_backend="gloo", sync_timeout=30)
    group = scaler.process_group
    assert group is not None
    assert group is not dist.group.WORLD
    skipped = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for step in range(3):
            scaler.scale(param.sum()).backward()
            grads = [param.grad]
            param.grad = None
            if step == 1 and rank == 1:  # an overflow in this rank's gradient only
                grads[0][0] = float("inf")

            def optimizer_step(grads: list[Any] = grads) -> None:
                param.grad = grads[0]
                scaler.step(optimizer)
                param.grad = None

            pool.submit(optimizer_step).result()
            scaler.update()
            skipped.append(scaler.last_step_skipped)
    return {
        "backend": str(dist.get_backend(group)),
        "skipped": skipped,
        "param": param.tolist(),
        "scale": scaler.get_scale(),
    }


def test_async_scaler_flag_backend_gloo_agrees_on_a_gloo_group_of_its_own() -> None:
    from tests.harness import run_ranks

    results = run_ranks(_rank_async_with_a_gloo_flag_group, 2, timeout_s=120)
    assert results[0] == results[1]
    assert results[0]["backend"] == "gloo"
    assert results[0]["skipped"] == [False, True, False]
    assert results[0]["param"] == [-2.0, -2.0]  # two steps of -1 each; the skipped one left out
    assert results[0]["scale"] == 2.0


def test_async_scaler_flag_backend_must_be_a_string() -> None:
    from shardscale import AsyncShardedGradScaler

    with pytest.raises(TypeError, match=r"flag_backend must be a backend name .*, got int"):
        AsyncShardedGradScaler(flag_backend=1)  # type: ignore[arg-type]


# -------------------------------------------------------- M2: which device, on which thread


@pytest.fixture
def current_devices(monkeypatch: pytest.MonkeyPatch) -> threading.local:
    """``torch.cuda.current_device()`` per thread (0 unless a test sets ``.index``)."""
    local = threading.local()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "index", 0))
    return local


def test_comm_device_for_cpu_on_nccl_is_the_groups_bound_device(
    current_devices: threading.local,
) -> None:
    agreement = _agreement(None, _Group(["cuda"], torch.device("cuda", 3)))
    assert agreement.comm_device(torch.device("cpu")) == torch.device("cuda", 3)


def test_comm_device_for_cpu_on_nccl_follows_the_scales_device_before_the_current_one(
    current_devices: threading.local,
) -> None:
    agreement = _agreement(None, _Group(["cuda"]))
    assert agreement.comm_device(torch.device("cuda", 2)) == torch.device("cuda", 2)
    assert agreement.comm_device(torch.device("cpu")) == torch.device("cuda", 2)


def test_comm_device_falls_back_to_each_threads_current_device(
    current_devices: threading.local,
) -> None:
    agreement = _agreement(None, _Group(["cuda"]))
    current_devices.index = 5
    seen: list[torch.device] = []

    def other_thread() -> None:
        current_devices.index = 1
        seen.append(agreement.comm_device(torch.device("cpu")))

    assert agreement.comm_device(torch.device("cpu")) == torch.device("cuda", 5)
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen == [torch.device("cuda", 1)]


def test_comm_device_keeps_cpu_on_a_group_that_runs_cpu() -> None:
    agreement = _agreement(None, _Group(["cpu", "cuda"], torch.device("cuda", 3)))
    assert agreement.comm_device(torch.device("cpu")) == torch.device("cpu")


def test_device_path_on_makes_the_scales_device_current_on_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardscale._state import DevicePath

    entered: list[int] = []

    class _Module:
        @staticmethod
        @contextmanager
        def device(index: int) -> Any:
            entered.append(index)
            yield

    monkeypatch.setattr(torch, "get_device_module", lambda device_type: _Module)
    with DevicePath().on(torch.device("cuda", 3)):
        assert entered == [3]
    with DevicePath().on(torch.device("cpu")), DevicePath().on(META):  # nothing to make current
        pass
    assert entered == [3]


@pytest.mark.usefixtures("world_of_one")
def test_async_step_runs_under_the_scales_device() -> None:
    from shardscale import AsyncShardedGradScaler
    from shardscale.testing import cuda_path

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = AsyncShardedGradScaler(init_scale=2.0)
    with cuda_path() as path:
        scaler.scale(param.sum()).backward()
        thread = threading.Thread(target=scaler.step, args=(optimizer,))
        thread.start()
        thread.join()
        scaler.update()
    contexts = [event for event in path.events if event[0].startswith("device")]
    cpu = torch.device("cpu")
    assert contexts == [("device", cpu), ("device exit", cpu)]  # the scale's, around the step


# ------------------------------------------------------------------ P3, P6: host transfers


class _Transfers(DeviceCounter):
    """``tests.devicepath.DeviceCounter``, whose device-to-host copies answer, in turn, with
    ``answers`` (what the device would have held: sizes, bytes, counts), then with zeros."""

    def __init__(self, answers: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.answers = list(answers or [])

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        target = torch.device((kwargs or {}).get("device") or META)
        d2h = func is aten._to_copy.default and args[0].device == META and target.type == "cpu"
        if d2h and self.answers:
            return self.answers.pop(0).to(out.dtype).reshape(out.shape)
        return out

    @property
    def transfers(self) -> tuple[int, int]:
        """(host reads, device-to-host copies, blocking or not) so far."""
        counts = self.counts()
        return counts.host_reads, counts.d2h_blocking + counts.d2h_async


def test_locate_reads_all_pieces_on_a_device_in_one_transfer() -> None:
    params = [torch.nn.Parameter(torch.zeros(n, device=META)) for n in (3, 4, 5, 6)]
    for param in params:
        param.grad = torch.zeros_like(param)
    named = [(f"layer{i}.weight", p) for i, p in enumerate(params)]
    counts = torch.tensor([[0, 0], [2, 1], [0, 0], [0, 3]])
    with _Transfers([counts]) as transfers:
        records = locate(named, _agreement(None, world_size=1), 1)
    assert transfers.transfers == (0, 1)
    assert [str(r) for r in records] == [
        "rank 0: layer1.weight (2 inf, 1 NaN)",
        "rank 0: layer3.weight (0 inf, 3 NaN)",
    ]


def test_gather_objects_reads_the_sizes_once_and_the_chunks_once(
    nccl_on_meta: list[dict[str, Any]],
) -> None:
    mine, theirs = pickle.dumps(["a"]), pickle.dumps(["bcd", 4])
    longest = max(len(mine), len(theirs))
    chunks = torch.zeros(2, longest, dtype=torch.uint8)
    chunks[0, : len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    chunks[1, : len(theirs)] = torch.frombuffer(bytearray(theirs), dtype=torch.uint8)
    sizes = torch.tensor([len(mine), len(theirs)])
    exchange = _agreement(None, _Group(["meta"]))
    exchange._accelerator = META  # the scale's device, as after a step on it
    with _Transfers([sizes, chunks]) as transfers:
        gathered = exchange.gather_objects(["a"], 1, "records")
    assert gathered == [["a"], ["bcd", 4]]
    assert transfers.transfers == (0, 2)
    assert [call["async_op"] for call in nccl_on_meta] == [False, False]


def test_compare_costs_one_transfer_and_names_what_differs(
    nccl_on_meta: list[dict[str, Any]],
) -> None:
    agreement = _agreement(None, _Group(["meta"]))
    values = torch.zeros(2, dtype=torch.float64, device=META)
    with _Transfers() as transfers:
        agreement.compare(values, ["scale", "steps"], 3)
    assert transfers.transfers == (0, 1)
    rows = torch.tensor([[1024.0, 3.0], [2048.0, 3.0]])
    with _Transfers([rows]), pytest.raises(ShardScaleDistributedError) as caught:
        agreement.compare(values, ["scale", "steps"], 3)
    assert str(caught.value) == (
        "step 3: the scaler states of the 2 ranks differ: scale: rank 0 = 1024, rank 1 = 2048"
    )


def test_verify_agreement_of_a_device_state_costs_two_transfers(
    nccl_on_meta: list[dict[str, Any]],
) -> None:
    """The state, read once, and every rank's values, gathered once."""
    from shardscale import ShardedGradScaler

    scaler = ShardedGradScaler(init_scale=8.0)
    scaler._agreement.exchange = _agreement(None, _Group(["meta"]))
    scaler._home.at(META)
    with _Transfers() as transfers:
        scaler.verify_agreement()
    assert transfers.transfers == (0, 2)
