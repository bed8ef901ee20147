"""The scale state as tensors on the device, where every step updates it without a host sync.

Invariant: between two `update()` calls the tensors hold exactly what the checkpoint format
(`_checkpoint.ScalerState`) would read back; one host read (`packed`) gets all of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from shardscale._checkpoint import Counters, ScalerState, to_state_dict
from shardscale._errors import no_scale_message
from shardscale._policy import ScalePolicy, ScaleState

__all__ = ["DeviceState", "ScaleHome", "state_fields", "unpack"]


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


class ScaleHome:
    """Where this rank's scale state lives, and the one answer to "does this rank hold a scale?".

    The state stays on the host (`host`) until `scale()` puts it where the loss is
    ([`at_loss()`][at_loss]): this rank scaled. A rank that never scales (a pipeline stage before
    the last) gets it where its gradients are when it first steps
    ([`for_gradients()`][for_gradients]), *unconfirmed*: it checks its gradients but modifies
    nothing until the group's first agreement shows that some rank scaled
    ([`confirm()`][confirm]). The scaler, its mixins and its stepper all ask this object.
    """

    def __init__(self, host: ScalerState) -> None:
        self.host = host
        """The state on the host: all of it before a device holds it; after, its policy and
        the values the state started from (torch's `_init_scale`)."""
        self.device: DeviceState | None = None
        """The state on its device, once a loss or a step put it there."""
        self.scaled_here = False
        """Whether this rank called `scale()`."""
        self.unconfirmed = False
        """The state was put here by a step, not by `scale()`, and no agreement has yet
        confirmed that some rank scales."""

    def at(self, device: torch.device) -> DeviceState:
        """The state on `device`, put there now if no device holds it yet."""
        if self.device is None:
            self.device = DeviceState.create(self.host, device)
        return self.device

    def at_loss(self, device: torch.device) -> DeviceState:
        """The state for a loss on `device`: the scale lives where the first loss does."""
        self.scaled_here = True
        return self.at(device)

    def for_gradients(self, device: torch.device) -> DeviceState:
        """The state for a rank that steps without having scaled: where its gradients are,
        unconfirmed until the group agrees that some rank scaled."""
        if self.device is None:
            self.unconfirmed = True
        return self.at(device)

    def confirm(self) -> None:
        """The group agreed that some rank scaled: this rank may now modify its gradients."""
        self.unconfirmed = False

    def require(self, funcname: str) -> DeviceState:
        """The state on its device; torch's error if no `scale()` (or step) put it there.

        Raises:
            RuntimeError: no state on a device yet, in torch's words.
        """
        if self.device is None:
            raise RuntimeError(no_scale_message(funcname))
        return self.device

    def load(self, state: ScalerState) -> None:
        """Take `state` (a loaded state dict), on the host and, if one holds it, the device."""
        self.host = state
        if self.device is not None:
            self.device.write(state)


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


_DEVICE_FIELDS = (
    "scale",
    "_growth_tracker",
    "_hysteresis_tracker",
    "steps",
    "skipped_steps",
    "consecutive_skips",
    "last_overflow_step",
)
"""The state-dict fields a `DeviceState` holds, in the order `state_fields` builds them."""


def state_fields(
    state: ScalerState | DeviceState, policy: ScalePolicy
) -> tuple[list[str], torch.Tensor]:
    """The scaler state's fields for `verify_agreement` (`Exchange.compare`): names as in the
    state dict, and their values as one float64 tensor where the state lives.

    A `DeviceState` is never read on the host: its fields are computed on its device (the
    policy's settings join as a constant made there once), so `verify_agreement` pays one host
    transfer in all, the comparison's.
    """
    if isinstance(state, ScalerState):
        host = to_state_dict(state)
        return list(host), torch.tensor([float(v) for v in host.values()], dtype=torch.float64)
    settings = to_state_dict(
        ScalerState(
            policy=policy,
            scale=ScaleState(scale=1.0, growth_tracker=0, hysteresis_tracker=0),
            counters=Counters(),
        )
    )
    names = tuple(settings)
    packed = state.packed()  # [scale, growth, hysteresis, steps, skipped, consecutive, since]
    steps, skipped, since = packed[3], packed[4], packed[6]
    last_overflow = torch.where(skipped > 0, steps - since, torch.zeros_like(steps))
    constants, order = _settings_on(
        packed.device, names, tuple(float(settings[n]) for n in names if n not in _DEVICE_FIELDS)
    )
    return list(names), torch.cat((packed[:6], last_overflow.reshape(1), constants))[order]


@functools.cache
def _settings_on(
    device: torch.device, names: tuple[str, ...], settings: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's settings as a tensor on `device`, and the index that puts the device
    fields and the settings into `names`' order: made once per device and policy."""
    built = [*_DEVICE_FIELDS, *(n for n in names if n not in _DEVICE_FIELDS)]
    order = [built.index(n) for n in names]
    return (
        torch.tensor(settings, dtype=torch.float64, device=device),
        torch.tensor(order, dtype=torch.int64, device=device),
    )
