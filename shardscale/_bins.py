"""The gradients' range, read beside the agreement: the fit's peak and the meter's 128 bins.

Two features read how large the gradients are, and ride the step's one collective
(`shardscale._exchange` carries what they read; here it is made and read back):

* the fit (`scale_policy="fit"`): each rank's largest |scaled gradient| ([`peak`][]). It travels
  in a slot of the ballot, one per rank where the ballot reduces by SUM (a clip's 2-norm, the
  meter's counts), so that the largest survives the reduction; the fit then takes the power of
  two just above the group's largest ([`power_above`][]);
* the underflow meter (every `underflow_every` steps, where [`counts_can_travel`][]): 128 slots,
  one per power of two, slot i for magnitudes in [2^(i+BIN_LOW-1), 2^(i+BIN_LOW)), 2^-64 to 2^64
  in all; each counts this rank's non-zero gradient elements in it ([`counted`][]), the counts add
  up over the ranks (a SUM), and [`meter_reading`][] reads off the fraction below fp16's normal
  range and the scale that would keep all but `UNDERFLOW_TARGET` of them above it.

"Underflow" has one definition, here, for the meter, `find_underflowing_grads`, the activation
watch and the example job: of the non-zero gradient elements whose scaled magnitude lies in the
bins' range [2^-64, 2^64], those below `UNDERFLOW_BELOW` (2^-14: subnormal in fp16, or flushed to
zero) ([`underflow_counts`][] counts them directly, the meter through its bins).
"""

from __future__ import annotations

import math

import torch

from shardscale._grads import GradGroups, NormGroups, move
from shardscale._torch import foreach_norm

# The bins: how many, and the power of two that bounds slot 0 from above (module docstring).
BINS, BIN_LOW = 128, -63
# fp16's smallest normal magnitude (a scaled gradient below it is subnormal in fp16, or flushed
# to zero), and the meter's target: the fraction of the non-zero elements allowed below it.
UNDERFLOW_BELOW, UNDERFLOW_TARGET = 2.0**-14, 1e-3
# The log2 range `histc` counts: slot i is [i + BIN_LOW - 1, i + BIN_LOW).
_LOG_RANGE = (BIN_LOW - 1, BIN_LOW + BINS - 1)
# The slots below UNDERFLOW_BELOW: 0 .. _BELOW - 1.
_BELOW = int(math.log2(UNDERFLOW_BELOW)) - BIN_LOW + 1
Groups = tuple[GradGroups | NormGroups, ...]
# A NaN peak, as it travels in the fit's slot: float32's largest value, which a MAX keeps (a NaN
# it may drop, by the backend's order of operands) and an inf beats (an overflow outranks a NaN).
NAN_MARK = float(torch.finfo(torch.float32).max)


def _logs(values: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """log2 of |`values`| times `scale`, float32, in a new tensor (never the gradient itself)."""
    magnitudes = values.abs().float()
    if scale is not None:
        magnitudes.mul_(
            move(scale, magnitudes.device) if isinstance(scale, torch.Tensor) else scale
        )
    return magnitudes.log2_()


def can_count(device: torch.device) -> bool:
    """Whether elements may be counted on `device` (`histc`): not on CUDA with deterministic
    algorithms on, where `histc` has no deterministic kernel and would raise."""
    return device.type != "cuda" or not torch.are_deterministic_algorithms_enabled()


def counts_can_travel(device: torch.device, norm_type: float | None) -> bool:
    """Whether the meter's counts can be made on `device` and travel with a norm of
    `norm_type` (they need a SUM: not beside an inf-norm, whose shares need a MAX)."""
    inf_norm = norm_type is not None and math.isinf(norm_type)
    return not inf_norm and can_count(device)


def underflow_counts(values: torch.Tensor, scale: float) -> torch.Tensor:
    """`[below, counted]` of `values` times `scale` (module docstring): the non-zero elements in
    the bins' range, and those of them below `UNDERFLOW_BELOW`; int64, on `values`' device."""
    logs = _logs(values, scale)
    counted = (logs >= _LOG_RANGE[0]) & (logs <= _LOG_RANGE[1])
    below = counted & (logs < math.log2(UNDERFLOW_BELOW))
    return torch.stack((below.sum(), counted.sum()))


def meter_reading(counts: torch.Tensor, scale: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The meter's reading of the group's `counts` (float64), on the device: `[step, the
    fraction of the counted elements below UNDERFLOW_BELOW at `scale`, the lowest scale, this
    one times a power of two, at which at most UNDERFLOW_TARGET of them would be]` (the scale
    NaN without a counted element)."""
    total = counts.sum()
    shares = counts.cumsum(0) / total  # at each slot: the fraction at or under it
    shift = _BELOW - (shares <= UNDERFLOW_TARGET).sum()  # slots to move up (or down)
    fitted = torch.where(total > 0, scale * torch.exp2(shift), math.nan)
    return torch.stack([step, shares[_BELOW - 1], fitted.double()])


def counted(groups: Groups, device: torch.device, scale: torch.Tensor | None) -> torch.Tensor:
    """The meter's bins of `groups` (times `scale`, for gradients unscaled already): how many
    non-zero elements fall in each slot (zeros, inf, NaN and magnitudes beyond the range in
    none), float32 on `device`. Three kernels per tensor (abs, log2, `histc`; a fourth casts
    fp16/bf16 to float32, a fifth multiplies by `scale`), a temporary of one tensor's size at a
    time, no host read."""
    bins = torch.zeros(BINS, dtype=torch.float32, device=device)
    for group in groups:
        for grads in group.values():
            for grad in grads:
                bins += move(torch.histc(_logs(grad, scale), BINS, *_LOG_RANGE), device)
    return bins


def peak(groups: Groups, device: torch.device, scale: torch.Tensor | None) -> torch.Tensor | None:
    """The fit's reading of `groups`: their largest |gradient| (times `scale`, for gradients
    unscaled already), a float32 scalar on `device` (non-finite where one is); None without a
    gradient. One read pass: a kernel per (device, dtype) group, and two more."""
    norms = []
    for group in groups:
        for grads in group.values():
            norms += [
                move(norm, device) for norm in foreach_norm(grads, math.inf, dtype=torch.float32)
            ]
    if not norms:
        return None
    largest = torch.stack(norms).amax()
    return largest if scale is None else largest * move(scale, device)


def power_above(value: torch.Tensor) -> torch.Tensor:
    """The power of two just above `value` (>= 0, finite): 2^e with `value` < 2^e; 0 for 0."""
    return torch.ldexp(torch.sign(value), torch.frexp(value).exponent)
