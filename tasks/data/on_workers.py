"""What the data stage runs on a Dask cluster's workers before its partition work: a look at the
code they would run (`code_here`, which executor.py compares with this process's) and their setup
(`ForgelineWorker`: URL credentials masked in their log records, imported sources kept).

Pickled by value (registered with cloudpickle below): a worker runs these as this process has
them, whatever forgeline it has installed, if any. `code_here` imports nothing there beyond the
standard library: it finds the modules' files as an import would, without importing them, so a
worker with a memory limit keeps it for the partition work (tests/integration/test_data_oom.py).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import cloudpickle
from distributed.diagnostics.plugin import WorkerPlugin


def code_here(modules: list[str], distributions: list[str],
              recorder: str) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """The sha256 of the source this process runs for each of `modules` (None: it finds no such
    module), and the installed version of each of `distributions` (None: not installed). A
    module imported already counts as it was imported, when the module `recorder`
    (tasks/code_inputs.py) kept its source then, else as its file is now."""
    kept = getattr(sys.modules.get(recorder), "_IMPORTED_SOURCE", {})
    hashes: dict[str, str | None] = {}
    for module in modules:
        path = module_path(module)
        if path is None:
            hashes[module] = None
            continue
        source = kept[path] if module in sys.modules and path in kept else path.read_bytes()
        hashes[module] = hashlib.sha256(source).hexdigest()
    versions: dict[str, str | None] = {}
    for distribution in distributions:
        try:
            versions[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            versions[distribution] = None
    return hashes, versions


def module_path(name: str) -> Path | None:
    """The source file this process runs as module `name`: the imported module's, else the one
    its finders would import -- asked package by package as importing does, but without running
    the packages' __init__ files (forgeline.configs's imports pydantic)."""
    spec, search = None, None
    parts = name.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        loaded: ModuleType | None = sys.modules.get(prefix)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else found_spec(prefix, search)
        if spec is None:
            return None
        search = spec.submodule_search_locations
    return Path(spec.origin).resolve() if spec.has_location and spec.origin else None


def found_spec(name: str, search: list[str] | None) -> importlib.machinery.ModuleSpec | None:
    """The spec the first of sys.meta_path's finders gives for `name`, as importing asks them."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None and (spec := find(name, search)) is not None:
            return spec
    return None


class ForgelineWorker(WorkerPlugin):
    """Sets a worker up as forgeline's own processes are: URL credentials (configs/redaction.py)
    masked in every log record it makes, whichever handler emits it -- the worker's own, and
    Prefect's, which it sets up only when its first task run arrives -- and the source of each
    forgeline module kept as it imports it (tasks/code_inputs.py): a later `code_here` on a
    long-lived worker sees the code it runs, not its files edited or reinstalled since."""

    name = "forgeline"

    def setup(self, worker: object) -> None:
        from forgeline.configs.redaction import install_log_scrubber, scrub_every_record
        from forgeline.tasks.code_inputs import record_imported_sources

        install_log_scrubber()
        scrub_every_record()
        record_imported_sources()


cloudpickle.register_pickle_by_value(sys.modules[__name__])
