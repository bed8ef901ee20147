"""AsyncShardedGradScaler: the scaler for optimizers that step on another thread.

The pattern (RoundPipe's, DeepSpeed's CPU-offloaded optimizers): the compute thread runs
iteration k+1's forward and backward while an optimizer thread unscales and steps iteration k,
and the main thread calls ``update()`` for iteration k as soon as it has handed iteration k over,
possibly before that step has run. ``torch.amp.GradScaler`` breaks there: it unscales with
whatever the scale is when ``unscale_`` runs, and its in-place ``update()`` modifies the scale
tensor a pending backward saved ("modified by an inplace operation").

Semantics (the contract this module keeps):

* Iterations are delimited by ``update()``: iteration k is every ``scale()`` call after the
  (k-1)-th ``update()`` and up to the k-th. Call ``update()`` for iteration k before the first
  ``scale()`` of iteration k+1 (on any thread); several ``scale()`` calls in one iteration
  (gradient accumulation) share its scale.
* ``scale()`` of iteration k+1 gets the scale that ``update()`` of iteration k produced, exactly
  as in synchronous training, so every rank scales every iteration alike. Iteration k's outcome
  is known once its overflow flag is agreed (inside its ``unscale_()``/``step()``), not when its
  optimizer step ends: ``scale()`` waits for that agreement only, and the optimizer's
  arithmetic overlaps the next forward and backward.
* ``unscale_()``/``step()`` serve the oldest iteration not yet stepped, and divide out exactly
  the scale its losses were multiplied by (each iteration keeps its own copy, which nothing
  modifies in place).
* ``update()`` never waits for the step: the scale moves when both ``update()`` was called and
  the flag was agreed, on whichever thread comes second.
* One optimizer per scaler (a second one raises): its step is what resolves an iteration.
* The scaler's collectives run on a process group of their own, created at construction (every
  rank builds the scaler, after ``init_process_group``): collectives of one group must be issued
  in the same order on every rank, and the optimizer thread's would race with the model's.
* Waits are bounded by ``step_timeout``; an exception in a step is re-raised, chained, by the
  ``scale()`` waiting for that iteration.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardscale._agree import Agreement
from shardscale._optimizers import OptimizerTarget
from shardscale._report import ScalerStats
from shardscale.scaler import ShardedGradScaler, _OptimizerRecord, _Stage

__all__ = ["AsyncShardedGradScaler"]


@dataclass(slots=True)
class _Iteration:
    number: int
    """1-based, counted by this scaler (the step number is ``record.step``)."""
    loss_scale: torch.Tensor
    """The scale this iteration's losses were multiplied by; never modified."""
    record: _OptimizerRecord | None = None
    closed: bool = False
    """update() was called for it."""
    resolved: bool = False
    """Its scale update was applied."""
    manual_scale: torch.Tensor | None = None
    failure: BaseException | None = None

    @property
    def agreed(self) -> bool:
        return self.record is not None and self.record.found_inf is not None


def _seconds(value: timedelta | float) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(
            f"step_timeout must be a datetime.timedelta or seconds, got {type(value).__name__}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"step_timeout must be a finite time > 0, got {seconds} s")
    return float(seconds)


class AsyncShardedGradScaler(ShardedGradScaler):
    """:class:`ShardedGradScaler` for an optimizer stepping on another thread (module docstring).

    Example::

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

    Args:
        step_timeout: the longest wait (``timedelta`` or seconds) of ``scale()``,
            ``state_dict()`` and friends for an iteration's step to agree its flag. Default 600 s.
        **kwargs: as for :class:`ShardedGradScaler`, except ``verify_every`` (its collective
            would race with the optimizer thread's; call :meth:`verify_agreement` between
            iterations instead).

    Raises:
        ValueError: ``verify_every`` was given, or ``step_timeout`` is not a time > 0.
    """

    _defers_agreement = False

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        step_timeout: timedelta | float = 600.0,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("verify_every", 0):
            raise ValueError(
                "AsyncShardedGradScaler does not take verify_every: its collective would race "
                "with the optimizer thread's; call verify_agreement() between iterations"
            )
        super().__init__(device, **kwargs)
        self._step_timeout = _seconds(step_timeout)
        self._lock = threading.Condition()
        self._iterations: deque[_Iteration] = deque()  # opened, not yet resolved and stepped
        self._open: _Iteration | None = None  # the one scale() is feeding
        self._opened = 0
        self._optimizer_id: int | None = None
        self._resolved_skip: torch.Tensor | None = None
        if dist.is_available() and dist.is_initialized():
            group = self._agreement.process_group or dist.group.WORLD
            ranks = dist.get_process_group_ranks(group)
            if len(ranks) > 1:
                own = dist.new_group(ranks)
                self._agreement = Agreement(own, self._agreement.timeout)

    # ------------------------------------------------------------------ the iteration

    def _loss_factor(self) -> torch.Tensor:
        """This iteration's scale: the one ``update()`` of the previous iteration made.

        The first ``scale()`` of an iteration waits (at most ``step_timeout``) until the
        previous iteration's overflow flag is agreed; later calls of the same iteration do not.
        """
        with self._lock:
            if self._open is None:
                self._check_world()
                self._wait(
                    lambda: all(it.resolved for it in self._iterations),
                    lambda: (
                        f"the step of iteration {self._opened} to agree on its overflow "
                        f"flag (scale() of iteration {self._opened + 1} needs its outcome)"
                    ),
                )
                state = self._require_state("scale")
                self._opened += 1
                self._open = _Iteration(number=self._opened, loss_scale=state.scale.clone())
                self._iterations.append(self._open)
            return self._open.loss_scale

    def _begin(
        self, optimizer: torch.optim.Optimizer, funcname: str
    ) -> tuple[_OptimizerRecord, torch.Tensor]:
        with self._lock:
            if self._optimizer_id is None:
                self._optimizer_id = id(optimizer)
            elif self._optimizer_id != id(optimizer):
                raise ValueError(
                    "AsyncShardedGradScaler serves one optimizer, and got a second one: its step "
                    "is what completes an iteration. Use one optimizer (with several param "
                    "groups), or one scaler per optimizer"
                )
            iteration = next(
                (
                    it
                    for it in self._iterations
                    if it.record is None or it.record.stage is not _Stage.STEPPED
                ),
                None,
            )
            if iteration is None:
                raise RuntimeError(
                    f"Attempted {funcname} but no iteration is waiting for a step: call "
                    "scaler.scale(loss) (and backward) before stepping its gradients"
                )
            if iteration.record is None:
                # every older iteration has resolved (scale() waited for it): counted in _steps
                iteration.record = _OptimizerRecord(optimizer, step=self._steps + 1)
            return iteration.record, iteration.loss_scale

    def unscale_(self, optimizer: OptimizerTarget) -> None:
        """As :meth:`ShardedGradScaler.unscale_`, for the oldest iteration not yet stepped."""
        self._failing_safely(lambda: super(AsyncShardedGradScaler, self).unscale_(optimizer))

    def step(self, optimizer: OptimizerTarget, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`ShardedGradScaler.step`, for the oldest iteration not yet stepped."""
        return self._failing_safely(
            lambda: super(AsyncShardedGradScaler, self).step(optimizer, *args, **kwargs)
        )

    def _failing_safely(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except BaseException as error:
            with self._lock:
                # the iteration this call served can never resolve: tell whoever waits for it
                for iteration in self._iterations:
                    if iteration.record is not None and not iteration.agreed:
                        iteration.failure = error
                        break
                self._lock.notify_all()
            raise

    def _end(self, record: _OptimizerRecord) -> None:
        with self._lock:
            self._resolve()
            while (
                self._iterations
                and self._iterations[0].resolved
                and self._iterations[0].record is not None
                and self._iterations[0].record.stage is _Stage.STEPPED
            ):
                self._iterations.popleft()

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the current iteration; its scale update happens once its flag is agreed.

        Never waits for the step. ``new_scale`` is applied in that update, as in
        :meth:`ShardedGradScaler.update`.

        Raises:
            RuntimeError: no ``scale()`` was called since the last update().
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
                iteration.manual_scale = self._checked_new_scale(new_scale)
            iteration.closed = True
            self._open = None
            self._resolve()

    def _resolve(self) -> None:
        """Apply, in order, the updates of iterations that are ended and agreed (lock held)."""
        for iteration in self._iterations:
            if iteration.resolved:
                continue
            found_inf = iteration.record.found_inf if iteration.record is not None else None
            if not iteration.closed or found_inf is None:
                return
            iteration.resolved = True
            self._resolved_skip = found_inf
            self._lock.notify_all()
            self._apply([found_inf], iteration.manual_scale)

    # ------------------------------------------------------------------ waiting

    def _wait(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        """Wait (lock held) until ``ready()``; raise on timeout or a failed step."""

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
        if not dedicated and dist.is_available() and dist.is_initialized():
            group = self._agreement.process_group or dist.group.WORLD
            if dist.get_world_size(group) > 1:
                raise RuntimeError(
                    "AsyncShardedGradScaler was built before torch.distributed was "
                    "initialised: build it after init_process_group(), on every rank (it creates "
                    "a process group of its own for the optimizer thread's collectives)"
                )

    # ------------------------------------------------------------------ reading the state

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recently resolved iteration's step was skipped (on every rank)."""
        with self._lock:
            skip = self._resolved_skip
        return bool(skip.item()) if skip is not None else False

    @property
    def stats(self) -> ScalerStats:
        """As :attr:`ShardedGradScaler.stats`, after the ended iterations have resolved."""
        with self._lock:
            self._drained("stats")
            return super().stats

    def get_scale(self) -> float:
        """The scale after the ended iterations have resolved."""
        with self._lock:
            self._drained("get_scale()")
            return super().get_scale()

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`ShardedGradScaler.state_dict`, after the ended iterations have resolved."""
        with self._lock:
            self._drained("state_dict()")
            return super().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """As :meth:`ShardedGradScaler.load_state_dict`; only with no iteration in flight.

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
        """As :meth:`ShardedGradScaler.verify_agreement`; call it with no step in flight."""
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
        """Not supported here: ``unscale_(optimizer)`` then clip (FSDP1: ``model.clip_grad_norm_``).

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
