"""AsyncShardedGradScaler: the scaler for optimizers that step on another thread.

The pattern (RoundPipe's, DeepSpeed's CPU-offloaded optimizers): the compute thread runs
iteration k+1's forward and backward while an optimizer thread unscales and steps iteration k,
and the main thread calls `update()` for iteration k as soon as it has handed iteration k over,
possibly before that step has run. `torch.amp.GradScaler` breaks there: it unscales with
whatever the scale is when `unscale_` runs, and its in-place `update()` modifies the scale
tensor a pending backward saved ("modified by an inplace operation").

Semantics (the contract this module keeps):

* Iterations are delimited by `update()`: iteration k is every `scale()` call after the
  (k-1)-th `update()` and up to the k-th. Call `update()` for iteration k before the first
  `scale()` of iteration k+1 (on any thread); several `scale()` calls in one iteration
  (gradient accumulation) share its scale.
* `scale()` of iteration k+1 gets the scale that `update()` of iteration k produced, exactly
  as in synchronous training, so every rank scales every iteration alike. Iteration k's outcome
  is known once its overflow flag is agreed (inside its `unscale_()`/`step()`), not when its
  optimizer step ends: `scale()` waits for that agreement only, and the optimizer's
  arithmetic overlaps the next forward and backward.
* `unscale_()`/`step()` serve the oldest iteration not yet stepped, and divide out exactly
  the scale its losses were multiplied by (each iteration keeps its own copy, which nothing
  modifies in place).
* `update()` never waits for the step: the scale moves when both `update()` was called and
  the flag was agreed, on whichever thread comes second.
* One optimizer per scaler (a second one raises): its step is what resolves an iteration.
* The scaler's collectives run on a process group of their own, created at construction (every
  rank builds the scaler, after `init_process_group`): collectives of one group must be issued
  in the same order on every rank, and the optimizer thread's would race with the model's.
* Waits are bounded by `step_timeout`; an exception in a step is re-raised, chained, by the
  `scale()` waiting for that iteration.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardscale._agree import Agreement
from shardscale._compat import passes_itself
from shardscale._config import ScalerConfig, timeout_option
from shardscale._iteration import InFlightIteration, IterationBook
from shardscale._optimizers import OptimizerTarget, steppables
from shardscale._report import ScalerStats
from shardscale.scaler import ShardedGradScaler

__all__ = ["AsyncShardedGradScaler", "on_device"]


def on_device(device: torch.device) -> AbstractContextManager[object]:
    """Make `device` the current one of its type on this thread, for the block.

    The optimizer thread is a new thread, whose current CUDA device is 0 whatever the compute
    thread set: the collectives' device, the stats copy's stream and anything else that follows
    the current device would land on GPU 0 from every rank. No-op on the CPU, on `meta` and
    for a device without an index.
    """
    if device.type in ("cpu", "meta") or device.index is None:
        return nullcontext()
    module = torch.get_device_module(device.type)
    select = getattr(module, "device", None)
    return nullcontext() if select is None else select(device.index)


class AsyncShardedGradScaler(ShardedGradScaler):
    """[`ShardedGradScaler`][] for an optimizer stepping on another thread (module docstring).

    Example:
        ```python
        scaler = AsyncShardedGradScaler()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)   # the optimizer thread

        def optimizer_step(grads):
            for param, grad in zip(params, grads):
                param.grad = grad
            scaler.step(optimizer)            # divides out exactly the scale the loss had

        for batch in loader:
            scaler.scale(loss_fn(model(batch))).backward()   # waits for the last flag only
            grads = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)                # the next backward gets fresh ones
            pool.submit(optimizer_step, grads)
            scaler.update()                   # may come before that step; never waits for it
        ```

    Args:
        step_timeout: the longest wait (`timedelta` or seconds) of `scale()`,
            `state_dict()` and friends for an iteration's step to agree its flag. Default 600 s.
        flag_backend: the backend of the scaler's own process group; None: its group's. On
            NCCL pass `"gloo"`: the optimizer thread then never runs NCCL kernels beside the
            model's (docs/async.md), and a proper subgroup works with a bound device
            (`init_process_group(device_id=...)`), where an NCCL group cannot be made by its
            members alone. Costs one small host copy of the flag per step.
        **kwargs: as for [`ShardedGradScaler`][], except `verify_every` (its collective would race
            with the optimizer thread's; call [`verify_agreement()`][verify_agreement] between
            iterations instead).

    Raises:
        ValueError: `verify_every` was given, or `step_timeout` is not a time > 0.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        step_timeout: timedelta | float = 600.0,
        flag_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("verify_every", 0):
            raise ValueError(
                "AsyncShardedGradScaler does not take verify_every: its collective would race "
                "with the optimizer thread's; call verify_agreement() between iterations"
            )
        if flag_backend is not None and not isinstance(flag_backend, str):
            raise TypeError(
                'flag_backend must be a backend name ("gloo") or None, got '
                f"{type(flag_backend).__name__}"
            )
        self._flag_backend = flag_backend  # read by _make_agreement, during construction
        super().__init__(device, **kwargs)
        timeout = timeout_option("step_timeout", step_timeout)
        assert timeout is not None
        self._step_timeout = timeout.total_seconds()
        self._lock = threading.Condition()
        self._iterations: deque[InFlightIteration] = deque()  # opened, not yet resolved and stepped
        self._open: InFlightIteration | None = None  # the one scale() is feeding
        self._opened = 0
        self._optimizer_id: int | None = None
        self._resolved_skip: torch.Tensor | None = None

    # The optimizer thread's agreement cannot wait for a step on the compute thread.
    _defers_agreement = False

    def _make_agreement(self, config: ScalerConfig) -> Agreement:
        """A process group of this scaler's own (made at construction, on every rank): the
        optimizer thread's collectives must not interleave with the model's."""
        agreement = Agreement(config.process_group, config.timeout)
        if dist.is_available() and dist.is_initialized():
            return agreement.dedicated(self._flag_backend)
        return agreement

    def scale(self, outputs: Any) -> Any:
        """As [`ShardedGradScaler.scale()`][ShardedGradScaler.scale].

        With this iteration's scale: the one `update()` of the previous iteration made.

        The first `scale()` of an iteration waits (at most `step_timeout`) until the
        previous iteration's overflow flag is agreed; later calls of the same iteration do not.
        """
        if self._enabled:
            with self._lock:
                if self._open is None:
                    self._open_iteration()
        return super().scale(outputs)

    def _open_iteration(self) -> None:
        """Wait for the ended iterations to resolve, then open the next one (lock held)."""
        self._check_world()
        self._wait(
            lambda: all(it.resolved for it in self._iterations),
            lambda: (
                f"the step of iteration {self._opened} to agree on its overflow "
                f"flag (scale() of iteration {self._opened + 1} needs its outcome)"
            ),
        )
        self._opened += 1
        book = IterationBook(step=self._steps + 1, on_agreed=self._on_agreed)
        self._open = InFlightIteration(number=self._opened, book=book)
        self._iterations.append(self._open)
        self._book = book  # scale() fills in its loss scale: a copy of the scale now

    def unscale_(self, optimizer: OptimizerTarget) -> None:
        """As [`ShardedGradScaler.unscale_()`][ShardedGradScaler.unscale_].

        For the oldest iteration not yet stepped.
        """
        if not self._enabled:
            return
        with self._serving(optimizer, "unscale_") as iteration:
            scale = self._loss_scale_of(iteration, "unscale_")
            with on_device(scale.device):
                self._stepper.unscale(iteration.book, optimizer, scale)

    def step(self, optimizer: OptimizerTarget, *args: Any, **kwargs: Any) -> Any:
        """As [`ShardedGradScaler.step()`][ShardedGradScaler.step].

        For the oldest iteration not yet stepped.

        Raises:
            NotImplementedError: the optimizer takes torch's deprecated `grad_scaler=`.
        """
        if not self._enabled or "closure" in kwargs:
            return super().step(optimizer, *args, **kwargs)
        if passes_itself(optimizer):
            raise NotImplementedError(
                "AsyncShardedGradScaler does not pass itself to optimizer.step(grad_scaler=...) "
                "(torch's deprecated protocol: the optimizer would read the scaler's state from "
                "another iteration's thread); use an optimizer that takes grad_scale/found_inf "
                "(torch's fused=True), or ShardedGradScaler"
            )
        with self._serving(optimizer, "step") as iteration:
            scale = self._loss_scale_of(iteration, "step")
            with on_device(scale.device):  # a new thread's current CUDA device is 0
                result, _, _ = self._stepper.step(iteration.book, optimizer, scale, args, kwargs)
        with self._lock:
            while self._iterations and self._iterations[0].resolved:
                if not self._iterations[0].stepped:
                    break
                self._iterations.popleft()
        return result

    @contextmanager
    def _serving(self, optimizer: OptimizerTarget, funcname: str) -> Iterator[InFlightIteration]:
        """The oldest iteration not yet stepped; a failure inside marks it failed for whoever
        waits for its outcome (a later `scale()`)."""
        leaves = [leaf for item in steppables(optimizer) for leaf in item.leaves]
        with self._lock:
            for leaf in leaves:
                if self._optimizer_id is None:
                    self._optimizer_id = id(leaf)
                elif self._optimizer_id != id(leaf):
                    raise ValueError(
                        "AsyncShardedGradScaler serves one optimizer, and got a second one: its "
                        "step is what completes an iteration. Use one optimizer (with several "
                        "param groups), or one scaler per optimizer"
                    )
            iteration = next((it for it in self._iterations if not it.stepped), None)
            if iteration is None:
                raise RuntimeError(
                    f"Attempted {funcname} but no iteration is waiting for a step: call "
                    "scaler.scale(loss) (and backward) before stepping its gradients"
                )
        try:
            yield iteration
        except BaseException as error:
            with self._lock:
                if not iteration.agreed:  # it can never resolve now: tell whoever waits
                    iteration.failure = error
                self._lock.notify_all()
            raise

    def _loss_scale_of(self, iteration: InFlightIteration, funcname: str) -> torch.Tensor:
        if iteration.book.loss_scale is None:
            raise RuntimeError(
                f"Attempted {funcname} but iteration {iteration.number} has no scale: call "
                "scaler.scale(loss) in it"
            )
        return iteration.book.loss_scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the current iteration; its scale update happens once its flag is agreed.

        Never waits for the step. `new_scale` is applied in that update, as in
        [`ShardedGradScaler.update()`][ShardedGradScaler.update].

        Raises:
            RuntimeError: no `scale()` was called since the last update().
        """
        if not self._enabled:
            return
        with self._lock:
            iteration = self._open
            if iteration is None:
                raise RuntimeError(
                    "update() was called, but no scale() since the last update(): there is no "
                    "iteration to end"
                )
            if new_scale is not None:
                iteration.manual_scale = self.policy.new_scale_tensor(new_scale)
            iteration.closed = True
            self._open = None
            self._resolve()

    def _on_agreed(self, book: IterationBook) -> None:
        """An iteration's flag is agreed (on the optimizer thread): resolve what can be."""
        with self._lock:
            self._resolve()
            self._lock.notify_all()

    def _resolve(self) -> None:
        """Apply, in order, the updates of iterations that are ended and agreed (lock held)."""
        for iteration in self._iterations:
            if iteration.resolved:
                continue
            found_infs = iteration.book.found_infs()
            if not iteration.closed or not found_infs:
                return
            iteration.resolved = True
            self._resolved_skip = found_infs[0]
            self._lock.notify_all()
            self._apply(found_infs, iteration.manual_scale)

    def _wait(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        """Wait (lock held) until `ready()`; raise on timeout or a failed step."""

        def done() -> bool:
            return ready() or any(it.failure is not None for it in self._iterations)

        if not self._lock.wait_for(done, timeout=self._step_timeout):
            raise RuntimeError(
                f"waited {self._step_timeout:g} s for {what()}, in vain: was step() called for "
                "every iteration, and update() before the next iteration's scale()?"
            )
        failed = next((it for it in self._iterations if it.failure is not None), None)
        if failed is not None:
            raise RuntimeError(
                f"the optimizer step of iteration {failed.number} failed; its scale update "
                "cannot happen (see the chained exception)"
            ) from failed.failure

    def _drained(self, funcname: str) -> None:
        """Wait (lock held) until every ended iteration has resolved."""
        self._wait(
            lambda: all(it.resolved or not it.closed for it in self._iterations),
            lambda: f"the ended iterations' steps to agree (before {funcname})",
        )

    def _check_world(self) -> None:
        # a group given or made at construction: only a default-group scaler lacks its own
        dedicated = self._agreement.process_group is not None
        initialised = dist.is_available() and dist.is_initialized()
        if not dedicated and initialised and dist.get_world_size() > 1:
            raise RuntimeError(
                "AsyncShardedGradScaler was built before torch.distributed was initialised: "
                "build it after init_process_group(), on every rank (it creates a process group "
                "of its own for the optimizer thread's collectives)"
            )

    def _compat_book(self) -> IterationBook:
        """The iteration torch's private views read: the oldest not yet resolved (the one a
        step serves), else the one `scale()` feeds."""
        with self._lock:
            oldest = next((it for it in self._iterations if not it.resolved), None)
            return oldest.book if oldest is not None else self._book

    def _check_inf_per_device(self, optimizer: OptimizerTarget) -> dict[str, Any]:
        """Refused: the check belongs to the step of the iteration it serves (its thread).

        Raises:
            NotImplementedError: always; `step()` checks and agrees by itself.
        """
        raise NotImplementedError(
            "AsyncShardedGradScaler._check_inf_per_device() is refused: an iteration's check "
            "and agreement run inside its step(), on the optimizer thread; read "
            "_found_inf_per_device(optimizer) or last_step_skipped after it"
        )

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recently resolved iteration's step was skipped (on every rank)."""
        with self._lock:
            skip = self._resolved_skip
        if skip is None:
            return False
        return self._agreement.read_flag(skip)

    @property
    def stats(self) -> ScalerStats:
        """As [`ShardedGradScaler.stats`][], after the ended iterations have resolved."""
        with self._lock:
            self._drained("stats")
            return super().stats

    def get_scale(self) -> float:
        """The scale after the ended iterations have resolved."""
        with self._lock:
            self._drained("get_scale()")
            return super().get_scale()

    def state_dict(self) -> dict[str, Any]:
        """As [`ShardedGradScaler.state_dict()`][ShardedGradScaler.state_dict].

        After the ended iterations have resolved.
        """
        with self._lock:
            self._drained("state_dict()")
            return super().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """As [`ShardedGradScaler.load_state_dict()`][ShardedGradScaler.load_state_dict].

        Only with no iteration in flight.

        Raises:
            RuntimeError: an iteration was scaled and not yet resolved.
        """
        with self._lock:
            if any(not it.resolved for it in self._iterations):
                raise RuntimeError(
                    f"load_state_dict() with {len(self._iterations)} iteration(s) in flight: "
                    "load before the first scale(), or after update() and that step"
                )
            super().load_state_dict(state_dict)

    def verify_agreement(self) -> None:
        """As [`ShardedGradScaler.verify_agreement()`][ShardedGradScaler.verify_agreement].

        Call it with no step in flight.
        """
        with self._lock:
            self._drained("verify_agreement()")
            super().verify_agreement()

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        replica_group: dist.ProcessGroup | DeviceMesh | int | None = None,
    ) -> torch.Tensor:
        """Not supported here: `unscale_(optimizer)` then clip (FSDP1: `model.clip_grad_norm_`).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "AsyncShardedGradScaler.clip_grad_norm_ is not supported: on the optimizer thread, "
            "call scaler.unscale_(optimizer) and then clip (FSDP1: model.clip_grad_norm_, "
            "FSDP2: torch.nn.utils.clip_grad_norm_ on the DTensor parameters)"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "an AsyncShardedGradScaler cannot be pickled (it holds a lock and a process group); "
            "save state_dict() instead"
        )
