"""A `torch.distributed.checkpoint` (DCP) checkpoint loaded whole or not at all: the load of the
recipe users copy (docs/checkpoints.md).

Invariant: until every entry has been read and the scaler has taken its own, nothing the caller
holds has changed. DCP alone reads into the caller's tensors in place (a model's parameters,
its optimizer's state) and calls each Stateful's `load_state_dict` as it goes: an entry it
cannot read, garbled or cut short, raises a bare `EOFError` or `UnpicklingError`, wrapped on
several ranks in a `CheckpointException` (a `BaseException`, which `except Exception` misses),
naming neither the file nor the entry, after the model was overwritten. Here DCP reads into
copies; the scaler validates its entry whole (`load_state_dict`); only then does everything
take what was read. A failure is a `ShardScaleCheckpointError` on every rank (DCP's own load
fails on every rank together), naming the file and the entry.

The scaler asks only for the entries the checkpoint holds: a checkpoint of an older format, or
of a torch scaler, loads without `allow_partial_load` (which would let a model's missing entry
pass unnoticed).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.stateful import Stateful

from shardscale._errors import ShardScaleCheckpointError
from shardscale.scaler import ShardedGradScaler

_UNCHANGED = "nothing was loaded: what you passed is as it was"


def load_whole(
    state: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load the checkpoint folder `checkpoint_id` into `state`, whole or not at all: what
    `torch.distributed.checkpoint.load(state, checkpoint_id=...)` does, on every rank, but
    read into copies first and taken only once every entry was read and the scaler took its
    own.

    `state` is what was saved: Statefuls (the scaler; a model and optimizer behind torch's
    `get_state_dict` and `set_state_dict`, as docs/checkpoints.md shows) and plain state
    dicts, whose tensors are then loaded in place. Memory: a second copy of what `state`
    holds, while the load lasts. A Stateful's `state_dict()` is called to shape the copies, as
    DCP calls it (torch's `get_state_dict` gives an optimizer that never stepped its zero
    state then). The scaler asks only for the entries the checkpoint holds: an older
    format's, or a torch scaler's, load as
    [`load_state_dict()`][shardscale.ShardedGradScaler.load_state_dict] reads them. Every
    rank reads the checkpoint's metadata itself first, as DCP's reader does: a checkpoint every
    rank sees alike (a shared filesystem).

    Args:
        state: the dict that was saved, of the live objects to load into.
        checkpoint_id: the checkpoint's folder (`dcp.save`'s `checkpoint_id`).
        process_group: the group DCP loads with (default: the world).

    Raises:
        ShardScaleCheckpointError: the checkpoint cannot be loaded (its metadata, a file or an
            entry unreadable, cut short or missing; the scaler's entry refused), on every rank,
            naming the file and the entry; `state` is as it was.

    Example:
        ```python
        state = {"training": Training(model, optimizer), "scaler": scaler}
        dcp.save(state, checkpoint_id=path)
        ...
        load_whole(state, checkpoint_id=path)  # after a restart
        ```
    """
    path = Path(checkpoint_id)
    metadata = _metadata(path)
    staged = {key: _staged(key, value, metadata, path) for key, value in state.items()}
    try:
        dcp_load(staged, checkpoint_id=path, process_group=process_group)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        raise ShardScaleCheckpointError(_unreadable(path, metadata, staged, error)) from error
    scalers = [key for key, value in state.items() if isinstance(value, ShardedGradScaler)]
    for key in scalers:  # first: each checks its entry whole, and refuses it changing nothing
        _load_scaler(state[key], staged[key], path, key, metadata)
    for key, value in state.items():
        if key in scalers:
            continue
        if isinstance(value, Stateful):
            value.load_state_dict(staged[key])
        else:
            state[key] = _taken(value, staged[key])


def _load_scaler(
    scaler: ShardedGradScaler, loaded: dict[str, Any], path: Path, key: str, metadata: Metadata
) -> None:
    """`scaler.load_state_dict(loaded)`, its refusal named with the entry and its files."""
    try:
        scaler.load_state_dict(loaded)
    except (ValueError, TypeError, RuntimeError) as error:
        raise ShardScaleCheckpointError(
            f"checkpoint {path}: the entry {key!r} (in {_files(metadata, key + '.')}) was "
            f"refused by the scaler: {error}; {_UNCHANGED}"
        ) from error


def _metadata(path: Path) -> Metadata:
    """The checkpoint's metadata (DCP writes it last: without it the save never finished)."""
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as error:
        raise ShardScaleCheckpointError(
            f"checkpoint {path}: its metadata {path / '.metadata'} cannot be read (a save that "
            f"never finished, or not a checkpoint): {type(error).__name__}: {error}; "
            f"{_UNCHANGED}"
        ) from error


def _staged(key: str, value: Any, metadata: Metadata, path: Path) -> Any:
    """What DCP reads `state[key]` into: a copy of its state, a scaler's cut to the entries
    the checkpoint holds."""
    if isinstance(value, ShardedGradScaler):
        held = {
            k: v
            for k, v in value.state_dict().items()
            if f"{key}.{k}" in metadata.state_dict_metadata
        }
        if value.is_enabled() and not held:
            raise ShardScaleCheckpointError(
                f"checkpoint {path} holds no entry {key!r}: it was saved without a scaler under "
                f"that key; {_UNCHANGED}"
            )
        return held
    return _copy(value.state_dict() if isinstance(value, Stateful) else value)


def _copy(value: Any) -> Any:
    """`value` with every tensor in it cloned (a DTensor stays one), for DCP to read into."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _taken(held: Any, loaded: Any) -> Any:
    """`held` with what was `loaded` into its copy: tensors copied in place (a model's
    parameters behind a state dict are the model's), dicts walked, other values replaced; as
    DCP's own load leaves a plain state dict."""
    if isinstance(held, torch.Tensor) and isinstance(loaded, torch.Tensor):
        return held.copy_(loaded)
    if isinstance(held, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            held[k] = _taken(held.get(k), v)
        return held
    return loaded


def _files(metadata: Metadata, prefix: str) -> str:
    """The files holding the entries under `prefix`."""
    files = {
        info.relative_path
        for index, info in metadata.storage_data.items()
        if index.fqn.startswith(prefix)
    }
    return ", ".join(sorted(files)) or "no file"


def _unreadable(
    path: Path, metadata: Metadata, staged: dict[str, Any], error: BaseException
) -> str:
    """Why DCP could not load `staged`: a file missing or cut short, else the first entry
    that does not read alone (DCP names neither)."""
    cause = _cause(error)
    found = _short_file(path, metadata) or _bad_entry(path, metadata, list(staged))
    if found is None:
        return f"checkpoint {path} could not be loaded: {cause}; {_UNCHANGED}"
    return f"checkpoint {path}: {found} ({cause}); {_UNCHANGED}"


def _cause(error: BaseException) -> str:
    """DCP's error as `Type: message`: a `CheckpointException`'s first rank's."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return f"{type(error).__name__}: {error}".strip()


def _short_file(path: Path, metadata: Metadata) -> str | None:
    """The first entry whose bytes lie in a missing file or past a file's end, if any."""
    stored = (metadata.storage_data or {}).items()
    for index, info in sorted(stored, key=lambda item: item[1].offset):
        file = path / info.relative_path
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            return f"the entry {index.fqn!r} is in {file}, which is missing"
        if size < info.offset + info.length:
            return (
                f"the entry {index.fqn!r} in {file} is cut short: the file has {size} bytes, "
                f"the entry ends at byte {info.offset + info.length}"
            )
    return None


def _bad_entry(path: Path, metadata: Metadata, keys: list[str]) -> str | None:
    """The first of the pickled entries under `keys` that does not read, found by halves, each
    read alone on this rank (no collective: every rank reads the same files)."""
    entries = [
        name
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata) and name.split(".", 1)[0] in keys
    ]
    if _read(path, entries) is None:
        return None
    while len(entries) > 1:
        half = len(entries) // 2
        entries = entries[:half] if _read(path, entries[:half]) is not None else entries[half:]
    name = entries[0]
    file = path / next(i.relative_path for x, i in metadata.storage_data.items() if x.fqn == name)
    return f"the entry {name!r} in {file} cannot be read"


def _read(path: Path, entries: list[str]) -> BaseException | None:
    """The error reading `entries` alone (pickled values), or None."""
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
            dcp_load(dict.fromkeys(entries), storage_reader=FileSystemReader(path), no_dist=True)
    except (Exception, CheckpointException) as error:
        return error
    return None
