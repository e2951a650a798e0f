"""The layers import downwards only: configs <- model <- eval <- tasks <- flows, and inside model
the architecture <- parallel <- checkpoint <- inference <- training. Read from the source, every
import statement (those inside functions too), so a module started on its own (the rank program,
the in-training evaluation) is held to it like the rest. Importing forgeline changes no
environment variable: the entry points apply forgeline's defaults explicitly."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from forgeline.configs.environment import ENV_DEFAULTS
from tests.conftest import REPO_ROOT

LAYERS = ("configs", "model", "eval", "tasks", "flows")
# Inside model/: what each part may build on (a part imports its own rank and below).
MODEL_PARTS = {"transformer": 0, "lora": 0, "init": 0, "hf": 0, "families": 0, "fileio": 0, "spool": 0,
               "lifetime": 0,
               "parallel": 1, "checkpoint": 2, "inference": 3, "training": 4}


def modules() -> list[tuple[str, Path]]:
    found = []
    for layer in LAYERS:
        for path in sorted((REPO_ROOT / layer).rglob("*.py")):
            if "tasks" in path.relative_to(REPO_ROOT / layer).parts[:-1] and layer == "eval":
                continue  # eval/tasks/: lm-eval task hooks, copied next to the rendered suite
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            found.append((".".join(("forgeline", *parts)).removesuffix(".__init__"), path))
    return found


def forgeline_imports(path: Path) -> set[str]:
    """The forgeline modules it imports: `from PACKAGE import MODULE` names the module."""
    known = {module for module, _ in modules()}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            names |= submodules or {node.module}
    return {name for name in names if name.startswith("forgeline.")}


def rank(module: str) -> tuple[int, int]:
    """(layer, part inside model) of a forgeline module."""
    parts = module.split(".")
    layer = LAYERS.index(parts[1])
    part = MODEL_PARTS[parts[2]] if parts[1] == "model" and len(parts) > 2 else 0
    return layer, part


@pytest.mark.parametrize("module, path", modules(), ids=lambda value: value if isinstance(value, str) else "")
def test_no_module_imports_a_layer_above_its_own(module: str, path: Path) -> None:
    upward = [name for name in forgeline_imports(path) if rank(name) > rank(module)]
    assert not upward, f"{module} imports {upward}, above it in configs <- model <- eval <- tasks <- flows"


def test_no_modules_import_each_other() -> None:
    """No cycle of imports, those inside functions too (a function-level import back is how a cycle
    hides; tasks/cache.py and tasks/dvc_lock.py had one): a package's __init__ importing its own
    modules is no cycle."""
    graph = {module: forgeline_imports(path) - {module} for module, path in modules()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as err:
        pytest.fail(f"an import cycle: {' -> '.join(reversed(err.args[1]))}")


@pytest.mark.parametrize("package", sorted({p.parent for _, p in modules()}), ids=lambda p: str(p.name))
def test_every_package_says_what_it_holds_and_what_it_imports(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    assert "Import" in docstring or "import" in docstring, f"{package}/__init__.py: no word on its imports"


def test_importing_forgeline_sets_none_of_its_environment_defaults() -> None:
    """(Some libraries it imports set variables of their own, e.g. TORCHINDUCTOR_CACHE_DIR.)"""
    script = ("import importlib, json, os\n"
              f"for name in {[m for m, _ in modules()]!r}: importlib.import_module(name)\n"
              "print(json.dumps(sorted(k for k in ENV_DEFAULTS if k in os.environ)))")
    env = {k: v for k, v in os.environ.items() if k not in ENV_DEFAULTS}
    done = subprocess.run([sys.executable, "-c", "from forgeline.configs.environment import ENV_DEFAULTS\n"
                           + script], env=env, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", "importing forgeline set its environment defaults"


def test_the_rank_program_imports_no_launcher_libraries() -> None:
    """Every rank of every launch and restart imports the worker: transformers, mlflow and prefect
    would add seconds to each start (the ranks load Hugging Face weights with torch's own reader;
    only the logging rank imports mlflow, when it logs)."""
    script = ("import json, sys\nimport forgeline.model.training.worker\n"
              "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert not imported & {"transformers", "mlflow", "prefect", "lm_eval", "boto3", "dvc"}


def test_every_package_is_installed() -> None:
    """A wheel holds the packages pyproject.toml lists: every folder of the layers must be one."""
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    # eval/tasks/: lm-eval's task files, data of a package of its own (setuptools warned without it)
    packages = {module for module, path in modules() if path.name == "__init__.py"}
    assert listed == packages | {"forgeline.eval.tasks"}
