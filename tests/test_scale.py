"""`scale()`: outputs of every shape scaled as torch scales them, on the loss's device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardscale import ShardedGradScaler


def test_scale_nested_lists_and_tuples_keep_structure_and_torchs_dtypes() -> None:
    """The structure kept; each output's dtype what torch's scaler gives (a 0-dim half loss
    times the float32 scale promotes to float32; a dimensioned one stays half)."""
    outputs = [
        torch.tensor(1.5, dtype=torch.float16),
        (torch.tensor([2.0], dtype=torch.bfloat16), [torch.tensor(3.0)]),
    ]
    scaled = ShardedGradScaler(init_scale=4.0).scale(outputs)
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0).scale(outputs)
    assert isinstance(scaled, list)
    assert isinstance(scaled[1], tuple)
    assert scaled[0].dtype == theirs[0].dtype == torch.float32
    assert scaled[0].item() == 6.0
    assert scaled[1][0].dtype == theirs[1][0].dtype == torch.bfloat16
    assert scaled[1][1][0].item() == 12.0


def test_scale_other_iterables_are_scaled_lazily() -> None:
    scaler = ShardedGradScaler(init_scale=2.0)
    scaled = scaler.scale(t for t in [torch.tensor(1.0), torch.tensor(2.0)])
    assert [t.item() for t in scaled] == [2.0, 4.0]


@pytest.mark.parametrize(
    ("outputs", "error", "match"),
    [
        (
            "loss",
            TypeError,
            r"scale\(\) takes a Tensor or a \(nested\) list/tuple of Tensors, got str",
        ),
        ({"loss": torch.tensor(1.0)}, TypeError, r"got dict"),
        (3.0, TypeError, r"got float"),
        ([torch.tensor(1.0), None], TypeError, r"got NoneType"),
        (torch.tensor(3), TypeError, r"floating-point tensors, got dtype torch.int64"),
    ],
)
def test_scale_bad_output_raises(outputs: Any, error: type[Exception], match: str) -> None:
    scaler = ShardedGradScaler()
    with pytest.raises(error, match=match):
        scaler.scale(outputs)
    assert scaler.get_scale() == 2.0**16


def test_scale_tensor_on_other_device_than_named_raises() -> None:
    scaler = ShardedGradScaler("meta")
    with pytest.raises(ValueError, match=r"got a tensor on cpu, but this scaler was built with"):
        scaler.scale(torch.tensor(1.0))


def test_scale_device_unset_follows_the_loss() -> None:
    scaler = ShardedGradScaler()
    scaler.scale(torch.tensor(1.0, device="meta"))
    assert scaler._get_scale_async() is not None
    assert scaler._get_scale_async().device.type == "meta"
