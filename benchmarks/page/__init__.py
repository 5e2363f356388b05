"""BENCHMARKS.md, generated: `python -m benchmarks.page` (build.py) renders template.md with the tables
of the result files current.toml names (tables.py, results.py); `--check` says whether the page is
stale (tests/benchmarks/test_page.py runs it in CI)."""
