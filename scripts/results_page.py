"""Refresh the tables of docs/benchmarks.md from the committed results files in docs/results/.

    python scripts/results_page.py            # rewrite the page's tables
    python scripts/results_page.py --check    # exit 1 when a table there is not what this would write

The page's prose is its own. Each table stands between a marker and `<!-- end -->`, the marker naming what it copies:

    <!-- results files="NAME OTHER" runs="PATTERN" rows="PATTERN" absent="TEXT" -->

files: results files without .md, whose first tables are stacked (a glob may match none; `absent` is then said);
runs: a pattern the "## " heading of each run taken matches; rows: a pattern each row taken matches. Above the table
go each file's link, command, machine and the date of its last commit: commit a results file before naming it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE, RESULTS = ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "results"
MARKED = re.compile(r"^(<!-- results (.*?) -->)\n.*?^<!-- end -->$", re.M | re.S)
OPTION = re.compile(r'(\w+)="([^"]*)"')


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def row(values: list[str]) -> str:
    return "| " + " | ".join(values) + " |"


def runs_of(name: str) -> list[tuple[str, str]]:
    """A results file's runs, split at its "## " headings: (heading, "" for the file's top; text)."""
    parts = re.split(r"^## (.*)$", (RESULTS / f"{name}.md").read_text(), flags=re.M)
    return [("", parts[0]), *zip(parts[1::2], parts[2::2])]


def first_table(text: str) -> list[list[str]]:
    """A run's first table: its header, then its rows, each a list of cells."""
    found = re.search(r"(?:^\|.*\n?)+", text, re.M)
    return [cells(line) for line in found.group().splitlines() if not re.fullmatch(r"[|:\- ]+", line)] if found else []


def names(patterns: list[str]) -> list[str]:
    missing = [p for p in patterns if "*" not in p and not (RESULTS / f"{p}.md").exists()]
    if missing:
        raise SystemExit(f"not in docs/results/: {', '.join(missing)}; fix the names in docs/benchmarks.md's markers")
    return [path.stem for pattern in patterns for path in sorted(RESULTS.glob(f"{pattern}.md"))]


def committed(name: str) -> str:
    log = ["git", "log", "-1", "--format=%cs", "--", f"docs/results/{name}.md"]
    date = subprocess.run(log, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return f"committed {date}" if date else "not committed yet"


def source(name: str, text: str) -> str:
    """A file's link, date, machine, commands (less --out and --shard), compile time and outputs unlike HF's."""
    found = re.findall(r"^Command: `([^`]+)`", text, re.M)
    commands = dict.fromkeys(re.sub(r" --(out|shard) \S+", "", command) for command in found)
    machines = dict.fromkeys(re.findall(r"^Machine: (.+?)\.?\s*$", text, re.M)) or {"machine not recorded": None}
    compiled = ", ".join(dict.fromkeys(re.findall(r"AOTInductor; (\d+ s) to compile or load first", text)))
    notes = [f"{compiled} to compile or load first"] if compiled else []
    notes += re.findall(r"^- (\S+: \d+ outputs differ from the baseline.*)$", text, re.M)
    shown = " and ".join(f"`{command}`" for command in commands) + (" (shards merged)" if "Merged from" in text else "")
    return f"- [{name}](results/{name}.md), {committed(name)}, {'; '.join(machines)}: {'; '.join([shown, *notes])}"


def render(files: list[str], runs: str = "", rows: str = "") -> list[str]:
    """A line naming each file, then the rows taken from their first tables, stacked."""
    sources, parts = [], []
    for name in files:
        found = runs_of(name)
        taken = [(heading, text) for heading, text in found if re.search(runs, heading) and first_table(text)]
        if not taken:
            raise SystemExit(f"docs/results/{name}.md: no run with a table has a heading matching {runs!r}")
        sources.append(source(name, "".join(dict.fromkeys([found[0][1], *(text for _, text in taken)]))))
        for heading, text in taken:
            header, *kept = first_table(text)
            kept = [values for values in kept if re.search(rows, row(values))]
            if not kept:
                raise SystemExit(f"docs/results/{name}.md: no row of run {heading!r} matches {rows!r}")
            label = " ".join(filter(None, [f"[{name}](results/{name}.md)" if len(files) > 1 else "", heading]))
            parts.append((label, header, kept))
    if len({tuple(header) for _, header, _ in parts}) > 1:
        raise SystemExit(f"tables with different columns cannot stack: {', '.join(files)}")
    header = parts[0][1] if len(parts) == 1 else ["run", *parts[0][1]]
    body = parts[0][2] if len(parts) == 1 else [[label, *values] for label, _, kept in parts for values in kept]
    return [*sources, "", row(header), row(["---"] * len(header)), *map(row, body)]


def refreshed(marked: re.Match) -> str:
    options = dict(OPTION.findall(marked.group(2)))
    files = names(options["files"].split())
    if not files and "absent" not in options:
        raise SystemExit(f"{marked.group(1)}: no results file matches, and the marker has no absent text")
    lines = render(files, options.get("runs", ""), options.get("rows", "")) if files else [options["absent"]]
    return "\n".join([marked.group(1), "", *lines, "", "<!-- end -->"])


def page() -> str:
    """docs/benchmarks.md with every marked table as the results files have it now."""
    return MARKED.sub(refreshed, PAGE.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is out of date")
    written = page()
    if parser.parse_args(argv).check:
        if PAGE.read_text() == written:
            return 0
        print("docs/benchmarks.md is out of date: run `python scripts/results_page.py`, commit it", file=sys.stderr)
        return 1
    PAGE.write_text(written)
    print(f"refreshed {len(MARKED.findall(written))} tables in docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
