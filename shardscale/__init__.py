"""shardscale: a sharded gradient scaler whose ranks always agree, at one collective per step."""

import importlib.metadata as _metadata

from shardscale._dcp import load_whole
from shardscale._errors import (
    ShardScaleCheckpointError,
    ShardScaleDistributedError,
    ShardScaleMismatchError,
    ShardScaleNonFiniteError,
    ShardScaleSkipError,
    ShardScaleWarning,
)
from shardscale._locate import (
    ActivationWatch,
    NonFiniteGrad,
    UnderflowingActivation,
    UnderflowingGrad,
    find_nonfinite_grads,
    find_underflowing_grads,
    watch_activations,
)
from shardscale._policy import ScalePolicy, ScaleState
from shardscale._profiling import count_collectives
from shardscale._report import ScalerStats
from shardscale.async_scaler import AsyncShardedGradScaler
from shardscale.scaler import ShardedGradScaler

__all__ = [
    "ActivationWatch",
    "AsyncShardedGradScaler",
    "NonFiniteGrad",
    "ScalePolicy",
    "ScaleState",
    "ScalerStats",
    "ShardScaleCheckpointError",
    "ShardScaleDistributedError",
    "ShardScaleMismatchError",
    "ShardScaleNonFiniteError",
    "ShardScaleSkipError",
    "ShardScaleWarning",
    "ShardedGradScaler",
    "UnderflowingActivation",
    "UnderflowingGrad",
    "__version__",
    "count_collectives",
    "find_nonfinite_grads",
    "find_underflowing_grads",
    "load_whole",
    "watch_activations",
]

try:
    # pyproject.toml's `version` is the one source; the installed package's metadata carries it.
    __version__ = _metadata.version("shardscale")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
