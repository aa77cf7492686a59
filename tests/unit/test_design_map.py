"""docs/design.md's map stays true: it names every source file, and every source path it names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("engine", "ingress", "shared", "services", "bench")
SOURCE = (".py", ".cpp", ".cu")
# A path in backticks: a top-level folder of the checkout, then a name with a slash; `*`, `<` or `…` make it a
# pattern, not a path.
PATH = re.compile(r"^(?:engine|ingress|shared|services|bench|tests|scripts|compose|deploy|docs)/[\w./-]*$")
RESULT = re.compile(r"^[a-z_]+-\d{8}T\d{6}Z\.json$")  # a result file under bench/results/, cited by name


def _tracked() -> list[str]:
    """The checkout's files as git tracks them; without git (an sdist), those on disk."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]


def _source_files() -> list[str]:
    return sorted(f for f in _tracked() if f.split("/")[0] in PACKAGES and f.endswith(SOURCE)
                  and not f.endswith("__init__.py"))


def _named() -> set[str]:
    """What the design names in backticks (one path per span; `a` `b` are two spans)."""
    return set(re.findall(r"`([^`\n]+)`", DESIGN.read_text()))


def test_every_source_file_is_in_the_map():
    named = _named()
    missing = [f for f in _source_files() if f not in named]
    assert not missing, f"docs/design.md does not name these source files (add each to 'The files'): {missing}"


def test_every_path_the_design_names_exists():
    tracked = set(_tracked())
    folders = {str(Path(f).parent) for f in tracked} | {str(p) for f in tracked for p in Path(f).parents}
    stale = []
    for span in _named():
        path = span.rstrip("/")
        if not PATH.match(span) or "/" not in span:
            continue
        if path not in tracked and path not in folders and not (ROOT / path).exists():
            stale.append(span)
    assert not stale, f"docs/design.md names paths that do not exist: {sorted(stale)}"


def test_every_result_file_the_design_cites_exists():
    results = ROOT / "bench" / "results"
    cited = [s for s in _named() if RESULT.match(s)]
    assert cited, "the decisions cite no result file"
    missing = [s for s in cited if not (results / s).exists()]
    assert not missing, f"docs/design.md cites result files bench/results/ does not have: {sorted(missing)}"


def test_the_map_is_not_empty():
    assert len(_source_files()) > 50  # the listing works: git or the disk found the sources
