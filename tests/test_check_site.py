"""The built-site check (.ci/check_site.py) fails on what a reader must never see, and only on that.

Each case is a tiny page in the shape mkdocs-material and mkdocstrings write (a docstring is a
`doc-contents` div; an object's anchor is its id), checked through the script's `main` (one
case through its command line, as .ci/run runs it): building the real site belongs to CI, not to
the unit tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import ci_scripts

SCRIPT = ci_scripts.CI / "check_site.py"
check_site = ci_scripts.load("check_site")

# One documented class with a method, as mkdocstrings renders it.
API_PAGE = """<!doctype html><html><head><title>API</title>
<script src="../assets/javascripts/bundle.js"></script></head><body>
<h1>API reference</h1>
<div class="doc doc-object doc-class">
<h2 id="shardscale.Scaler" class="doc doc-heading"><code>shardscale.Scaler</code></h2>
<div class="doc doc-contents first">
<p>Loss scaler. {body}</p>
<div class="doc doc-object doc-function">
<h3 id="shardscale.Scaler.step"><code>step(optimizer)</code></h3>
<div class="doc doc-contents "><p>Step.</p></div>
</div></div></div>
</body></html>
"""

CLEAN_BODIES = {
    "linked names": '<a class="autorefs" href="#shardscale.Scaler.step"><code>step()</code></a> '
    'and <a href="#shardscale.Scaler"><code>Scaler</code></a>',
    "a link inside code": '<code><a href="#shardscale.Scaler">Scaler</a></code> (a base)',
    "markup inside code": "<code>x[::2]</code>, <code>:meth:`a`</code>, <code>d[a][b]</code>",
    "a code block": '<div class="highlight"><pre><code>Example::\n  :meth:`step`\n'
    ".. code-block:: python\n[x][y]</code></pre></div>",
    "a colon in prose": "Rule: keep it. Example: a time of 10:30, <code>ratio</code>:",
    "a bare method name": "<code>step()</code> of the optimizer",
}

BROKEN_BODIES = {
    "role": (":meth:<code>step</code> unscales", "a reST role (:meth:)"),
    "class role": ("raises :class:<code>Error</code>.", "a reST role (:class:)"),
    "example marker": ("</p><p>Example::", "a reST literal-block marker"),
    "literal block marker": ("override it like this::", "a reST literal-block marker"),
    "directive": ("</p><p>.. code-block:: python", "a reST directive"),
    "unresolved ref": ("see [<code>step</code>][]", "an unrendered reference ([`...`][])"),
    "unresolved ref with id": ("see [x][nonexistent.name]", "an unrendered reference ([x]["),
    "autoref leftover": ('<autoref identifier="x">x</autoref>', "an <autoref> element"),
    "unlinked class": ("raises <code>Scaler</code>", "`Scaler` names an API object"),
    "unlinked method": ("<code>Scaler.step()</code>", "`Scaler.step()` names an API object"),
    "doctest as quotes": (
        "</p><blockquote><blockquote><blockquote><p>x = 1</p></blockquote></blockquote>"
        "</blockquote><p>",
        "block quotes three deep",
    ),
    "mermaid": ('</p><pre class="mermaid"><code>graph</code></pre><p>', "a mermaid diagram"),
    "remote script": (
        '<script src="https://cdn.example/m.js"></script>',
        "a <script> loaded from the network: https://cdn.example/m.js",
    ),
}


def _check(site: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The exit status, stdout and stderr of `check_site.py SITE`."""
    try:
        returncode = check_site.main([str(site)])
    except SystemExit as exit_:
        print(exit_.code, file=sys.stderr)
        returncode = 1
    out, err = capsys.readouterr()
    return returncode, out, err


def _site(tmp_path: Path, body: str) -> Path:
    site = tmp_path / "site"
    (site / "api").mkdir(parents=True)
    (site / "index.html").write_text("<html><body><p>Home.</p></body></html>")
    (site / "api" / "index.html").write_text(API_PAGE.replace("{body}", body))
    return site


@pytest.mark.parametrize("body", CLEAN_BODIES.values(), ids=CLEAN_BODIES.keys())
def test_check_site_clean_page_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str
) -> None:
    returncode, out, err = _check(_site(tmp_path, body), capsys)
    assert returncode == 0, err
    assert "check_site: 2 pages clean" in out


@pytest.mark.parametrize(("body", "expected"), BROKEN_BODIES.values(), ids=BROKEN_BODIES.keys())
def test_check_site_leftover_markup_fails_naming_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, expected: str
) -> None:
    returncode, _, err = _check(_site(tmp_path, body), capsys)
    assert returncode == 1
    findings = [line for line in err.splitlines() if expected in line]
    assert findings, err
    assert all(line.startswith("api/index.html: ") for line in findings), err


@pytest.mark.parametrize(("width", "fails"), [(80, False), (81, True)])
def test_check_site_home_code_width_over_80_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], width: int, fails: bool
) -> None:
    site = _site(tmp_path, "Fine.")
    line = "x = 1  # " + "c" * (width - 9)
    api_line = "y" * 120  # other pages may be wider
    (site / "index.html").write_text(f"<html><body><pre><code>{line}\n</code></pre></body></html>")
    (site / "api" / "index.html").write_text(
        API_PAGE.replace("{body}", f"<pre><code>{api_line}</code></pre>")
    )
    returncode, _, err = _check(site, capsys)
    assert returncode == int(fails), err
    if fails:
        assert f"index.html: a code line of {width} characters (at most 80 here)" in err


def test_check_site_command_line_role_fails_with_page_and_text(tmp_path: Path) -> None:
    site = _site(tmp_path, "Optional: :meth:<code>step</code> unscales by itself.")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(site)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert (
        "api/index.html: a reST role (:meth:) in: Loss scaler. Optional: :meth:`step` "
        "unscales by itself." in result.stderr
    )


def test_check_site_without_pages_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    returncode, _, err = _check(tmp_path, capsys)
    assert returncode == 1
    assert "no HTML pages" in err
