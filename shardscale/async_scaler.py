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
  is known once its overflow flag is agreed (inside its `step()`), not when its optimizer step
  ends: `scale()` waits for that agreement only, and the optimizer's arithmetic overlaps the
  next forward and backward.
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
* `clip_grad_norm_()` clips the oldest iteration not yet stepped too: call it on the optimizer
  thread, before that iteration's `step()`.

It is built from parts it is given, not from its base's insides: its own process group (passed
to [`ShardedGradScaler`][] as `process_group`), a lock over the base's protocol calls, and the
optimizer handed to the base's `step()` inside a container of one whose `step()` first says
that the flag was agreed: the moment to apply the iteration's update, before the optimizer's
arithmetic.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from shardscale._config import timeout_option
from shardscale._errors import ShardScaleWarning
from shardscale._exchange import Exchange
from shardscale._report import ScalerStats
from shardscale._state import device_path
from shardscale._stepping import OptimizerTarget, leaves
from shardscale.scaler import ShardedGradScaler, passes_itself

__all__ = ["AsyncShardedGradScaler"]


@dataclass(eq=False, slots=True)
class _Iteration:
    """One iteration, from its first `scale()` until it is stepped and its update applied.

    Attributes:
        device: The first loss's device, where its scale lives (the optimizer thread runs under it).
        closed: update() was called for it.
        agreed: Its flag was agreed (inside its step).
        resolved: Its update was applied.
    """

    number: int
    device: torch.device
    closed: bool = False
    agreed: bool = False
    resolved: bool = False
    stepped: bool = False
    manual_scale: torch.Tensor | None = None
    failure: BaseException | None = None


class _Notifying:
    """`optimizer`, as a container of one (the base steps containers: their leaves are checked
    and handed the flag, the container's `step()` is called once, after the agreement) whose
    `step()` first tells that the flag was agreed."""

    def __init__(self, optimizer: Any, agreed: Callable[[], None]) -> None:
        self.optimizers = [optimizer]
        self._agreed = agreed

    @property
    def param_groups(self) -> Any:
        return self.optimizers[0].param_groups

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._agreed()
        return self.optimizers[0].step(*args, **kwargs)


class AsyncShardedGradScaler(ShardedGradScaler):
    """[`ShardedGradScaler`][] for an optimizer stepping on another thread (module docstring).

    Example:
        ```python
        scaler = AsyncShardedGradScaler()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)   # the optimizer thread
        # `optimizer` steps `master_params`, its own copy of the weights (fp32, say, on the
        # CPU), never the model's: their .grad is where the next backward accumulates

        def optimizer_step(grads):
            for master, grad in zip(master_params, grads):
                master.grad = grad            # this iteration's tensors, no backward's
            scaler.step(optimizer)            # divides out exactly the scale the loss had

        for batch in loader:
            scaler.scale(loss_fn(model(batch))).backward()   # waits for the last flag only
            grads = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)                # the next backward gets fresh ones
            pool.submit(optimizer_step, grads)
            scaler.update()                   # may come before that step; never waits for it
        pool.shutdown()                       # the last step has run
        ```

    Args:
        device: device type of the loss, as for [`ShardedGradScaler`][] (None, the default:
            taken from the first tensor passed to [`scale()`][scale]). The optimizer thread's
            `unscale_()` and `step()` run under the scale's device, whichever device that
            thread has current (docs/async.md).
        step_timeout: the longest wait (`timedelta` or seconds) of `scale()`,
            `state_dict()` and friends for an iteration's step to agree its flag. Default 600 s.
        flag_backend: the backend of the scaler's own process group. `"gloo"`, the default:
            the optimizer thread then never runs NCCL kernels beside the model's (NCCL's own
            documentation calls issuing operations to two communicators of one device from
            two threads unsafe: docs/async.md), and a proper subgroup works with a bound
            device (`init_process_group(device_id=...)`), where an NCCL group cannot be made
            by its members alone. Costs one small host copy of the flag per step, on the
            optimizer thread. None: the scaler's group's own backend (NCCL on GPUs: a second
            communicator, used from the optimizer thread, at your own risk).
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
        flag_backend: str | None = "gloo",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("verify_every", 0):
            raise ValueError(
                "AsyncShardedGradScaler does not take verify_every: its collective would race "
                "with the optimizer thread's; call verify_agreement() between iterations"
            )
        if kwargs.get("max_retries", 3) != 3:  # it bounds step(closure=...), refused here
            warnings.warn(
                "AsyncShardedGradScaler does not use max_retries: its step() refuses a closure",
                ShardScaleWarning,
                stacklevel=2,
            )
        if flag_backend is not None and not isinstance(flag_backend, str):
            raise TypeError(
                'flag_backend must be a backend name ("gloo") or None, got '
                f"{type(flag_backend).__name__}"
            )
        timeout = timeout_option("step_timeout", step_timeout)
        if timeout is None:  # unbounded: a step that never comes would hang every rank
            raise ValueError("step_timeout must be a finite time > 0, got None")
        # A process group of the scaler's own, made now on every rank: the optimizer thread's
        # collectives must not interleave with the model's.
        group = Exchange(
            kwargs.get("process_group"), timeout_option("sync_timeout", kwargs.get("sync_timeout"))
        ).dedicated(flag_backend)
        super().__init__(device, **kwargs | ({} if group is None else {"process_group": group}))
        self._step_timeout = timeout.total_seconds()
        self._own_group = group is not None
        self._lock = threading.Condition()
        self._iterations: deque[_Iteration] = deque()  # opened, not yet both resolved and stepped
        self._open: _Iteration | None = None  # the one scale() is feeding
        self._opened = 0
        self._optimizer_id: int | None = None

    def scale(self, outputs: Any) -> Any:
        """As [`ShardedGradScaler.scale()`][ShardedGradScaler.scale].

        With this iteration's scale: the one `update()` of the previous iteration made.

        The first `scale()` of an iteration waits (at most `step_timeout`) until the
        previous iteration's overflow flag is agreed; later calls of the same iteration do not.
        """
        if self.is_enabled():
            with self._lock:
                if self._open is None:
                    self._open_iteration(_device_of(outputs))
        return super().scale(outputs)

    def _open_iteration(self, device: torch.device) -> None:
        """Wait for the ended iterations to resolve, then open the next one (lock held)."""
        initialised = dist.is_available() and dist.is_initialized()
        if not self._own_group and initialised and dist.get_world_size() > 1:
            raise RuntimeError(
                "AsyncShardedGradScaler was built before torch.distributed was initialised: "
                "build it after init_process_group(), on every rank (it creates a process "
                "group of its own for the optimizer thread's collectives)"
            )
        self._wait(
            lambda: all(it.resolved for it in self._iterations),
            lambda: (
                f"the step of iteration {self._opened} to agree on its overflow "
                f"flag (scale() of iteration {self._opened + 1} needs its outcome)"
            ),
        )
        self._opened += 1
        self._open = _Iteration(self._opened, device)
        self._iterations.append(self._open)

    def unscale_(self, optimizer: OptimizerTarget) -> None:
        """As [`ShardedGradScaler.unscale_()`][ShardedGradScaler.unscale_].

        For the oldest iteration not yet stepped.
        """
        if not self.is_enabled():
            return
        with self._serving(optimizer, "unscale_") as iteration, device_path().on(iteration.device):
            super().unscale_(optimizer)

    def step(self, optimizer: OptimizerTarget, *args: Any, **kwargs: Any) -> Any:
        """As [`ShardedGradScaler.step()`][ShardedGradScaler.step].

        For the oldest iteration not yet stepped.

        Raises:
            NotImplementedError: a `closure` (a retry needs the batch on this thread, and
                the next iteration may have begun), or an optimizer that takes torch's
                deprecated `grad_scaler=`.
        """
        if not self.is_enabled():
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise NotImplementedError(
                "AsyncShardedGradScaler.step(closure=...) is not supported: rerunning a batch "
                "would need its forward and backward on the optimizer thread while the next "
                "iteration runs on the compute thread; use ShardedGradScaler to retry batches"
            )
        if passes_itself(optimizer):
            raise NotImplementedError(
                "AsyncShardedGradScaler does not pass itself to optimizer.step(grad_scaler=...) "
                "(torch's deprecated protocol: the optimizer would read the scaler's state from "
                "another iteration's thread); use an optimizer that takes grad_scale/found_inf "
                "(torch's fused=True), or ShardedGradScaler"
            )
        with self._serving(optimizer, "step") as iteration, device_path().on(iteration.device):
            container = _Notifying(optimizer, lambda: self._agreed(iteration))
            result = super().step(cast(torch.optim.Optimizer, container), *args, **kwargs)
        self._agreed(iteration)  # a skipped non-fused step never reaches the container
        with self._lock:
            iteration.stepped = True
            while self._iterations and self._iterations[0].resolved and self._iterations[0].stepped:
                self._iterations.popleft()
        return result

    @contextmanager
    def _serving(self, optimizer: OptimizerTarget, funcname: str) -> Iterator[_Iteration]:
        """The oldest iteration not yet stepped; a failure inside marks it failed for whoever
        waits for its outcome (a later `scale()`)."""
        with self._lock:
            for leaf in leaves(optimizer):
                if self._optimizer_id not in (None, id(leaf)):
                    raise ValueError(
                        "AsyncShardedGradScaler serves one optimizer, and got a second one: its "
                        "step is what completes an iteration. Use one optimizer (with several "
                        "param groups), or one scaler per optimizer"
                    )
                self._optimizer_id = id(leaf)
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

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the current iteration; its scale update happens once its flag is agreed.

        Never waits for the step. `new_scale` is applied in that update, as in
        [`ShardedGradScaler.update()`][ShardedGradScaler.update].

        Raises:
            RuntimeError: no `scale()` was called since the last update().
        """
        if not self.is_enabled():
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

    def _agreed(self, iteration: _Iteration) -> None:
        """`iteration`'s flag is agreed (on the optimizer thread): resolve what can be."""
        with self._lock:
            if not iteration.agreed:
                iteration.agreed = True
                self._resolve()

    def _resolve(self) -> None:
        """Apply, in order, the updates of iterations that are ended and agreed (lock held)."""
        for iteration in self._iterations:
            if iteration.resolved:
                continue
            if not (iteration.closed and iteration.agreed):
                return
            iteration.resolved = True
            self._lock.notify_all()
            super().update(iteration.manual_scale)

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

    @contextmanager
    def _drained(self, funcname: str) -> Iterator[None]:
        """Hold the lock, once every ended iteration has resolved."""
        with self._lock:
            self._wait(
                lambda: all(it.resolved or not it.closed for it in self._iterations),
                lambda: f"the ended iterations' steps to agree (before {funcname})",
            )
            yield

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
    def stats(self) -> ScalerStats:
        """As [`ShardedGradScaler.stats`][], after the ended iterations have resolved."""
        with self._drained("stats"):
            return super().stats

    def get_scale(self) -> float:
        """The scale after the ended iterations have resolved."""
        with self._drained("get_scale()"):
            return super().get_scale()

    def state_dict(self) -> dict[str, Any]:
        """As [`ShardedGradScaler.state_dict()`][ShardedGradScaler.state_dict].

        After the ended iterations have resolved.
        """
        with self._drained("state_dict()"):
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
        with self._drained("verify_agreement()"):
            super().verify_agreement()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "an AsyncShardedGradScaler cannot be pickled (it holds a lock and a process group); "
            "save state_dict() instead"
        )


def _device_of(outputs: Any) -> torch.device:
    """The device of the first tensor in `outputs` (a tensor or nested lists of them)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.device
    for output in outputs if isinstance(outputs, (list, tuple)) else ():
        return _device_of(output)
    return torch.device("cpu")
