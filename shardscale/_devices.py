"""Moving the scaler's small tensors between devices without a race or a needless sync.

A copy to an accelerator may be asynchronous (the host's source is not reused before the stream
runs it). A copy to the CPU must not be: the host would read the tensor before it arrives.
"""

from __future__ import annotations

import torch

__all__ = ["move"]


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself if already there, else a copy, async only to a device."""
    return tensor.to(device, non_blocking=device.type != "cpu")
