"""The scale state as tensors on the device, where every step updates it without a host sync.

Invariant: between two `update()` calls the tensors hold exactly what the checkpoint format
(`_checkpoint.ScalerState`) would read back; one host read (`packed`) gets all of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from shardscale._checkpoint import Counters, ScalerState
from shardscale._policy import ScalePolicy, ScaleState

__all__ = ["DeviceState", "unpack"]


@dataclass(frozen=True, slots=True)
class DeviceState:
    """The scale state as tensors on the loss's device, where the hot path updates it.

    Kept on the device so that `update()` needs no host synchronisation; read back to host
    values only for `state_dict()` and `get_scale()`.
    """

    scale: torch.Tensor
    """float32 scalar."""
    growth_tracker: torch.Tensor
    """int32 scalar."""
    hysteresis_tracker: torch.Tensor
    """int32 scalar."""
    counters: torch.Tensor
    """float64 `[steps, skipped_steps, consecutive_skips, steps_since_overflow]` (exact to
    2**53 steps). The last slot, rather than the last overflow's step number, because it
    updates with the same multiply-add as the others."""

    @classmethod
    def create(cls, state: ScalerState, device: torch.device) -> DeviceState:
        """Tensors on `device` holding `state`."""
        device_state = cls(
            scale=torch.empty((), dtype=torch.float32, device=device),
            growth_tracker=torch.empty((), dtype=torch.int32, device=device),
            hysteresis_tracker=torch.empty((), dtype=torch.int32, device=device),
            counters=torch.zeros(4, dtype=torch.float64, device=device),
        )
        device_state.write(state)
        return device_state

    def write(self, state: ScalerState) -> None:
        """Overwrite the tensors in place with `state` (keeping their identity)."""
        self.scale.fill_(state.scale.scale)
        self.growth_tracker.fill_(state.scale.growth_tracker)
        self.hysteresis_tracker.fill_(state.scale.hysteresis_tracker)
        counters = state.counters
        since = counters.steps - counters.last_overflow_step
        values = (counters.steps, counters.skipped_steps, counters.consecutive_skips, since)
        self.counters.copy_(torch.tensor(values, dtype=torch.float64))

    def count_step_(self, found_inf: torch.Tensor) -> None:
        """Count one step, skipped if `found_inf` (exactly 0.0 or 1.0), without a host sync.

        Counted on the device, not the host, so the counts stay right when step+update is
        replayed from a CUDA graph. In two kernels: with s = found_inf,
        `rows = base + s * slope` gives `[[1, 1, s, 1 - s], [1, s, s, 1 - s]]`, then
        `counters = counters * rows[0] + rows[1]`.
        """
        base, slope = _count_constants(self.counters.device)
        rows = torch.addcmul(base, found_inf, slope)
        torch.addcmul(rows[1], self.counters, rows[0], out=self.counters)

    def packed(self) -> torch.Tensor:
        """`[scale, growth_tracker, hysteresis_tracker, *counters]` as one float64 tensor.

        One host read then gets everything (`read`, and the step reports).
        """
        return torch.cat(
            (
                self.scale.double().reshape(1),
                self.growth_tracker.double().reshape(1),
                self.hysteresis_tracker.double().reshape(1),
                self.counters,
            )
        )

    def read(self, policy: ScalePolicy) -> ScalerState:
        """The state as host values: one host read (a synchronisation on an accelerator)."""
        scale, counters = unpack(self.packed().tolist())
        return ScalerState(policy=policy, scale=scale, counters=counters)


def unpack(values: list[float]) -> tuple[ScaleState, Counters]:
    """The host values of `DeviceState.packed()`."""
    scale, growth, hysteresis, steps, skipped, consecutive, since = values
    counters = Counters(
        steps=int(steps),
        skipped_steps=int(skipped),
        consecutive_skips=int(consecutive),
        last_overflow_step=int(steps - since) if skipped else 0,
    )
    scale_state = ScaleState(
        scale=scale, growth_tracker=int(growth), hysteresis_tracker=int(hysteresis)
    )
    return scale_state, counters


@functools.cache
def _count_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The constant rows of `DeviceState.count_step_`, made once per device."""
    base = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1]], dtype=torch.float64, device=device)
    slope = torch.tensor([[0, 0, 1, -1], [0, 1, 1, -1]], dtype=torch.float64, device=device)
    return base, slope
