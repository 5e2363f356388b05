"""The documentation read in the repository, as GitHub renders it: every relative link of every
markdown file (README.md, docs/, CONTRIBUTING.md, BENCHMARKS.md, ...) leads to a file that is there,
and every anchor to a heading of the page it names, with GitHub's heading ids (lower case, each space
a hyphen, other punctuation dropped, a repeated heading numbered). The site is built with the same
ids (mkdocs.yml's toc slugify), so a link that works here works there too (tests/docs/test_site.py)."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.support import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)


# templates of pages written elsewhere: their links are checked in the page they become (BENCHMARKS.md)
TEMPLATES = {"benchmarks/page/template.md"}


def markdown_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file() and name not in TEMPLATES]


def without_code(text: str) -> str:
    """The text outside fenced blocks and code spans (their brackets are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def heading_text(markdown: str) -> str:
    """A heading's text as GitHub shows it: code spans, links and emphasis reduced to their text."""
    text = re.sub(r"`+([^`]*)`+", r"\1", markdown)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"(\*\*|__|\*|(?<!\w)_(?=\w)|(?<=\w)_(?!\w))", "", text).strip()


def github_slug(text: str) -> str:
    """GitHub's id of a heading (github-slugger): lower case; letters, marks, numbers, `_`, `-` and
    spaces kept, everything else dropped; each space a hyphen."""
    kept = "".join(c for c in text.lower() if c in "_- " or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading id of the markdown file at `path`, a repeated one numbered as GitHub does."""
    seen: dict[str, int] = {}
    ids = set()
    for _, text in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = github_slug(heading_text(text))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Completions: the OpenAI / vLLM form", "completions-the-openai--vllm-form"),
        ("`POST /logprobs`", "post-logprobs"),
        ("Expert load (mixture-of-experts policies)", "expert-load-mixture-of-experts-policies"),
        ("Routing replay and recorded routes (R3, R2)", "routing-replay-and-recorded-routes-r3-r2"),
        ("How fast: 2.6\N{MULTIPLICATION SIGN} at 7B", "how-fast-26-at-7b"),
        ("LOGPROBD_MODEL and `max_batch_tokens`", "logprobd_model-and-max_batch_tokens"),
    ],
)
def test_github_slugs(heading: str, slug: str) -> None:
    """github-slugger's answers for these headings (as github.com's ids for them)."""
    assert github_slug(heading_text(heading)) == slug


def test_every_relative_link_and_anchor_resolves_as_github_renders_it() -> None:
    dead = []
    checked = 0
    for page in markdown_files():
        for target in LINK.findall(without_code(page.read_text())):
            parts = urlsplit(target)
            if parts.scheme or target.startswith("//"):
                continue  # off the repository
            checked += 1
            where = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            name = f"{page.relative_to(ROOT)}: {target}"
            if not where.exists():
                dead.append(f"{name} (no such file)")
            elif parts.fragment and where.suffix == ".md" and parts.fragment not in anchors(where):
                dead.append(f"{name} (no such heading)")
    assert checked > 150  # the links were read
    assert dead == []


def test_the_generated_pages_are_committed_and_current() -> None:
    """What the site shows generated (the OpenAPI page, the metrics table, the two diagrams) is in
    the repository too, as `python docs/hooks.py` writes it now."""
    from tests.support.docs import hooks

    for path, render in hooks().generated().items():
        assert path.read_text() == render(), f"{path.relative_to(ROOT)} is stale: run `python docs/hooks.py`"


# a path under tests/ named in prose or a comment; records of past runs name the paths of their day
TEST_PATH = re.compile(r"\btests/[A-Za-z0-9_/]+\.(?:py|yaml|jsonl)\b")
RECORDS = ("benchmarks/results/", "tests/gpu/results/", "docs/benchmark-history.md")


def test_every_named_test_file_is_there() -> None:
    """A file under tests/ that the docs, the Makefile, a requirements file or a module names (in
    prose, a comment or a config) exists: moving a test moves what points at it."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    missing = []
    for name in listed:
        path = ROOT / name
        if name.startswith(RECORDS) or not path.is_file() or path.suffix in {".so", ".svg", ".png"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        named = sorted(set(TEST_PATH.findall(text)))
        missing += [f"{name}: {hit}" for hit in named if not (ROOT / hit).exists()]
    assert missing == []
