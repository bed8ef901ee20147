"""The JSON records the framework demos (``launch/demos/``) print, one per rank and step."""

from __future__ import annotations

import json
from typing import Any


def parse_records(stdout: str) -> list[dict[str, Any]]:
    """The JSON lines the ranks printed (two ranks may print on one line)."""
    found = []
    for line in stdout.splitlines():
        for chunk in line.replace("}{", "}\n{").splitlines():
            if chunk.startswith('{"rank"'):
                found.append(json.loads(chunk))
    return found


def per_rank(found: list[dict[str, Any]], key: str) -> dict[int, list[Any]]:
    """``key`` of each step record, in step order, by rank (ranks 0 and 1)."""
    rows: dict[int, list[Any]] = {0: [], 1: []}
    for record in sorted((r for r in found if "step" in r), key=lambda r: r["step"]):
        rows[record["rank"]].append(record[key])
    return rows
