"""The `shardscale` command: `shardscale inspect CKPT_DIR`.

Reads a `torch.distributed.checkpoint` folder on one process, without a process group and
without loading the weights: only the scaler's entries and the optimizer's `step` counters.
It prints the scaler state and checks that every parameter's optimizer step counter agrees
(they must: a rank that stepped while another skipped leaves them apart). Exit status: 0 when
consistent, 1 when the counters disagree, 2 when the folder is not a readable checkpoint.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from shardscale._checkpoint import OUR_KEYS_BY_VERSION, TORCH_KEYS

# every key any format version has (the newest's: each version adds to the last): read whichever
# the checkpoint holds
_KEYS = (*TORCH_KEYS, *OUR_KEYS_BY_VERSION[max(OUR_KEYS_BY_VERSION)])

__all__ = ["inspect_checkpoint", "main"]

_STEP_COUNTER = re.compile(r"^(?P<optimizer>.+)\.state\.(?P<param>.+)\.step$")


class CheckpointUnreadable(RuntimeError):
    """The folder is not a checkpoint this command can read."""


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """The scaler states and optimizer step counters stored in the checkpoint at `path`.

    `path` may also be a folder of checkpoints (`step_NNNNNN/`, as `launch/job/train.py`
    writes them): the newest complete one is read.

    Returns:
        `{"scalers": {prefix: state}, "step_counters": {optimizer: {param: step}}}`.

    Raises:
        CheckpointUnreadable: `path` holds no readable DCP checkpoint.
    """
    if not (path / ".metadata").is_file() and path.is_dir():  # a folder of them: the newest
        path = max((p for p in path.iterdir() if (p / ".metadata").is_file()), default=path)
    if not (path / ".metadata").is_file():
        raise CheckpointUnreadable(f"{path} is not a checkpoint: {path / '.metadata'} is missing")
    try:
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:
        raise CheckpointUnreadable(f"cannot read {path / '.metadata'}: {error}") from error
    prefixes = sorted(
        {name.rsplit(".", 1)[0] for name in metadata if name.endswith(".scale")}
        & {name.rsplit(".", 1)[0] for name in metadata if name.endswith("._growth_tracker")}
    )
    scaler_keys = [f"{p}.{k}" for p in prefixes for k in _KEYS if f"{p}.{k}" in metadata]
    matches = [m for m in map(_STEP_COUNTER.match, metadata) if m is not None]
    try:  # load only these keys (None: a pickled object, which DCP puts in place)
        values: dict[str, Any] = dict.fromkeys(scaler_keys + [m.string for m in matches])
        for key in values:
            entry = metadata[key]
            if isinstance(entry, TensorStorageMetadata):
                values[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
            dcp_load(values, storage_reader=FileSystemReader(path), no_dist=True)
    except Exception as error:
        raise CheckpointUnreadable(f"cannot load from {path}: {error}") from error
    scalers = {
        prefix: {k: values[f"{prefix}.{k}"] for k in _KEYS if f"{prefix}.{k}" in values}
        for prefix in prefixes
    }
    counters: dict[str, dict[str, float]] = defaultdict(dict)
    for match in matches:
        counters[match["optimizer"]][match["param"]] = float(values[match.string])
    return {"path": path, "scalers": scalers, "step_counters": dict(counters)}


def _scaler_agreement(state: dict[str, Any], optimizer_steps: float) -> str:
    """How the scaler's counters relate to the optimizer steps taken (information only)."""
    if "steps" not in state:
        return "    scaler: a torch scaler's state, without step counters"
    steps, skipped = state["steps"], state["skipped_steps"]
    taken = steps - skipped
    verdict = "consistent" if taken == optimizer_steps else "differs (scaler replaced mid-run?)"
    return f"    scaler: {steps} steps - {skipped} skipped = {taken}: {verdict}"


def _report(found: dict[str, Any]) -> int:
    print(f"checkpoint {found['path']}")
    if not found["scalers"]:
        print("  no scaler state found")
    for prefix, state in found["scalers"].items():
        print(f"  scaler '{prefix}':")
        width = max(len(k) for k in state)
        for key, value in state.items():
            print(f"    {key:<{width}}  {value}")
    status = 0
    for optimizer, steps in found["step_counters"].items():
        distinct = sorted(set(steps.values()))
        if len(distinct) == 1:
            print(
                f"  optimizer '{optimizer}': {len(steps)} step counters, all {distinct[0]:g}: agree"
            )
            for state in found["scalers"].values():
                print(_scaler_agreement(state, distinct[0]))
            continue
        status = 1
        by_value: dict[float, list[str]] = defaultdict(list)
        for param, step in steps.items():
            by_value[step].append(param)
        detail = "; ".join(
            f"{value:g}: {', '.join(params[:3])}{' ...' if len(params) > 3 else ''} ({len(params)})"
            for value, params in sorted(by_value.items())
        )
        print(
            f"error: optimizer '{optimizer}' step counters disagree ({detail}): some shards "
            "took steps that others skipped",
            file=sys.stderr,
        )
    if not found["step_counters"]:
        print("  no optimizer step counters found")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardscale", description=__doc__.split("\n\n")[0])
    inspect = parser.add_subparsers(dest="command", required=True).add_parser(
        "inspect", help="print the scaler state in a DCP checkpoint and check its step counters"
    )
    inspect.add_argument(
        "checkpoint", type=Path, help="a DCP checkpoint folder, or a folder of step_NNNNNN/ ones"
    )
    args = parser.parse_args(argv)
    try:
        found = inspect_checkpoint(args.checkpoint)
    except CheckpointUnreadable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return _report(found)


if __name__ == "__main__":
    sys.exit(main())
