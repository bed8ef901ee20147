"""What the pages say about the repository, torch and the frameworks, checked where a test can.

A second reading of the pages found sentences that were true once, or never (issue 70): a
framework said to have a demo that has none, numpy said to be needed on more than one rank where
one rank with a process group needs it, an error said to name what it does not, the fit's figures
from before its margin. Each such sentence a test can hold is checked here against what it
describes: the repository's files, torch run without a package, the error the code raises, the
figures a test pins or a table on the same page records. (Facts that live on PyPI, which the
suite does not reach, were checked by hand; the commits that wrote them say how.)
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _text(page: str) -> str:
    """The page with its line breaks and indents as single spaces, as a reader reads it."""
    return " ".join((ROOT / page).read_text().split())


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_index_says_which_frameworks_have_a_demo_as_launch_demos_holds() -> None:
    """docs/index.md's Frameworks section: every framework of its table is named as having a
    demo in launch/demos/ or as having none, and the folder agrees."""
    index = (ROOT / "docs" / "index.md").read_text()
    said = re.search(
        r"([^.;]+) each have a demo in `launch/demos/`; ([^.;(]+) have none",
        " ".join(index.split()),
    )
    assert said, "docs/index.md no longer says which frameworks have a demo"
    with_demo, without = (re.split(r", | and ", names.strip()) for names in said.groups())
    section = index.split("## Frameworks", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([A-Za-z-]+)", section, flags=re.MULTILINE)
    tabled = {row for row in rows if row != "framework"}
    assert tabled == {*with_demo, *without}, (tabled, with_demo, without)
    demos = [path.name for path in (ROOT / "launch" / "demos").glob("*.py")]

    def has_demo(framework: str) -> bool:
        prefix = framework.lower().split("-")[0] + "_"  # DeepSpeed: deepspeed_paths.py
        return any(name.startswith(prefix) for name in demos)

    assert [f for f in with_demo if not has_demo(f)] == []
    assert [f for f in without if has_demo(f)] == []


_DCP_WITHOUT_NUMPY = """
import sys, tempfile, warnings
sys.modules["numpy"] = None  # as where numpy is not installed: torch starts without it
warnings.simplefilter("ignore")
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
if {group}:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
state = {{"w": torch.ones(3), "n": 5}}
path = tempfile.mkdtemp()
try:
    dcp.save(state, checkpoint_id=path)
    dcp.load(state, checkpoint_id=path)
    print("saved and loaded")
except Exception as error:
    print(f"{{type(error).__name__}}: {{error}}")
"""


def test_dcp_needs_numpy_once_a_process_group_exists_one_rank_included() -> None:
    """docs/checkpoints.md: without a process group DCP saves and loads without numpy; with a
    group of one rank its object collectives need it, and say so."""
    alone = _python(_DCP_WITHOUT_NUMPY.format(group=False))
    grouped = _python(_DCP_WITHOUT_NUMPY.format(group=True))
    assert alone.stdout.strip() == "saved and loaded", alone.stdout + alone.stderr
    assert grouped.stdout.strip() == "RuntimeError: Numpy is not available", (
        grouped.stdout + grouped.stderr
    )
    page = _text("docs/checkpoints.md")
    assert "DCP needs numpy once a process group exists, one rank included" in page
    assert "`RuntimeError: Numpy is not available`" in page
    assert "Without a process group it runs without numpy" in page
    assert "needs numpy once a process group exists, one rank included" in _text("docs/training.md")


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan")
def test_torchtitan_page_names_what_fp16_names_on_a_torch_without_set_timeout() -> None:
    """docs/torchtitan.md says which of the two things torch 2.13 lacks `fp16()` names; its
    error is raised here on a torch without `set_timeout` (as 2.13 is; removed on a newer one)."""
    raised = _python(
        "import torch.distributed as dist\n"
        "if hasattr(dist, 'set_timeout'):\n"
        "    del dist.set_timeout\n"
        "from shardscale.integrations.torchtitan import fp16\n"
        "try:\n"
        "    fp16(None)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    error = raised.stdout
    assert "set_timeout" in error, raised.stdout + raised.stderr
    named = re.findall(r"fp16\(\)`? raises, naming `([^`]+)`", _text("docs/torchtitan.md"))
    assert len(named) == 2, named  # the example's comment and the Versions section
    candidates = ("torch.distributed.set_timeout", "arg_mbs")
    assert {c for c in candidates if c in error} == {c for c in candidates if c in named}, (
        error,
        named,
    )


def test_scale_policies_page_states_the_fits_ends_the_fit_tests_pin() -> None:
    """docs/scale-policies.md's measured ends of the fit on the gain model are tests/test_fit.py's:
    FIT_MARGIN below the largest safe scale, one process and FSDP2, no skip."""
    from shardscale._policy import FIT_MARGIN, FIT_WINDOW
    from tests.test_fit import SAFE_EXPONENT

    one, eight = (SAFE_EXPONENT[micro] - FIT_MARGIN for micro in (1, 8))
    bits = {1: "one bit"}[FIT_MARGIN]
    page = _text("docs/scale-policies.md")
    for claim in (
        f"the gain model above ends at 2^{one} with no skip, for one backward a step, and at "
        f"2^{eight} for 8 accumulated micro-batches, each {bits} below the largest scale at which "
        f"every backward stays finite (2^{SAFE_EXPONENT[1]} and 2^{SAFE_EXPONENT[8]}: the fit's "
        f"starting margin of {bits})",
        f"under FSDP2 on 2 gloo ranks, at 2^{one} too, with no skip, from step {FIT_WINDOW + 1} "
        f"on (its first iteration reads the sharded `.grad`, which puts it at 2^12 until that "
        f"reading leaves the fit's {FIT_WINDOW}-step window)",
    ):
        assert claim in page, f"docs/scale-policies.md no longer says {claim!r}"


def _gpt_rows() -> dict[str, tuple[str, float, str]]:
    """docs/scale-policies.md's GPT table: policy -> (final scale, the largest fraction of an
    activation gradient below 2^-14 over the seeds, and its module)."""
    rows = {}
    for line in (ROOT / "docs" / "scale-policies.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[3].startswith("2^"):
            seeds = re.findall(r"([\w.]+) ([\d.]+)%", cells[6])
            module, worst = max(seeds, key=lambda seed: float(seed[1]))
            rows[cells[0]] = (cells[3], float(worst), module)
    return rows


def test_per_block_note_and_observability_quote_the_gpt_tables_figures() -> None:
    """Where docs/scale-policies.md's per-block note and docs/observability.md speak of the GPT
    job's activation gradients at the fit's and the interval rule's scales, they quote the
    table the rig measured (they once quoted the fit before its margin)."""
    rows = _gpt_rows()
    fit_scale, fit_worst, fit_module = rows['shardscale, scale_policy="fit"']
    interval_scale, interval_worst, interval_module = rows["shardscale (interval)"]
    assert fit_worst < 1.0  # "no module loses 1%"
    note = _text("docs/scale-policies.md")
    assert (
        f"At the scale the fit ends at now ({fit_scale}, the table above), no module loses 1% "
        f"(at most {fit_worst:.2f}%, `{fit_module}`), nor at the interval rule's {interval_scale} "
        f"(at most {interval_worst:.2f}%, `{interval_module}`)"
    ) in note
    observability = _text("docs/observability.md")
    assert f"by step 300 up to {interval_worst:.2f}% of its logits' (`head`)" in observability
    assert interval_module == "head"  # the logits'
    assert f"the fit's {fit_scale} at most {fit_worst:.2f}% of any module's" in observability
