"""Constructor arguments (the rule, then the value; extras keyword-only) and a disabled scaler
(a no-op, as torch's is)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardscale import ShardedGradScaler, ShardScaleWarning
from tests.setups import mlp


def test_disabled_is_a_no_op() -> None:
    scaler = ShardedGradScaler(enabled=False)
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 16)).sum().backward()
    before = model[0].weight.detach().clone()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(before, model[0].weight)
    assert (scaler.get_scale(), scaler.state_dict(), scaler.is_enabled()) == (1.0, {}, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_named_without_cuda_warns_and_disables_like_torch() -> None:
    with pytest.warns(ShardScaleWarning, match=r"CUDA is not available. Disabling"):
        scaler = ShardedGradScaler("cuda")
    assert not scaler.is_enabled()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"enabled": 1}, TypeError, r"enabled must be a bool, got int"),
        ({"device": 0}, TypeError, r"device must be a str, a torch.device or None, got int"),
        ({"device": "gpu"}, ValueError, r"device must name a torch device type, got 'gpu'"),
        (
            {"process_group": "world"},
            TypeError,
            r"process_group must be a torch.distributed.ProcessGroup",
        ),
        ({"init_scale": -1.0}, ValueError, r"init_scale must be in \[min_scale, max_scale\]"),
        (
            {"growth_factor": 0.5},
            ValueError,
            r"growth_factor must be a finite number > 1.0, got 0.5",
        ),
        ({"hysteresis": 0}, ValueError, r"hysteresis must be >= 1, got 0"),
        ({"max_scale": 1e-9}, ValueError, r"max_scale must be >= min_scale"),
    ],
)
def test_constructor_bad_argument_raises_rule_and_value(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ShardedGradScaler(**kwargs)


def test_constructor_extras_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ShardedGradScaler("cpu", 2.0**16)  # type: ignore[misc]
