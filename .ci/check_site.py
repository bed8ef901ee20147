"""Check the BUILT docs site for what a reader must never see; exit 1 naming each page and text.

`mkdocs build --strict` already fails on a cross-reference that autorefs cannot resolve (checked:
a planted `[x][nonexistent.name]` in a docstring aborts the build). It cannot see markup that is
not Markdown at all, so this reads the rendered HTML, as the reader gets it, for:

- reST/Sphinx leftovers in the text: roles (`:meth:`, `:class:`, `:func:`, `:attr:`, `:exc:`,
  `:mod:`, `:data:`, ...), a paragraph ending in `::` (a reST literal-block marker, `Example::`
  among them), directives (`.. code-block::`, `.. note::`);
- a doctest outside an `Examples:` section (Markdown reads `>>>` as three block quotes);
- cross-references left unrendered: a literal `[text][id]` in the text, an `<autoref>` element;
- API names that do not link: inside a rendered docstring (mkdocstrings' `doc-contents`), inline
  code naming an object documented on that page (`ShardedGradScaler`, `find_nonfinite_grads`,
  `ShardedGradScaler.step`, `shardscale.ScaleState`) outside a link;
- on the home page, a code line wider than 80 characters (about what a code block shows in a
  1280-pixel window: the first screen must not scroll sideways);
- what needs a network: a mermaid block (its JS comes from a CDN), a script or image loaded
  from another host.
Text inside code (`<code>`, `<pre>`) is not searched for markup: code may contain `::` or roles.

Docstring style (what keeps this check green; the site renders docstrings as Markdown, Google
style, with mkdocstrings' `scoped_crossrefs`):
- A name of the API is a cross-reference, written so hover text in an IDE still reads:
  [`ShardScaleDistributedError`][] for a name the module defines or imports (resolved in the
  docstring's scope, like Python does), [`step()`][step] for a method or function (the text
  shows the call, the id names it), [`ShardedGradScaler`][shardscale.ShardedGradScaler] where
  the name is not in the module's scope. Other code is in plain backticks.
- An example is a fenced block in an `Example:` section (rendered as an example box):
      Example:
          ```python
          scaler = ShardedGradScaler()
          ```

Usage: python .ci/check_site.py SITE_DIR   (run by .ci/run after `mkdocs build --strict`)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

ROLE = re.compile(
    r":(?:py:)?(?:meth|class|func|attr|exc|mod|data|obj|const|ref|doc|term|any|cite):"
)
DIRECTIVE = re.compile(r"(?:^|\s)\.\. [a-z][\w-]*::")
# A reference link Markdown did not turn into a link; `\x00` stands for inline code.
UNRENDERED_REF = re.compile(r"\[[^\[\]\n]*\]\[[^\[\]\n]*\]")
CODE = "\x00"
HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
BLOCKS = HEADINGS | {"p", "li", "dt", "dd", "td", "th", "blockquote", "summary", "div"}
HOME_CODE_WIDTH = 80
SKIPPED = frozenset({"script", "style", "pre", "textarea", "svg"})
VOID = frozenset({"br", "col", "hr", "img", "input", "link", "meta", "source", "wbr"})


@dataclass
class _Block:
    tag: str
    prose: list[str] = field(default_factory=list)  # code replaced by CODE: what is searched
    shown: list[str] = field(default_factory=list)  # code in backticks: what is reported
    unlinked: list[str] = field(default_factory=list)  # API names in code outside a link


class _PageChecker(HTMLParser):
    """Collect the findings of one page; `api_names` is filled by a first pass over its ids."""

    def __init__(self, api_names: frozenset[str], max_code_width: int | None = None) -> None:
        super().__init__(convert_charrefs=True)
        self.api_names = api_names
        self.max_code_width = max_code_width
        self.pre: list[str] | None = None  # text of the code block being read
        self.findings: list[str] = []
        self.stack: list[tuple[str, set[str]]] = []  # open tags with their classes
        self.blocks: list[_Block] = [_Block("document")]
        self.code: list[str] | None = None  # text of the inline code being read
        self.code_links = False  # whether that code holds a link (`<code><a>Name</a></code>`)

    def _inside(self, tags: frozenset[str]) -> bool:
        return any(tag in tags for tag, _ in self.stack)

    def _in_class(self, cls: str) -> bool:
        return any(cls in classes for _, classes in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = {k: v or "" for k, v in attrs}
        classes = set(attr.get("class", "").split())
        if tag == "autoref":
            self.findings.append(f"an <autoref> element was left in the page: {attr}")
        if "mermaid" in classes:
            self.findings.append(
                "a mermaid diagram: it needs mermaid's JS from a CDN (draw it as text)"
            )
        src = attr.get("src", "")
        if tag in ("script", "img") and re.match(r"(?:https?:)?//", src):
            self.findings.append(f"a <{tag}> loaded from the network: {src}")
        if tag in VOID:
            return
        if tag == "blockquote" and sum(t == "blockquote" for t, _ in self.stack) == 2:
            self.findings.append(
                "block quotes three deep: a `>>>` doctest read as Markdown (put it under "
                "`Examples:`)"
            )
        if tag == "a" and self.code is not None:
            self.code_links = True
        self.stack.append((tag, classes))
        if tag == "pre":
            self.pre = []
        if tag == "code" and not self._inside(SKIPPED):
            self.code = []
            self.code_links = False
        elif tag in BLOCKS:
            self.blocks.append(_Block(tag))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID or not any(t == tag for t, _ in self.stack):
            return
        if tag == "code" and self.code is not None:
            self._end_code()
        if tag == "pre" and self.pre is not None:
            self._end_pre()
        while self.stack:
            open_tag, _ = self.stack.pop()
            if open_tag in BLOCKS:
                self._check_block(self.blocks.pop())
            if open_tag == tag:
                break

    def _end_code(self) -> None:
        text = "".join(self.code or ())
        self.code = None
        block = self.blocks[-1]
        block.prose.append(CODE)
        block.shown.append(f"`{text}`")
        name = text.strip()
        name = name.removesuffix("()")
        if (
            name in self.api_names
            and not self.code_links
            and self._in_class("doc-contents")
            and not self._inside(frozenset({"a"}) | HEADINGS)
        ):
            block.unlinked.append(text)

    def _end_pre(self) -> None:
        lines = "".join(self.pre or ()).splitlines()
        self.pre = None
        width = self.max_code_width
        self.findings.extend(
            f"a code line of {len(line)} characters (at most {width} here): {line.strip()}"
            for line in lines
            if width is not None and len(line) > width
        )

    def handle_data(self, data: str) -> None:
        if self.pre is not None:
            self.pre.append(data)
        if self._inside(SKIPPED):
            return
        if self.code is not None:
            self.code.append(data)
            return
        self.blocks[-1].prose.append(data)
        self.blocks[-1].shown.append(data)

    def _check_block(self, block: _Block) -> None:
        prose = "".join(block.prose)
        shown = " ".join("".join(block.shown).split())
        if len(shown) > 200:
            shown = shown[:200] + "..."
        if not prose.strip():
            return
        problems = [
            f"`{text}` names an API object but does not link to it (write [`{text}`][] or "
            f"[`{text}`][id] in the docstring)"
            for text in block.unlinked
        ]
        if ROLE.search(prose):
            problems.append(f"a reST role ({ROLE.search(prose)[0]})")  # type: ignore[index]
        if DIRECTIVE.search(prose):
            problems.append("a reST directive")
        if prose.rstrip().endswith("::"):
            problems.append("a reST literal-block marker (text ending in '::')")
        ref = UNRENDERED_REF.search(prose)
        if ref:
            problems.append(f"an unrendered reference ({ref[0].replace(CODE, '`...`')})")
        self.findings.extend(f"{problem} in: {shown}" for problem in problems)

    def close(self) -> None:
        super().close()
        while len(self.blocks) > 1:
            self._check_block(self.blocks.pop())
        self._check_block(self.blocks[0])


def api_names(html: str) -> frozenset[str]:
    """The names a docstring may use for the objects mkdocstrings documented on this page.

    Ids like `shardscale.ShardedGradScaler.step`: the top-level ones (whose parent is not an id
    on the page) give their own name (`ShardedGradScaler`) and `Name.member` for their members;
    every id also counts whole. A bare method name (`step`) is not counted: in prose it may
    mean another object's method.
    """
    ids = set(re.findall(r'\bid="(shardscale(?:\.\w+)+)"', html))
    names = set(ids)
    for ident in ids:
        parent, _, name = ident.rpartition(".")
        if parent not in ids:
            names.add(name)
        elif parent.rpartition(".")[0] not in ids:
            names.add(f"{parent.rpartition('.')[2]}.{name}")
    return frozenset(names)


def check_page(html: str, *, home: bool = False) -> list[str]:
    """Every finding on one page, in page order; `home`: the landing page."""
    checker = _PageChecker(api_names(html), HOME_CODE_WIDTH if home else None)
    checker.feed(html)
    checker.close()
    return checker.findings


def check_site(site: Path) -> list[str]:
    """Every finding on every page of the built site, each prefixed with its page."""
    pages = sorted(site.rglob("*.html"))
    if not pages:
        raise SystemExit(f"no HTML pages under {site}: build the site first (mkdocs build)")
    return [
        f"{page.relative_to(site)}: {finding}"
        for page in pages
        for finding in check_page(
            page.read_text(encoding="utf-8"), home=page == site / "index.html"
        )
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python .ci/check_site.py SITE_DIR", file=sys.stderr)
        return 2
    site = Path(argv[0])
    findings = check_site(site)
    for finding in findings:
        print(finding, file=sys.stderr)
    pages = len(list(site.rglob("*.html")))
    if findings:
        print(f"check_site: {len(findings)} problem(s) in the built site", file=sys.stderr)
        return 1
    print(f"check_site: {pages} pages clean")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
