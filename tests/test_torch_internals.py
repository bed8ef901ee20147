"""torch's private names, one test each (shardscale/_torch.py): each fails on the first torch
release where the name is gone or means something else."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.utils.parametrizations import weight_norm

from shardscale import ShardedGradScaler, _torch
from shardscale._torch import (
    check_and_unscale_,
    dtensor_spec,
    flat_param_sizes,
    flat_param_slices,
    foreach_mul_,
    foreach_norm,
    group_by_device_and_dtype,
    group_device_types,
    in_pipeline_shape_inference,
    is_flat_param,
    is_fsdp_flattened,
    local_tensor,
    no_torch_function_subclass,
    sparse_values,
    update_scale_,
)

TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def test_this_torch_is_a_checked_release() -> None:
    """A torch outside CHECKED_ON runs, but nobody checked these names on it: say so here."""
    assert torch.__version__.split("+")[0] in _torch.CHECKED_ON


def test_dtensor_local_tensor_and_spec(world_of_one: dist.ProcessGroup) -> None:
    mesh = init_device_mesh("cpu", (1,))
    local = torch.arange(4.0)
    dtensor = DTensor.from_local(local, mesh, [Shard(0)])
    assert local_tensor(dtensor).data_ptr() == dtensor.to_local().data_ptr()
    assert torch.equal(local_tensor(dtensor), local)
    assert dtensor_spec(dtensor).placements == (Shard(0),)
    assert dtensor_spec(DTensor.from_local(local, mesh, [Replicate()])).placements == (Replicate(),)


def test_sparse_values_keep_duplicates() -> None:
    sparse = torch.sparse_coo_tensor([[1, 1, 3]], [1.0, 2.0, 4.0], (5,))
    assert not sparse.is_coalesced()
    assert sparse_values(sparse).tolist() == [1.0, 2.0, 4.0]  # values() refuses this one
    assert sparse_values(sparse.coalesce()).tolist() == [3.0, 4.0]


def test_group_by_device_and_dtype() -> None:
    tensors = [torch.ones(2), torch.ones(3, dtype=torch.float16), torch.ones(4)]
    grouped = group_by_device_and_dtype([tensors], with_indices=True)
    (f32_lists, f32_indices) = grouped[(torch.device("cpu"), torch.float32)]
    assert f32_lists[0][1] is tensors[2]
    assert list(f32_indices) == [0, 2]
    assert list(grouped[(torch.device("cpu"), torch.float16)][1]) == [1]


def test_no_torch_function_subclass() -> None:
    assert torch._C._is_torch_function_enabled()
    with no_torch_function_subclass():
        assert not torch._C._is_torch_function_enabled()
    assert torch._C._is_torch_function_enabled()


def test_amp_kernels_check_unscale_update_and_norm() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([math.inf])]
    found = torch.zeros(())
    check_and_unscale_(grads[:1], found, torch.tensor(0.5))
    assert grads[0].tolist() == [1.0, 2.0]
    assert found.item() == 0.0
    check_and_unscale_(grads, found, torch.tensor(1.0))
    assert found.item() == 1.0
    scale, growth = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32)
    update_scale_(scale, growth, found, 2.0, 0.5, 2000)
    assert scale.item() == 4.0
    norms = foreach_norm([torch.tensor([3.0, 4.0])], 2.0, dtype=torch.float64)
    assert norms[0].dtype == torch.float64
    assert norms[0].item() == 5.0
    halves = [torch.tensor([2.0, 4.0], dtype=torch.float16)]
    foreach_mul_(halves, torch.tensor(0.25))  # a 0-dim float32 factor on fp16: in float32
    assert halves[0].tolist() == [0.5, 1.0]


def test_group_device_types(world_of_one: dist.ProcessGroup) -> None:
    types = group_device_types(world_of_one)
    assert "cpu" in types  # gloo lists cuda too, where torch was built with it
    assert set(types) <= {"cpu", "cuda"}


def test_fsdp1_flat_parameter(world_of_one: dist.ProcessGroup) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def wrapped(use_orig_params: bool) -> nn.Module:
        module = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
        return FSDP(module, device_id=torch.device("cpu"), use_orig_params=use_orig_params)

    (flat_param,) = wrapped(use_orig_params=False).parameters()
    assert is_flat_param(flat_param)
    assert is_fsdp_flattened(flat_param)
    assert flat_param_sizes(flat_param) == (11, 11)  # 3*2 + 2 + 2*1 + 1; one rank, no padding
    assert flat_param_slices(flat_param) == [
        ("0.weight", 0, 6),
        ("0.bias", 6, 2),
        ("1.weight", 8, 2),
        ("1.bias", 10, 1),
    ]
    originals = list(wrapped(use_orig_params=True).parameters())
    assert len(originals) == 4
    assert all(is_fsdp_flattened(p) and not is_flat_param(p) for p in originals)
    assert not is_fsdp_flattened(nn.Parameter(torch.ones(1)))


def _backward_metadata_inference(scaler: ShardedGradScaler, loss: torch.Tensor) -> torch.Tensor:
    """Named as torch's pipeline schedule method that calls the loss on placeholder tensors."""
    return scaler.scale(loss)


@pytest.mark.skipif(TORCH < (2, 12), reason="torch 2.11's schedules do not infer shapes so")
def test_pipeline_shape_inference_is_where_torch_calls_the_loss_on_placeholders() -> None:
    from torch.distributed.pipelining.stage import PipelineStage

    assert callable(PipelineStage._backward_metadata_inference)


def test_a_loss_on_placeholders_is_not_a_forward_overflow() -> None:
    import torch.distributed.pipelining  # the walk runs only where it is imported

    assert "torch.distributed.pipelining" in sys.modules
    assert not in_pipeline_shape_inference()
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = ShardedGradScaler(init_scale=4.0)
    _backward_metadata_inference(scaler, torch.tensor(math.inf))  # placeholders: ignored
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert not scaler.last_step_skipped
    assert scaler.stats.forward_overflows == 0


def test_fsdp1_unsharded_flat_parameter_clips(world_of_one: dist.ProcessGroup) -> None:
    """A flat parameter FSDP1 never shards (`NO_SHARD`, any strategy at world size 1) has no
    padded sizes: its norm counts it whole (it raised AttributeError before)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Linear(3, 2), device_id=torch.device("cpu"))
    scaler = ShardedGradScaler(init_scale=8.0)
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    expected = torch.linalg.vector_norm(next(model.parameters()).grad / 8.0).item()  # type: ignore[operator]
    assert scaler.clip_grad_norm_(model.parameters(), 1e9).item() == pytest.approx(expected)


def _node_names(root: Any) -> set[str]:
    names, stack, seen = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(child for child, _ in node.next_functions)
    return names


def test_the_node_names_the_fit_s_reader_relies_on(world_of_one: dist.ProcessGroup) -> None:
    """shardscale/_bins.py tells where a gradient formed by autograd nodes' names: autocast's
    cast, and the nodes that hand a gradient on unchanged (views, module hooks, DTensor's
    to_local/from_local, weight_norm's reparametrization). Built here on this torch: a renamed
    node fails this test, not a run that quietly reads too little (a node of torch's own whose
    name the reader does not know is taken for an fp32 op, its leaves not read)."""
    from shardscale._bins import _CAST, _THROUGH

    mesh = init_device_mesh("cpu", (1,))
    linear = nn.Linear(4, 4)
    linear.register_full_backward_hook(lambda *args: None)
    weight = DTensor.from_local(torch.ones(4, 4, requires_grad=True), mesh, [Replicate()])
    with torch.autocast("cpu", dtype=torch.float16):
        out = linear(torch.ones(2, 4, requires_grad=True)).view(8).t()
        out = out.sum() + (weight.to_local() @ torch.ones(4)).sum()
    names = _node_names(out.grad_fn)
    assert _CAST in names
    assert {"ViewBackward0", "BackwardHookFunctionBackward", "_ToTorchTensorBackward"} <= names
    assert "_FromTorchTensorBackward" in _node_names(weight.grad_fn)
    normed = weight_norm(nn.Linear(4, 4))
    with torch.autocast("cpu", dtype=torch.float16):
        reparametrized = _node_names(normed(torch.ones(2, 4)).sum().grad_fn)
    assert "WeightNormInterfaceBackward0" in reparametrized
    for through in (
        "ViewBackward0",
        "BackwardHookFunctionBackward",
        "_ToTorchTensorBackward",
        "WeightNormInterfaceBackward0",
    ):
        assert _THROUGH.fullmatch(through), through
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state
    from torch.nn.parallel import distributed

    # FSDP2's pre-backward marker is newer than torch 2.11 (which has none to look through)
    pre_backward = getattr(_fsdp_state, "RegisterPreBackwardFunction", None)
    for marker in (
        distributed._DDPSink,
        _fsdp_param_group.RegisterPostBackwardFunction,
        *([pre_backward] if pre_backward is not None else []),
    ):
        assert _THROUGH.fullmatch(f"{marker.__name__}Backward"), marker
