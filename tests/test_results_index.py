"""The results files and the pages that quote them agree. Fast: reads markdown, loads no model.

- Every file in docs/results/ but README.md is linked from docs/results/README.md, the index.
- Every link into docs/results/ (from README.md, docs/*.md and the index, in any relative form) names a file that
  exists.
- Every markdown table in README.md and docs/*.md that carries measured figures names its evidence: a column
  headed exactly `evidence` whose every row holds a results link or a commit hash (7-40 hex digits, "commit "
  before it or not), or, without one, a link to a results file inside the table or in the 3 lines above it.
  A table carries measured figures when a data cell, code spans left out, holds a number with a unit or a ratio
  (MEASURED: 1.52x, 12.5 ms, 106 s, 80 tok/s, 31.7 GB/s, 693 GFLOP/s, 68%, 20 minutes, 3.3 hours, ...) or a
  column heading names a measure (MEASURE: tau, tokens/s, speedup, top-1, tokens per ..., ms). Option tables
  (a key, its default, its effect) have neither.
- docs/benchmarks.md is what `python scripts/results_page.py` writes.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "README.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

MEASURE = re.compile(r"\btau\b|tok(en)?s?/s|speedup|top-1|tokens per|\bms\b", re.I)  # a column heading
MEASURED = re.compile(r"\d(\.\d+)?\s*(x|ms|s|tok(en)?s?/s|GiB|MiB|GB|GB/s|GFLOP/s|%|minutes?|min|hours?|h)(?!\w)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
RESULTS_LINK = re.compile(r"\]\([^)\s]*results/[^)\s]+\)")  # where it leads is the link test's
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")  # "commit " before it or not
SEPARATOR = re.compile(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*")


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT))


def results_links(path: Path) -> list[Path]:
    """Where the file's links into docs/results/ lead, resolved from the file's own folder."""
    links = (link.split("#")[0] for link in LINK.findall(path.read_text()) if "://" not in link)
    return [target for target in ((path.parent / link).resolve() for link in links) if target.is_relative_to(RESULTS)]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(path: Path) -> list[tuple[int, list[str], list[str]]]:
    """Each markdown table outside code fences: the number of its first line, its lines, the 3 lines above it."""
    found, lines, fenced = [], path.read_text().splitlines(), False
    for number, line in enumerate(lines):
        fenced ^= line.lstrip().startswith("```")
        starts = line.startswith("|") and not (number and lines[number - 1].startswith("|"))
        if not fenced and starts and number + 1 < len(lines) and SEPARATOR.fullmatch(lines[number + 1].strip()):
            end = next((n for n in range(number, len(lines)) if not lines[n].startswith("|")), len(lines))
            found.append((number + 1, lines[number:end], lines[max(0, number - 3) : number]))
    return found


def carries_measured_figures(table: list[str]) -> bool:
    header, rows = cells(table[0]), [cells(line) for line in table[2:]]
    without_code = (re.sub(r"`[^`]*`", "", cell) for values in rows for cell in values[1:])
    return any(MEASURE.search(cell) for cell in header) or any(MEASURED.search(cell) for cell in without_code)


def evidence_missing(table: list[str], above: list[str]) -> str:
    """Nothing when the table names its evidence, else why not. An `evidence` column must name it on every row."""
    header, rows = cells(table[0]), [cells(line) for line in table[2:]]
    if "evidence" in header:
        column = header.index("evidence")
        named = (RESULTS_LINK.search(values[column]) or COMMIT.search(values[column]) for values in rows)
        bare = [values[0] for values, name in zip(rows, named) if not name]
        return f"rows whose evidence is no results link or commit: {bare[:3]}" if bare else ""
    if any(RESULTS_LINK.search(line) for line in above + table):
        return ""
    return "no results link in it or in the 3 lines above it, and no `evidence` column"


def test_every_results_file_is_in_the_index():
    linked = {target.name for target in results_links(INDEX)}
    missing = sorted(
        p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md" and p.name not in linked
    )
    assert not missing, f"docs/results/README.md does not link {len(missing)} files: {missing}"


@pytest.mark.parametrize("path", [*PAGES, INDEX], ids=shown)
def test_every_link_into_the_results_leads_to_a_file(path):
    broken = sorted({shown(target) for target in results_links(path) if not target.exists()})
    assert not broken, f"{shown(path)} links results files that do not exist: {broken}"


@pytest.mark.parametrize("path", PAGES, ids=shown)
def test_every_table_of_measured_figures_names_its_evidence(path):
    unnamed = [
        f"{shown(path)}:{start}: {why}"
        for start, table, above in tables(path)
        if carries_measured_figures(table) and (why := evidence_missing(table, above))
    ]
    assert not unnamed, "tables of measured figures that name no results file or commit:\n" + "\n".join(unnamed)


def test_the_benchmarks_page_is_what_its_script_writes():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    results_page = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = results_page  # its dataclasses look their module up there
    spec.loader.exec_module(results_page)
    assert (ROOT / "docs" / "benchmarks.md").read_text() == results_page.page(), (
        "docs/benchmarks.md is out of date: run `python scripts/results_page.py` and commit the page"
    )
