"""docs/compatibility.md is made by .ci/compatibility.py from the runs' own reports, never by hand.

The script is loaded from its file, as tests/test_check_site.py loads its neighbour: it is CI's
and the maintainers' tool, not part of the package. ``describe`` needs a run (it imports torch and
asks git); it is exercised by ``launch/test.sh`` with ``REPORTS`` set, not here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tests import ci_scripts

compatibility = ci_scripts.load("compatibility")

# What pytest --junitxml writes (pytest 8), trimmed to the attributes the script reads.
REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" errors="1" failures="2" skipped="22" tests="600"
 timestamp="2026-12-01T10:11:12.123456+00:00" hostname="ci"></testsuite></testsuites>"""


def _run(**changes: object) -> object:
    base = compatibility.Run(
        torch="2.15.0",
        build="CUDA 13.0 build",
        where="on the CPU",
        tests="the whole suite without the frameworks' tests",
        whole=True,
        passed=579,
        failed=0,
        skipped=22,
        date="2026-11-26T20:18:30",
        commit="45a3f1c",
        command="TORCH=2.15.0 bash launch/test.sh",
    )
    return replace(base, **changes)


def test_committed_page_is_what_the_committed_records_make() -> None:
    records = compatibility.load(compatibility.RECORDS)
    assert compatibility.PAGE.read_text() == compatibility.render(records), (
        "docs/compatibility.md was edited by hand: python .ci/compatibility.py page --save"
    )


def test_report_counts_and_date_come_from_the_junit_xml(tmp_path: Path) -> None:
    (tmp_path / "run.xml").write_text(REPORT)
    facts = {key: value for key, value in vars(_run()).items() if key not in {"passed", "failed"}}
    del facts["skipped"], facts["date"]
    (tmp_path / "run.json").write_text(json.dumps(facts))
    run = compatibility.read_report(tmp_path / "run.json")
    assert (run.passed, run.failed, run.skipped) == (575, 3, 22)
    assert run.date == "2026-12-01T10:11:12"


def test_whole_suite_run_replaces_older_runs_of_its_place_only() -> None:
    named = _run(tests="`tests/test_clip.py`", whole=False, date="2026-11-27T09:17:20")
    other_release = _run(torch="2.14.1")
    gpu = _run(where="with 1 x NVIDIA H200", tests="the whole suite, `-m 'gpu or nccl'`")
    newer = _run(date="2026-12-01T10:11:12", commit="abc1234", build="CUDA 12.8 build")
    merged = compatibility.merge([_run(), named, other_release, gpu], [newer])
    assert merged == [other_release, gpu, newer]


def test_named_files_run_keeps_the_whole_suite_run_before_it() -> None:
    named = _run(tests="`tests/test_clip.py`", whole=False, date="2026-12-01T10:11:12")
    assert compatibility.merge([_run()], [named]) == [_run(), named]


def test_tests_chosen_names_files_and_selections_not_other_options() -> None:
    chosen = compatibility.tests_chosen
    assert chosen(["--durations=25"]) == ("the whole suite", True)
    assert chosen(["-m", "not integration"]) == (
        "the whole suite without the frameworks' tests",
        True,
    )
    assert chosen(["-k", "not integration or verl", "--durations=15", "-n", "4"]) == (
        "the whole suite, `-k 'not integration or verl'`",
        True,
    )
    assert chosen(["tests/test_clip.py", "-p", "no:cacheprovider", "tests"]) == (
        "`tests/test_clip.py`",
        False,
    )
