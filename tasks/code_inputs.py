"""A stage's code inputs, derived from the source rather than listed: the modules of the
forgeline package that its entry points import, transitively -- every import statement, those
inside functions and under TYPE_CHECKING too, and the package `__init__.py` files an import runs
-- and the modules a stage starts as processes of their own, named by a literal
`"-m", "forgeline.X"` in an argument list (the rank program torchrun runs, the in-training
evaluation), or imports by a literal name (`importlib.import_module("forgeline.X")`). Importing
a module counts whether or not the stage calls into it: a superset costs a rerun, a module missed
would leave a stale output in place.

Files a module reads from the package rather than imports are listed here, by module
(PACKAGE_DATA): a stage that imports the module depends on every file under them, and on what
the Python files among them import.

Third-party code counts by version: the distributions that provide the modules from outside
forgeline and the standard library that those files import (their import statements, not what
those packages import in turn), each by its installed version. Files of installed packages that a
module reads, as the eval suite reads lm-eval's task YAMLs, count by content (INSTALLED_DATA).

A module counts as this process imported it: a stage that starts hours after the CLI imported its
code (eval after training) runs that code, not an edit made since, and its key says so
(`imported_source`); the next run reads the edit and runs the stage again.

Paths are relative to the checkout (PACKAGE_ROOT), as dvc.yaml names them. This module is light
(the standard library only): the CLI imports the records, which derive their code from it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PACKAGE = "forgeline"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the checkout of an editable install
PACKAGE_DATA = {
    # render_suite copies the task templates and the hook modules lm-eval loads from beside them
    # (`!function`), which import forgeline themselves (forgeline_code.py: the sandbox).
    "forgeline.eval.suite": ("eval/tasks",),
}
"""Files and folders of the package that a module reads, by module name, relative to the
checkout. A module that opens a file of the package (importlib.resources, Path(__file__)) must
be listed: tests/unit/test_code_inputs.py fails on one that is not."""
INSTALLED_DATA = {
    # The suite's templates include lm-eval's own task YAMLs (prompts, metrics), which a local edit
    # or a reinstall can change under the same lm-eval version.
    "forgeline.eval.suite": "forgeline.eval.suite:included_lm_eval_files",
    # The pairs stage's prompts are made of packaged conversations and checked against IFEval's prompts.
    "forgeline.tasks.pairs.prompts": "forgeline.tasks.pairs.prompts:prompt_files",
}
"""Files of installed third-party packages that a module reads, by module name: a reference to a
function () -> {name: sha256} of their contents."""


_IMPORTED_SOURCE: dict[Path, bytes] = {}
"""The source of each module of the package this process imported, as it was then."""


def imported_source(path: Path) -> bytes:
    """The bytes of a file of the package as this process runs them: as imported, for a module
    it imported, else as on disk."""
    path = path.resolve()
    return _IMPORTED_SOURCE[path] if path in _IMPORTED_SOURCE else path.read_bytes()


class _RecordingLoader(importlib.machinery.SourceFileLoader):
    """Keeps a module's source as it executes it."""

    def exec_module(self, module: object) -> None:
        _IMPORTED_SOURCE[Path(self.path).resolve()] = Path(self.path).read_bytes()
        super().exec_module(module)


class _SourceRecorder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: finds the package's modules as the finders after it do, and has
    their source kept as they are executed."""

    def find_spec(self, fullname: str, path: object,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] != PACKAGE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            if find is not None and (spec := find(fullname, path, target)) is not None:
                if type(spec.loader) is importlib.machinery.SourceFileLoader:
                    spec.loader = _RecordingLoader(spec.loader.name, spec.loader.path)
                return spec
        return None


def record_imported_sources() -> None:
    """From now on keep the source of each module of the package as it is imported; those
    imported already (the CLI's, a moment ago) are read now."""
    if not any(isinstance(finder, _SourceRecorder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourceRecorder())
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.split(".")[0] == PACKAGE and file and file.endswith(".py"):
            _IMPORTED_SOURCE.setdefault(Path(file).resolve(), Path(file).read_bytes())


def module_file(module: str) -> Path | None:
    """The source file of a module of the package (None: no such module, or none of ours)."""
    package, *parts = module.split(".")
    if package != PACKAGE or not parts:
        return None
    stem = PACKAGE_ROOT.joinpath(*parts)
    for candidate in (stem.parent / f"{stem.name}.py", stem / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(path: Path, module: str) -> frozenset[str]:
    """The names of forgeline modules the source of `module` at `path` imports or starts. A
    name may be a module's attribute (`from forgeline.x import name`): names that are no module
    are dropped by `code_files`."""
    return frozenset(name for name in _all_imports_of(path, module) if name.split(".")[0] == PACKAGE)


def third_party_imports_of(path: Path, module: str) -> frozenset[str]:
    """The top-level names of the modules from outside forgeline and the standard library that
    the source at `path` imports (`transformers`, `yaml`)."""
    return frozenset(top for name in _all_imports_of(path, module)
                     if (top := name.split(".")[0]) and top != PACKAGE and top not in sys.stdlib_module_names)


def _all_imports_of(path: Path, module: str) -> frozenset[str]:
    stat = path.stat()
    return _imports_of(str(path), module, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1024)
def _imports_of(path: str, module: str, mtime_ns: int, size: int) -> frozenset[str]:
    """Parsed once per version of a file: a stage's code is derived on every cache decision."""
    names: set[str] = set()
    is_package = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(Path(path).read_bytes(), path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            origin = absolute(node, module, is_package)
            names.add(origin)
            names.update(f"{origin}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.List | ast.Tuple):
            names.update(started_modules(node.elts))
        elif isinstance(node, ast.Call) and imported_by_name(node):
            names.add(node.args[0].value)
    return frozenset(names)


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` statement imports from, relative ones resolved."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".")
    anchor = package[:len(package) - node.level + is_package]
    return ".".join(anchor + ([node.module] if node.module else []))


def imported_by_name(call: ast.Call) -> bool:
    """Whether `call` is importlib.import_module("a.literal.name")."""
    function = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
    return (function == "import_module" and bool(call.args) and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str))


def started_modules(elements: list[ast.expr]) -> Iterable[str]:
    """X of each `"-m", "X"` pair in a literal list: a module started as a process."""
    for flag, name in zip(elements, elements[1:], strict=False):
        if (isinstance(flag, ast.Constant) and flag.value == "-m" and isinstance(name, ast.Constant)
                and isinstance(name.value, str)):
            yield name.value


def with_packages(module: str) -> list[str]:
    """`module` and the packages above it, which importing it runs: a.b.c -> a.b, a.b.c."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(2, len(parts) + 1)]


def code_files(entry_points: Iterable[str]) -> tuple[str, ...]:
    """Every file a stage runs or reads from the package, sorted: the modules of its entry points
    (`module:attribute` references or module names) and what they import or start, transitively,
    with the files they read (PACKAGE_DATA)."""
    return tuple(sorted(str(path.relative_to(PACKAGE_ROOT)) for path in reached(tuple(entry_points)).files))


@dataclass(frozen=True)
class Reached:
    """What a stage's entry points reach, transitively."""

    files: frozenset[Path]
    """The package's files it runs or reads."""
    modules: frozenset[str]
    """The package's modules among them."""
    third_party: frozenset[str]
    """The top-level names of the modules from outside forgeline and the standard library that
    those files import."""


def reached(entry_points: tuple[str, ...]) -> Reached:
    todo = [reference.partition(":")[0] for reference in entry_points]
    seen: set[str] = set()
    files: set[Path] = set()
    third_party: set[str] = set()

    def visit(path: Path, module: str) -> None:
        files.add(path)
        todo.extend(imports_of(path, module))
        third_party.update(third_party_imports_of(path, module))

    while todo:
        for module in with_packages(todo.pop()):
            if module in seen or (path := module_file(module)) is None:
                continue
            seen.add(module)
            visit(path, module)
            for data in PACKAGE_DATA.get(module, ()):
                for read in package_files(PACKAGE_ROOT / data):
                    if read.suffix == ".py":  # loaded as a module of its own: what it imports
                        visit(read, read.stem)
                    else:
                        files.add(read)
    # The modules the package's own hook files import by their names (forgeline_code imports
    # forgeline_safety beside it) are files of the package, no one else's.
    local = {path.stem for path in files}
    return Reached(frozenset(files), frozenset(seen), frozenset(third_party - local))


def installed_versions(import_names: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each distribution that provides one of `import_names`, by
    distribution name (`yaml` -> `{"PyYAML": "6.0.2"}`; torch's names its build, `2.13.0+cpu`); a
    name no installed distribution provides is recorded as None, so installing it counts too."""
    providers = _distributions_by_import_name()
    versions: dict[str, str | None] = {}
    for name in sorted(import_names):
        for distribution in providers.get(name, ()):
            versions[distribution] = metadata.version(distribution)
        if name not in providers:
            versions[name] = None
    return versions


@functools.lru_cache(maxsize=1)
def _distributions_by_import_name() -> dict[str, list[str]]:
    """Read once per process (it scans every installed distribution's file list, ~1 s): what
    this process imports is what was installed when it started."""
    return metadata.packages_distributions()


def installed_files(modules: Iterable[str]) -> dict[str, str]:
    """The sha256 of each file of an installed package that one of `modules` reads
    (INSTALLED_DATA), by name."""
    hashes: dict[str, str] = {}
    for module in sorted(modules):
        if module in INSTALLED_DATA:
            reference, _, function = INSTALLED_DATA[module].partition(":")
            hashes |= getattr(importlib.import_module(reference), function)()
    return hashes


def package_files(root: Path) -> list[Path]:
    """The files at `root` (a file or a directory) that DVC hashes: all but what .dvcignore
    leaves out (__pycache__/, *.pyc)."""
    if root.is_file():
        return [root]
    return [path for path in root.rglob("*") if path.is_file() and "__pycache__" not in path.parts
            and path.suffix != ".pyc"]


def collapsed(files: Iterable[str]) -> tuple[str, ...]:
    """`files` with each directory all of whose files are among them named instead of its files
    (the largest such directories): dvc.yaml's deps and the README's code column, shorter to
    read and meaning the same files."""
    used = set(files)
    return tuple(_collapse(PACKAGE_ROOT, used))


def _collapse(directory: Path, used: set[str]) -> list[str]:
    entries: list[str] = []
    for child in sorted(directory.iterdir()):
        name = str(child.relative_to(PACKAGE_ROOT))
        if child.is_file() and name in used:
            entries.append(name)
        elif child.is_dir() and any(file.startswith(f"{name}/") for file in used):
            inside = {str(path.relative_to(PACKAGE_ROOT)) for path in package_files(child)}
            entries += [name] if inside <= used else _collapse(child, used)
    return entries


# Whatever derives a key imports this module first: from here on, imports are recorded.
record_imported_sources()
