"""The documentation as a user reads it: the MkDocs site under docs/, the README, BENCHMARKS.md.

The site must build with ``mkdocs build --strict`` and print no warning (a broken
link, a missing anchor, a page left out of the nav). The README is a user's guide,
not a lab notebook, and BENCHMARKS.md holds the current figure of each benchmark,
not its history (that is in git): both have a length budget. A figure says what it
shows and the command that reproduces it, never which working session found it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

README_MAX_LINES = 400
BENCHMARKS_MAX_LINES = 800

# "session 16", "sessions 16-17": when a figure was found, which belongs in git, not in the docs.
DATED_PROVENANCE = re.compile(r"\b(session|sessions) \d+", re.IGNORECASE)

# A relative Markdown link in the README: [text](target) where target is not a URL.
_README_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _tracked_docs() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_site_builds_strict_without_a_single_warning(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "architecture.html").is_file()


def test_readme_and_benchmarks_stay_within_their_length_budget() -> None:
    assert _line_count(ROOT / "README.md") <= README_MAX_LINES
    assert _line_count(ROOT / "BENCHMARKS.md") <= BENCHMARKS_MAX_LINES


def test_no_doc_says_which_session_found_a_figure() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in _tracked_docs()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for match in DATED_PROVENANCE.finditer(line)
    ]
    assert offenders == []


def test_readme_keeps_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "scripts/run.sh" in text
    assert "scripts/test.sh" in text


def test_readme_links_point_at_files_and_headings_that_exist() -> None:
    from markdown.extensions.toc import slugify  # installed with mkdocs

    def anchors(page: Path) -> set[str]:
        headings = (_HEADING.match(line) for line in page.read_text(encoding="utf-8").splitlines())
        return {slugify(match.group(1).replace("`", ""), "-") for match in headings if match}

    broken = []
    for target in _README_LINK.findall((ROOT / "README.md").read_text(encoding="utf-8")):
        path_part, _, anchor = target.partition("#")
        page = ROOT / path_part
        if not page.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(page):
            broken.append(target)
    assert broken == []
