"""pyproject.toml's package list: a wheel (`pip install .`, not editable) holds every package of the namespace."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    """Each folder with an __init__.py under a package-dir root is in [tool.setuptools] packages under its
    k3deploy.<part> name, and nothing listed is missing on disk (a missing entry installs a package that cannot
    import the modules it depends on)."""
    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in st["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == set(st["packages"]), (sorted(found - set(st["packages"])), sorted(set(st["packages"]) - found))
