"""torch's private names that shardscale relies on, each behind one name here, and nowhere else.

torch may rename any of them in a release without notice. Each was checked on the releases in
`CHECKED_ON`, and tests/test_torch_internals.py fails on the first torch where one is gone or
means something else. The hot ones (read per gradient per step) are C-level getters or torch's
own callables under our name, so reading them costs what the attribute did.
"""

from __future__ import annotations

import operator
import sys
from types import FrameType

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

# The torch releases every name below was checked on (the suite, whole, on each).
CHECKED_ON = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")

# A DTensor's local shard: what `to_local()` returns, without its autograd function.
local_tensor = operator.attrgetter("_local_tensor")
# A DTensor's sharding spec: FSDP2 hands each step's gradient its parameter's one spec object.
dtensor_spec = operator.attrgetter("_spec")
# A sparse COO tensor's values, duplicates included (`values()` refuses uncoalesced ones).
sparse_values = operator.methodcaller("_values")
# torch's grouping for its foreach kernels: `{(device, dtype): (tensors, indices)}`.
group_by_device_and_dtype = _group_tensors_by_device_and_dtype
# A context in which a DTensor's attributes read as a plain tensor's (no `__torch_function__`).
no_torch_function_subclass = torch._C.DisableTorchFunctionSubclass
# torch's fused check and unscale: raises a flag where an element is inf/NaN, multiplies.
check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
# torch's scale update kernel: back off on a flag, grow after the interval.
update_scale_ = torch._amp_update_scale_
# One norm per tensor, in one kernel per (device, dtype) group, in a dtype asked for.
foreach_norm = torch._foreach_norm
# Every tensor times one scalar tensor, in one kernel per (device, dtype) group (the CPU's
# vectorised multiply: `Kernels.multiply_`).
foreach_mul_ = torch._foreach_mul_


def group_device_types(group: dist.ProcessGroup) -> list[str]:
    """The device types `group` can run collectives on, in its backend's order."""
    return [torch.device(t).type for t in group._device_types]


def is_flat_param(param: torch.Tensor) -> bool:
    """Whether `param` is an FSDP1 flat parameter (many original parameters in one)."""
    return bool(getattr(param, "_is_flat_param", False))


def is_fsdp_flattened(param: torch.Tensor) -> bool:
    """Whether `param` is FSDP1's: a flat parameter, or an original parameter it flattened into
    one (`use_orig_params=True` views)."""
    return bool(getattr(param, "_fsdp_flattened", False))


def flat_param_sizes(param: torch.Tensor) -> tuple[int, int]:
    """An FSDP1 flat parameter's element counts: (unsharded, padded; this rank's shard). Both
    its own where it is not sharded (`NO_SHARD`, and any strategy at world size 1)."""
    padded = getattr(param, "_padded_unsharded_size", None)
    if padded is None:
        return param.numel(), param.numel()
    return padded.numel(), param._sharded_size.numel()  # type: ignore[attr-defined]


def flat_param_slices(param: torch.Tensor) -> list[tuple[str, int, int]]:
    """`(name, offset, numel)` of each original parameter in this rank's shard of an FSDP1 flat
    parameter, its name relative to the module that holds the flat parameter."""
    infos = zip(param._fqns, param._shard_param_infos, strict=True)  # type: ignore[attr-defined]
    return [(fqn, i.offset_in_shard, i.numel_in_shard) for fqn, i in infos if i.in_shard]


def in_pipeline_shape_inference(depth: int = 64) -> bool:
    """Whether the caller's caller runs inside a pipeline schedule's backward shape inference.

    torch 2.12+ schedules (`PipelineStage._backward_metadata_inference`; none in 2.11) call the
    loss once, on their first step, on placeholder tensors (uninitialised memory) to learn the
    shapes backward sends: that loss says nothing of the data. Found by walking up at most
    `depth` frames; callers ask only where `torch.distributed.pipelining` is imported.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "_backward_metadata_inference":
            return True
        frame = frame.f_back
    return False
