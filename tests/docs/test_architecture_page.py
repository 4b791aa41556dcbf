"""docs/architecture.md against the code: every module it names exists, and every package is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "pdserve"
ENGINE = PACKAGE / "engine"

# A backticked dotted name under pdserve (`pdserve.engine.kv.leases.LeaseTable`) or path (`pdserve/gateway/router.py`).
_DOTTED = re.compile(r"`(pdserve(?:\.\w+)+)`")
_PATH = re.compile(r"`(pdserve/[\w/.]+)`")
_CELL_NAME = re.compile(r"`([^`]+)`")


def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after the line ``heading``'s first column names, header excluded."""
    lines = _page().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| " + heading))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module or package under pdserve, or a name defined at the top of one."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            rest = parts[end:]
            if not rest:
                return True
            source = module.read_text(encoding="utf-8")
            return len(rest) <= 2 and re.search(rf"^(class|def) {rest[0]}\b|^{rest[0]}\b.*=", source, re.M) is not None
    return False


def _engine_names() -> set[str]:
    """What the engine's module table names: paths relative to pdserve/engine/ (``kv/``, ``kv/cache.py``)."""
    names = set()
    for row in _table("module (under `pdserve/engine/`)"):
        first = _CELL_NAME.findall(row[0])
        names |= set(first)
        # A row of one package names its modules in its description, relative to it (`kv/`: `cache.py`, `connector/`).
        if len(first) == 1 and first[0].endswith("/"):
            names |= {first[0] + name for name in _CELL_NAME.findall(row[1])
                      if re.fullmatch(r"\w+(\.py|/)", name)}
    return names


def test_every_module_and_package_the_page_names_exists() -> None:
    page = _page()
    missing = [name for name in _DOTTED.findall(page) if not _resolves(name)]
    missing += [path for path in _PATH.findall(page) if not (ROOT / path).exists()]
    missing += [name for name in _engine_names() if not (ENGINE / name).exists()]
    assert missing == []


def test_every_package_and_engine_module_is_named() -> None:
    named_packages = {name for row in _table("package or module") for name in _CELL_NAME.findall(row[0])}
    top_level = {f"pdserve.{path.stem}" for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    top_level |= {f"pdserve.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py")}
    assert sorted(top_level - named_packages) == []
    assert sorted(named_packages - top_level) == []

    engine_names = _engine_names()
    engine_modules = {path.name for path in ENGINE.glob("*.py") if path.name != "__init__.py"}
    engine_modules |= {path.parent.name + "/" for path in ENGINE.glob("*/__init__.py")}
    # Subpackages of the engine's subpackages (kv/connector/) are named too.
    engine_modules |= {f"{path.parent.parent.name}/{path.parent.name}/" for path in ENGINE.glob("*/*/__init__.py")}
    assert sorted(engine_modules - engine_names) == []
