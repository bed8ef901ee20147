"""shardscale: a sharded gradient scaler whose ranks always agree, at one collective per step."""

from shardscale._errors import ShardScaleDistributedError, ShardScaleWarning
from shardscale._policy import ScalePolicy, ScaleState
from shardscale._profiling import count_collectives
from shardscale.scaler import ShardedGradScaler

__all__ = [
    "ScalePolicy",
    "ScaleState",
    "ShardScaleDistributedError",
    "ShardScaleWarning",
    "ShardedGradScaler",
    "__version__",
    "count_collectives",
]

__version__ = "0.1.0"
