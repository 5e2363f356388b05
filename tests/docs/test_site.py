"""The documentation site as built (`make docs`), read as a browser would: every table row has as many
cells as its header, every link to a page or anchor of the site resolves, and no page loads a script,
style sheet, font or image from the internet (the site must work on an offline cluster)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import markdown  # type: ignore[import-untyped]
import pytest
import yaml
from markdown.extensions.tables import TableProcessor  # type: ignore[import-untyped]

from tests.support import ROOT
from tests.support.docs import hooks as docs_hooks

SITE_URL = "http://site.invalid/"  # pages are resolved against this; anything else is external


FETCHED_LINKS = {"stylesheet", "preload", "preconnect", "icon"}  # <link rel> a browser loads


@dataclass
class Table:
    rows: list[list[str]] = field(default_factory=list)  # each row's cells, header first


@dataclass
class Page:
    """What one HTML file holds that these tests read."""

    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)  # <a href>
    assets: list[str] = field(default_factory=list)  # what the browser fetches to show the page
    tables: list[Table] = field(default_factory=list)


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.page.ids.add(a["id"])
        if tag == "a" and "href" in a:
            self.page.links.append(a["href"])
        elif tag in ("script", "img", "iframe", "source") and a.get("src"):
            self.page.assets.append(a["src"])
        elif tag == "link" and set(a.get("rel", "").split()) & FETCHED_LINKS:
            self.page.assets.append(a["href"])
        elif tag == "table":
            self.page.tables.append(Table())
        elif tag == "tr" and self.page.tables:
            self.page.tables[-1].rows.append([])
        elif tag in ("td", "th") and self.page.tables:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.page.tables[-1].rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def read_page(path: Path) -> Page:
    reader = _Reader()
    reader.feed(path.read_text())
    return reader.page


@dataclass
class Site:
    root: Path
    pages: dict[str, Page]  # by URL
    files: set[str]  # every file's URL


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    """The site, built as `make docs` builds it."""
    root = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(root)],
        cwd=ROOT,
        env=env,
        check=True,
    )
    files = {p for p in root.rglob("*") if p.is_file()}
    return Site(
        root=root,
        pages={SITE_URL + str(p.relative_to(root)): read_page(p) for p in files if p.suffix == ".html"},
        files={SITE_URL + str(p.relative_to(root)) for p in files},
    )


def test_every_table_row_has_as_many_cells_as_its_header(site: Site) -> None:
    """Python-Markdown pads or cuts a row to its header's width, so a row that split in two shows as
    cells moved one column on and the last ones lost; the first cell of such a split ends in the
    backslash of an escape that did not hold (`\\|`)."""
    broken = [
        f"{url}: {row} (header {table.rows[0]})"
        for url, page in site.pages.items()
        for table in page.tables
        for row in table.rows[1:]
        if len(row) != len(table.rows[0]) or any(re.search(r"(?<!\\)\\$", cell) for cell in row)
    ]
    assert sum(len(t.rows) for p in site.pages.values() for t in p.tables) > 500  # the tables were read
    assert broken == []


def test_every_markdown_table_row_splits_into_its_header_columns() -> None:
    """The same, before Python-Markdown pads or cuts: each row of each table the site is built from
    (the pages, the generated OpenAPI page and metrics table, BENCHMARKS.md) splits, as its table
    extension splits rows, into as many cells as the header."""
    hooks = docs_hooks()
    sources = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
    sources["openapi.md"] = hooks.render_openapi(yaml.safe_load((ROOT / "openapi.yaml").read_text()))
    sources["metrics table"] = hooks.render_metrics()
    sources["BENCHMARKS.md"] = (ROOT / "BENCHMARKS.md").read_text()
    splitter = TableProcessor(markdown.Markdown().parser, {})
    splitter.border = True
    broken = []
    for name, text in sources.items():
        for table in re.findall(r"(?:^\|.*\|\n)+", text, re.MULTILINE):
            header, *rows = table.splitlines()
            width = len(splitter._split_row(header))
            broken += [f"{name}: {row}" for row in rows if len(splitter._split_row(row)) != width]
    assert broken == []


def _target(page_url: str, href: str) -> tuple[str, str] | None:
    """The URL of the site's file `href` points to and its anchor, or None when it leaves the site."""
    url = urljoin(page_url, href)
    if not url.startswith(SITE_URL):
        return None
    parts = urlsplit(url)
    path = unquote(parts.path)
    return SITE_URL.rstrip("/") + (path + "index.html" if path.endswith("/") else path), parts.fragment


def test_no_link_inside_the_site_is_dead(site: Site) -> None:
    dead = []
    for url, page in site.pages.items():
        for href in page.links:
            target = _target(url, href)
            if target is None:
                continue
            file, anchor = target
            if file not in site.files:
                dead.append(f"{url}: {href} (no such file)")
            elif anchor and file in site.pages and anchor not in site.pages[file].ids:
                dead.append(f"{url}: {href} (no such anchor)")
    assert sum(len(p.links) for p in site.pages.values()) > 500  # the links were read
    assert dead == []


EXTERNAL_URL = re.compile(r"url\(\s*['\"]?(?:https?:)?//|@import\s+['\"](?:https?:)?//")


def test_no_page_fetches_anything_from_the_internet(site: Site) -> None:
    """Scripts, style sheets, fonts, images and icons all come from the site itself."""
    external = [
        f"{url}: {asset}"
        for url, page in site.pages.items()
        for asset in page.assets
        if _target(url, asset) is None
    ]
    assert sum(len(p.assets) for p in site.pages.values()) > 10  # the assets were read
    assert external == []
    styles = sorted(site.root.rglob("*.css"))
    assert styles
    assert [str(p) for p in styles if EXTERNAL_URL.search(p.read_text())] == []


# Opened from disk, as a newcomer opens build/site/index.html
def test_every_link_between_pages_names_a_file(site: Site) -> None:
    folders = [
        f"{url}: {href}"
        for url, page in site.pages.items()
        for href in page.links
        if _target(url, href) is not None and (href.split("#")[0] or "x").endswith("/")
    ]
    assert folders == []
    assert SITE_URL + "api.html" in site.pages  # page.html, not page/index.html


def test_the_docs_say_how_to_view_the_built_site() -> None:
    page = (ROOT / "docs" / "development.md").read_text()
    assert "build/site/index.html" in page
    assert re.search(r"python -m http\.server( \d+)? -d build/site", page)


TABLE_CODE = re.compile(r"\.md-typeset table:not\(\[class\]\) code\s*\{([^}]*)\}")


def test_identifiers_in_tables_do_not_break_mid_word(site: Site) -> None:
    """The theme sets `word-break: break-word` on code, which cuts `LOGPROBD_MODEL` mid-word in a
    narrow column; the site's own style sheet, loaded after the theme's by every page, undoes it."""
    sheet = site.root / "stylesheets" / "extra.css"
    rules = [dict(part.split(":", 1) for part in body.replace(" ", "").replace("\n", "").split(";") if part)
             for body in TABLE_CODE.findall(sheet.read_text())]  # fmt: skip
    assert {"word-break": "normal", "overflow-wrap": "normal"}.items() <= rules[-1].items()
    for url, page in site.pages.items():
        styles = [asset for asset in page.assets if asset.endswith(".css")]
        assert styles[-1].endswith("stylesheets/extra.css"), url  # last: it wins over the theme
