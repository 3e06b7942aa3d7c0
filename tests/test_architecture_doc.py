"""docs/architecture.md names every module of the library, and names none
that is gone: the map of the code stays the code's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "architecture.md").read_text()
NAMED = set(re.findall(r"`([\w/]*\w\.py)`", PAGE))


def test_every_module_of_mesh_is_on_the_page() -> None:
    missing = []
    for path in sorted((ROOT / "mesh").rglob("*.py")):
        rel = path.relative_to(ROOT / "mesh")
        if rel.name == "__init__.py" or rel.name == "__main__.py":
            continue
        # a module is named by its path below mesh/ or, in its package's
        # paragraph, by its own name
        if not {rel.as_posix(), rel.name, f"mesh/{rel.as_posix()}"} & NAMED:
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_every_module_the_page_names_exists() -> None:
    places = [ROOT / "mesh", ROOT / "tests", ROOT / "bench", ROOT / "tools", ROOT]
    gone = [
        name
        for name in sorted(NAMED)
        if not any((p / name).exists() or list(p.rglob(Path(name).name)) for p in places)
    ]
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
