"""Seams for testing training code that uses shardscale: the CUDA path, on CPU tensors.

On CUDA the scaler reads its device state *late*: `update()` starts a non-blocking copy into
pinned memory and reads it at the next `update()`, after waiting for its event; the alarms
that watch the skip streaks, the stats hooks and the log all run off those copies. On the CPU
it reads at once. The CUDA branches decide when ranks sound alarms (and gather), so they must
be tested on several ranks, and CI has no GPU: [`cuda_path()`][cuda_path] makes the scaler take
them on CPU tensors, in real multi-process gloo runs.

```python
from shardscale.testing import cuda_path

with cuda_path() as path:          # in each rank's process
    for step in range(steps):
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
assert path.waits <= path.copies  # every late read waited for its copy
```

Under it, for every device (the CPU, and `meta` for counting kernels):

* the state is read late: each copy lands in a buffer that reads NaN until its wait, so a
  read before the wait fails loudly instead of passing by luck;
* the capture check answers [`CudaPathLog.capturing`][CudaPathLog.capturing] (False unless set):
  set it to run a step as if a CUDA graph captured it;
* device contexts are entered and recorded, never switched.

The kernels the scaler picks (CPU or accelerator) and the collectives' device and backend are
the tensors' own: the seam changes only how the host meets the device. This module is the one
place the package knows about tests (`shardscale._state.DevicePath` is the path it replaces).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch

from shardscale import _state

__all__ = ["CudaPathLog", "cuda_path"]


@dataclass
class CudaPathLog:
    """What the scaler did on the CUDA path under [`cuda_path()`][cuda_path] (all threads).

    Attributes:
        capturing: what the capture check answers; set it to True to run a step as one a CUDA
            graph captures (nothing is captured: the check is all that changes).
        copies: non-blocking device-to-host copies started (each into a "pinned" buffer).
        waits: waits for a copy to land (CUDA: `Event.synchronize`).
        events: in order, `("copy", device)`, `("wait", None)`, `("capture check", device)`,
            `("device", device)` and `("device exit", device)` (a device context).
    """

    capturing: bool = False
    copies: int = 0
    waits: int = 0
    events: list[tuple[str, object]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, what: str, detail: object = None) -> None:
        """Record an event (thread-safe: the async scaler's optimizer thread writes here too)."""
        with self._lock:
            self.events.append((what, detail))
            self.copies += what == "copy"
            self.waits += what == "wait"


class _CudaOnCpu(_state.DevicePath):
    """The CUDA answers for every device: late reads through poisoned buffers, a settable
    capture check, recorded device contexts."""

    def __init__(self, log: CudaPathLog) -> None:
        self.log = log

    def reads_late(self, device: torch.device) -> bool:
        return True

    def capturing(self, device: torch.device) -> bool:
        self.log.note("capture check", device)
        return self.log.capturing

    def on(self, device: torch.device) -> AbstractContextManager[object]:
        return self._entered(device)

    @contextmanager
    def _entered(self, device: torch.device) -> Iterator[None]:
        self.log.note("device", device)
        try:
            yield
        finally:
            self.log.note("device exit", device)

    def copy_late(self, tensor: torch.Tensor) -> _state.Landing:
        # torch.empty rather than pin_memory=True: a CPU-only torch cannot pin. The copy is
        # non-blocking as CUDA's (a `meta` tensor's is then counted as one).
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        host.copy_(tensor, non_blocking=True)
        landed = host.clone()
        host.fill_(math.nan if host.is_floating_point() else torch.iinfo(host.dtype).min)
        self.log.note("copy", tensor.device)

        def wait() -> None:
            self.log.note("wait")
            host.copy_(landed)

        return _state.Landing(host, wait)


@contextmanager
def cuda_path(*, capturing: bool = False) -> Iterator[CudaPathLog]:
    """Make the scaler take its CUDA branches on CPU (and `meta`) tensors, for the block.

    Enter it in each rank's process (every thread of the process is under it), around the
    steps to test: a scaler's state read late, its alarms one update late, its capture check
    and device contexts as on a GPU (the module docstring says exactly what changes).

    Args:
        capturing: what the capture check answers at first (the log's `capturing` changes it).

    Yields:
        The [`CudaPathLog`][CudaPathLog] of what the scaler did on the path.
    """
    log = CudaPathLog(capturing=capturing)
    previous = _state.use_device_path(_CudaOnCpu(log))
    try:
        yield log
    finally:
        _state.use_device_path(previous)
