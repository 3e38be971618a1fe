"""Every third-party module that pykvq, its tests and its benchmarks import is declared by pyproject.toml's
`pykvq[test]`, directly or through the requirements of a package it declares. The machine CI runs on keeps packages
installed over many sessions, so an undeclared import passes there and fails on a fresh machine (scipy did: the
oracle of tests/test_passkey_pool.py). Other packages' requirements come from their installed metadata, so no
network is needed."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

REPO = Path(__file__).resolve().parent.parent
# pykvq/vendor holds upstream's gguf-py as pinned, whose own optional tools (its GUI editor) pykvq never runs
SCANNED = [REPO / "pykvq", REPO / "convert", REPO / "tests", REPO / "bench"]
VENDORED = REPO / "pykvq" / "vendor"
ON_SYS_PATH = [REPO / "tests", REPO / "bench", REPO / "bench" / "gpu"]
# installed by .ci/run on its own, without its llama.cpp build (the README says how): its tests skip without it
INSTALLED_APART = {"llama_cpp": "llama-cpp-python"}


def python_files() -> Iterator[Path]:
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            if VENDORED not in path.parents:
                yield path


def local_modules() -> set[str]:
    """What the project's own folders provide: its packages, and the helpers, scripts and packages in the folders
    that tests/conftest.py puts on sys.path."""
    names = {"pykvq", "convert"}
    for folder in ON_SYS_PATH:
        names.update(path.stem for path in folder.glob("*.py"))
        names.update(path.parent.name for path in folder.glob("*/__init__.py"))
    return names


def imported_modules(path: Path) -> set[str]:
    """The top-level names of a file's absolute imports, wherever they stand (a function's deferred import too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party_imports() -> dict[str, list[str]]:
    """Each third-party module with the files that import it."""
    local = local_modules() | set(sys.stdlib_module_names) | {"__future__"}
    users: dict[str, list[str]] = {}
    for path in python_files():
        for name in imported_modules(path) - local:
            users.setdefault(name, []).append(str(path.relative_to(REPO)))
    return users


def project_requirements(extras: set[str]) -> list[Requirement]:
    """What pyproject.toml declares for `pykvq[extras]`, its self-references (`pykvq[convert]`) followed."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    wanted, done = set(extras), set()
    while wanted - done:
        extra = (wanted - done).pop()
        done.add(extra)
        for requirement in map(Requirement, project["optional-dependencies"][extra]):
            if canonicalize_name(requirement.name) == "pykvq":
                wanted |= requirement.extras
            else:
                requirements.append(requirement)
    return requirements


def declared_closure(extras: set[str]) -> set[str]:
    """The distributions that installing `pykvq[extras]` brings, following the installed packages' own requirements
    (a declared package that is not installed counts, without its requirements)."""
    declared: set[str] = set()
    pending = [(requirement, frozenset[str]()) for requirement in project_requirements(extras)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement, parent_extras = pending.pop()
        environments = [{"extra": extra} for extra in parent_extras | {""}]
        if requirement.marker is not None and not any(requirement.marker.evaluate(env) for env in environments):
            continue
        name, wanted = canonicalize_name(requirement.name), frozenset(requirement.extras)
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        declared.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            requirements = []
        pending += [(Requirement(text), wanted) for text in requirements]
    return declared


@cache
def installed_distributions() -> dict[str, list[str]]:
    """Each importable top-level module with the installed distributions that provide it (one scan of them all)."""
    return metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    return {canonicalize_name(dist) for dist in installed_distributions().get(module, [])}


def test_every_third_party_import_is_declared_by_the_test_extra() -> None:
    declared = declared_closure({"test"})
    undeclared = {}
    for module, files in sorted(third_party_imports().items()):
        if module in INSTALLED_APART:
            continue
        if not distributions_of(module) & declared:
            undeclared[module] = files
    assert not undeclared, "imported but not declared in pyproject.toml's dependencies or test extra: " + "; ".join(
        f"{module} ({', '.join(files)})" for module, files in undeclared.items())


def test_the_check_sees_an_undeclared_package() -> None:
    """scipy is installed for the suite, but without the test extra nothing declares it."""
    assert "scipy" in third_party_imports()
    assert distributions_of("scipy") & declared_closure({"test"})
    assert not distributions_of("scipy") & declared_closure(set())


@pytest.mark.parametrize(("module", "distribution"), sorted(INSTALLED_APART.items()))
def test_what_is_exempt_is_imported_and_installed_by_ci(module: str, distribution: str) -> None:
    assert module in third_party_imports()
    assert f'"{distribution}[' in (REPO / ".ci" / "run").read_text()
