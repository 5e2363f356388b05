"""The built site read as a newcomer reads it: opened from disk (build/site/index.html), every link
between its pages names a file, not a folder (which a browser shows as a directory listing), and the
docs say how to view it; in tables, identifiers in code wrap only where text may, never mid-word."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_site import SITE_URL, Site, _target, site  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[1]


def test_every_link_between_pages_names_a_file(site: Site) -> None:  # noqa: F811
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


def test_identifiers_in_tables_do_not_break_mid_word(site: Site) -> None:  # noqa: F811
    """The theme sets `word-break: break-word` on code, which cuts `LOGPROBD_MODEL` mid-word in a
    narrow column; the site's own style sheet, loaded after the theme's by every page, undoes it."""
    sheet = site.root / "stylesheets" / "extra.css"
    rules = [dict(part.split(":", 1) for part in body.replace(" ", "").replace("\n", "").split(";") if part)
             for body in TABLE_CODE.findall(sheet.read_text())]  # fmt: skip
    assert {"word-break": "normal", "overflow-wrap": "normal"}.items() <= rules[-1].items()
    for url, page in site.pages.items():
        styles = [asset for asset in page.assets if asset.endswith(".css")]
        assert styles[-1].endswith("stylesheets/extra.css"), url  # last: it wins over the theme
