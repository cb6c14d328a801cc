"""pyproject.toml's setuptools configuration ships every module and data file.

Package discovery is limited to regular packages (`namespaces = false`): namespace
discovery walks every directory of the checkout following links, and the fake roots'
sysfs trees link back to their ancestors (tests/fakes/conftest.py), so `make setup`
would never end. The price is that a directory of modules without an __init__.py would
be left out of the package silently; this test says so instead. Data files are what
package-data globs (as setuptools does) match.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "nri_accel"
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _files(top: Path) -> list[Path]:
    return [p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_every_directory_of_modules_is_a_discovered_package() -> None:
    find = SETUPTOOLS["packages"]["find"]
    assert find["namespaces"] is False
    found = set(find_packages(where=str(REPO), include=find["include"]))
    with_modules = {p.parent.relative_to(REPO).as_posix().replace("/", ".")
                    for p in _files(PACKAGE) if p.suffix == ".py"}
    assert found == with_modules


def test_package_data_globs_match_every_data_file_of_the_demo() -> None:
    shipped = {p for pattern in SETUPTOOLS["package-data"]["nri_accel"]
               for p in PACKAGE.glob(pattern) if p.is_file()}
    data = {p for p in _files(PACKAGE / "demo") if p.suffix != ".py"}
    assert data
    assert data <= shipped, sorted(str(p) for p in data - shipped)
