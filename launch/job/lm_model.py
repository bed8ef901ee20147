"""The example job's model: a small GPT-style decoder (byte-level, pre-norm, causal attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Byte-level tokens."""
    seq_len: int = 64
    """Context length."""
    d_model: int = 64
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads."""
    n_layers: int = 2
    """Decoder blocks."""


class Block(nn.Module):
    """Pre-norm attention + MLP; the unit FSDP wraps."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.norm_attention = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.norm_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm_attention(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        # A dict keyed by layer number (names as a ModuleList's): a pipeline stage drops the
        # layers it does not hold and keeps the full model's parameter names.
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.d_model)
        self.head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for block in self.blocks.values():  # GPT-2: residual projections shrink with depth
            for projection in (block.out, block.mlp[2]):
                nn.init.normal_(projection.weight, std=0.02 / (2 * config.n_layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens to logits; a pipeline stage without the embeddings or the head takes or
        returns the residual stream instead."""
        if self.token_embedding is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            assert self.norm is not None
            x = self.head(self.norm(x))
        return x

    def keep_stage(self, stage: int, stages: int) -> None:
        """Drop every layer that pipeline stage ``stage`` of ``stages`` does not hold.

        The blocks are split evenly; the first stage keeps the embeddings, the last the final
        norm and the head. Names stay the full model's, so checkpoints are keyed alike.
        """
        layers = len(self.blocks)
        if not 1 <= stages <= layers:
            raise ValueError(f"stages must be in [1, {layers}] (the layers), got {stages}")
        first, last = stage * layers // stages, (stage + 1) * layers // stages
        for name in list(self.blocks):
            if not first <= int(name) < last:
                del self.blocks[name]
        if stage > 0:
            self.token_embedding = self.position_embedding = None  # type: ignore[assignment]
        if stage < stages - 1:
            self.norm = self.head = None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy, in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
