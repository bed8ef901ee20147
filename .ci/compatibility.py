"""docs/compatibility.md from the test runs' own reports: which torch ran which tests, and how.

A run of ``launch/test.sh`` with ``REPORTS=DIR`` leaves two files in DIR: ``NAME.xml``, pytest's
JUnit XML report (the counts and the date), and ``NAME.json``, written by ``describe`` below
before pytest starts (the torch release and build, where it ran, the commit, the command, the
tests chosen). ``page`` turns such pairs into records, merges them into the committed ones
(``.ci/compatibility.json``) and writes the page from the records alone: nobody edits the page.

    python .ci/compatibility.py describe [--torch X] [--with W] [--typed-arg=A ...] -- PYTEST_ARGS
    python .ci/compatibility.py page --add DIR [--add DIR ...] --save   # a maintainer, then commit
    python .ci/compatibility.py page --add DIR --out PAGE               # CI: this run's page
    python .ci/compatibility.py page --check                            # the page is the records'

A new record replaces the older ones of the same torch release, build and place that ran the
same tests, and, when it ran the whole suite (no test file named), their runs of named files.
``page`` needs the standard library only; ``describe`` imports torch, in the run's interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / ".ci" / "compatibility.json"
PAGE = ROOT / "docs" / "compatibility.md"
# pytest options that take a value: the value names no test file
VALUE_OPTIONS = {"-n", "-p", "-o", "-c", "-W", "--durations", "--timeout", "--maxfail", "--dist"}


@dataclass(frozen=True, kw_only=True)
class Run:
    """One recorded run of the test suite (or of some of its files) on one torch build."""

    torch: str
    """The release, without the build's local suffix (``2.15.0``)."""
    build: str
    """Which build of it (``CUDA 13.0 build``, ``CPU build``, or where it came from)."""
    where: str
    """What it ran on (``on the CPU``, ``with 1 x NVIDIA H200``)."""
    tests: str
    """Which tests, in words (``the whole suite``, the files named, ``-m``/``-k``)."""
    whole: bool
    """No test file was named: the run replaces older runs of named files."""
    passed: int
    failed: int
    """Failures and errors together."""
    skipped: int | None
    """None where the run's record did not say."""
    date: str
    """When it ran, ``YYYY-MM-DDTHH:MM:SS`` (the page shows the day)."""
    commit: str
    command: str
    note: str = ""
    """Anything the row must add (``CI``, ``uncommitted changes``)."""

    def same_place(self, other: Run) -> bool:
        """The same release, kind of build (CUDA or CPU: the suite runs on the CPU either way)
        and machine."""
        kind = "CUDA" in self.build, "CUDA" in other.build
        return (self.torch, self.where) == (other.torch, other.where) and kind[0] == kind[1]

    def replaces(self, older: Run) -> bool:
        """Whether this run makes ``older`` one to drop: the same place, the same tests (or this
        one the whole suite and that one named files), and not newer."""
        same_tests = self.tests == older.tests or (self.whole and not older.whole)
        return self.same_place(older) and same_tests and older.date <= self.date


# ------------------------------------------------------------------ describe (in the run)


def tests_chosen(pytest_args: list[str]) -> tuple[str, bool]:
    """The tests ``pytest_args`` choose, in words, and whether that is the whole suite (no test
    file named); options that choose nothing (``-n 2``, ``--durations=25``) are left out."""
    files, selectors, args = [], [], iter(pytest_args)
    for arg in args:
        if arg in ("-m", "-k"):
            selectors.append(f"{arg} {shlex.quote(next(args, ''))}")
        elif arg.startswith(("-m=", "-k=")):
            selectors.append(f"{arg[:2]} {shlex.quote(arg[3:])}")
        elif arg in VALUE_OPTIONS:
            next(args, None)
        elif arg.rstrip("/") != "tests" and not arg.startswith("-"):
            files.append(arg)
    chosen = ", ".join(f"`{name}`" for name in files) or "the whole suite"
    if selectors == ["-m 'not integration'"]:
        return chosen + " without the frameworks' tests", not files
    return chosen + "".join(f", `{selector}`" for selector in selectors), not files


def _git(*args: str) -> str:
    run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return run.stdout.strip()


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """What the report cannot say of the run: the build, the place, the commit, the command."""
    import torch

    release, _, _ = torch.__version__.partition("+")
    cuda = torch.version.cuda
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    tests, whole = tests_chosen(args.pytest_args)
    env = [
        f"{name}={shlex.quote(value)}"
        for name, value in (("TORCH", args.torch), ("WITH", args.with_))
        if value
    ]
    typed = shlex.join(["bash", "launch/test.sh", *args.typed_arg])
    commit = args.commit or _git("rev-parse", "--short", "HEAD") or "unknown"
    changed = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "torch": release,
        "build": f"CUDA {cuda} build" if cuda else "CPU build",
        "where": f"with {len(gpus)} x {', '.join(sorted(set(gpus)))}" if gpus else "on the CPU",
        "tests": tests,
        "whole": whole,
        "commit": commit,
        "command": " ".join([*env, typed]),
        "note": "uncommitted changes" if changed and not args.commit else "",
    }


# ------------------------------------------------------------------ page (anywhere)


def read_report(description: Path) -> Run:
    """The run that ``NAME.json`` describes, with the counts and date of ``NAME.xml``."""
    report = description.with_suffix(".xml")
    if not report.exists():
        raise SystemExit(f"{description}: a description needs its report {report.name} beside it")
    root = ElementTree.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise SystemExit(f"{report}: a JUnit XML report holds a <testsuite>, this one none")

    def total(name: str) -> int:
        return sum(int(suite.get(name, "0")) for suite in suites)

    failed = total("failures") + total("errors")
    skipped = total("skipped")
    facts = json.loads(description.read_text())
    return Run(
        **facts,
        passed=total("tests") - failed - skipped,
        failed=failed,
        skipped=skipped,
        date=(suites[0].get("timestamp") or "unknown")[:19],
    )


def merge(records: list[Run], new: list[Run]) -> list[Run]:
    """``records`` with ``new`` added, oldest first, each dropping the records it replaces."""
    merged = list(records)
    for run in sorted(new, key=lambda run: run.date):
        merged = [old for old in merged if not run.replaces(old)] + [run]
    return merged


def _release(run: Run) -> tuple[int, ...]:
    return tuple(int(part) for part in run.torch.split(".") if part.isdigit())


def _row(run: Run) -> str:
    skipped = "-" if run.skipped is None else str(run.skipped)
    made = f"{run.date[:10]}, `{run.commit}`" + (f" ({run.note})" if run.note else "")
    cells = [run.torch, f"{run.build}, {run.where}", run.tests, str(run.passed), str(run.failed)]
    cells += [skipped, made, f"`{run.command}`"]
    return "| " + " | ".join(cells) + " |"


HEADER = """| torch | build, where | tests | passed | failed | skipped | date, commit | command |
|---|---|---|---:|---:|---:|---|---|
"""

INTRO = """# Compatibility

<!-- Generated by .ci/compatibility.py from .ci/compatibility.json: run it, do not edit. -->

shardscale needs torch 2.11 or newer. The runs below are what that rests on, each as its own
report gave it: CPU ranks on gloo unless a GPU is named. Nothing older than 2.11 is tested, so
none is claimed. Releases oldest first; of each, the newest run first.

## The whole suite

"""

FILES = """
## Files rerun since

After a whole-suite run, the tests of what changed since, on the same releases:

"""

HOW = """
## How this page is made

`launch/test.sh` with `REPORTS=DIR` leaves each run's report in DIR: pytest's JUnit XML (the
counts and the date) and a description beside it (the torch build, the commit, the command).
`.ci/compatibility.py` turns the reports into records, merges them into `.ci/compatibility.json`
(a run replaces the older runs of its release, kind of build and machine that ran the same
tests, and a run of the whole suite their runs of named files) and writes this page from the
records. After runs on other releases, from a clone at the commit to record:

```bash
REPORTS=runs/compat bash launch/test.sh                  # torch 2.13.0, CPU: frameworks included
REPORTS=runs/compat TORCH=2.11.0 bash launch/test.sh     # any release, in a venv of its own
REPORTS=runs/compat TORCH=2.15.0 bash launch/test.sh
python .ci/compatibility.py page --add runs/compat --save  # the records and this page; commit both
```

CI (`.ci/run`) writes the reports of its two runs (torch 2.13.0, and 2.11.0 with verl's tests)
into its scratch folder and prints the page they make there; it runs on a clean clone and
commits nothing. It also checks that this page is what the script makes of the committed
records (`python .ci/compatibility.py page --check`).
"""


def _table(runs: list[Run]) -> str:
    """``runs`` as one table: releases oldest first, of each the newest run first."""
    newest_first = sorted(runs, key=lambda run: run.date, reverse=True)
    return HEADER + "".join(_row(run) + "\n" for run in sorted(newest_first, key=_release))


def render(records: list[Run]) -> str:
    """The page: the whole-suite runs, then the runs of named files."""
    named = [run for run in records if not run.whole]
    page = INTRO + _table([run for run in records if run.whole])
    if named:
        page += FILES + _table(named)
    return page + HOW


def load(path: Path) -> list[Run]:
    return [Run(**fields) for fields in json.loads(path.read_text())["records"]]


def save(path: Path, records: list[Run]) -> None:
    rows = [dataclasses.asdict(run) for run in records]
    path.write_text(json.dumps({"records": rows}, indent=2) + "\n")


def reports_in(folders: list[Path]) -> list[Run]:
    """Every report in ``folders`` (a description ``NAME.json`` beside its ``NAME.xml``)."""
    descriptions = sorted(path for folder in folders for path in folder.glob("*.json"))
    if folders and not descriptions:
        named = ", ".join(map(str, folders))
        raise SystemExit(
            f"--add needs run reports (NAME.json beside NAME.xml), got none in {named}"
        )
    return [read_report(path) for path in descriptions]


def page(args: argparse.Namespace) -> int:
    """Merge the reports into the records; write, save or check the page."""
    records = merge(load(args.records), reports_in(args.add))
    text = render(records)
    if args.check:
        if args.out.read_text() != text:
            print(
                f"{args.out} is not what {args.records} makes: run .ci/compatibility.py page --save"
            )
            return 1
        print(f"{args.out}: what {args.records.name} makes ({len(records)} runs)")
        return 0
    if args.save:
        save(args.records, records)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"{args.out}: {len(records)} runs")
    return 0


# ------------------------------------------------------------------ the command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    told = commands.add_parser("describe", help="print the run's description (JSON), in the run")
    told.add_argument("--torch", default="", help="launch/test.sh's TORCH, if set")
    told.add_argument("--with", dest="with_", default="", help="launch/test.sh's WITH, if set")
    told.add_argument(
        "--typed-arg", action="append", default=[], help="an argument launch/test.sh was given"
    )
    told.add_argument("--commit", default="", help="the commit, where git cannot tell it")
    told.add_argument("pytest_args", nargs="*", help="what pytest runs (after --)")
    made = commands.add_parser("page", help="merge reports into the records and write the page")
    made.add_argument("--add", type=Path, action="append", default=[], help="a folder of reports")
    made.add_argument("--records", type=Path, default=RECORDS)
    made.add_argument("--out", type=Path, default=PAGE)
    mode = made.add_mutually_exclusive_group()
    mode.add_argument("--save", action="store_true", help="also write the merged records back")
    mode.add_argument("--check", action="store_true", help="fail if --out is not the render")
    args = parser.parse_args(argv)
    if args.command == "describe":
        print(json.dumps(describe(args), indent=2))
        return 0
    return page(args)


if __name__ == "__main__":
    sys.exit(main())
