"""A stage's code inputs are derived from what its entry points import (tasks/code_inputs.py), not
listed by hand: the helpers they import, the modules they start as processes and the package
files they read are among them, and a one-byte change in any of them changes the stage's cache
key. The changes are made in a copy of the package, run in a process of its own."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from forgeline.tasks.code_inputs import (
    PACKAGE_DATA,
    code_files,
    collapsed,
    imports_of,
    installed_versions,
    third_party_imports_of,
)
from forgeline.tasks.stage import BASE, STAGE_NAMES, STAGES, stage_named
from tests.conftest import REPO_ROOT

LAYERS = ("configs", "model", "eval", "tasks", "flows")


@pytest.mark.parametrize("stage, expected", [
    # eval/lm.py imports these; tasks/evaluate.py imports these (the hand-written list had neither).
    ("eval", {"model/inference.py", "model/hf.py", "tasks/pretrained.py", "tasks/train/job.py",
              "eval/lm.py", "eval/tasks/forgeline_boolq.yaml", "eval/sandbox.py"}),
    # The rank program torchrun starts, and the in-training evaluation the ranks start.
    ("train", {"model/training/worker.py", "eval/periodic.py", "tasks/train/launch.py"}),
    # The gate re-evaluates a champion: the suite, its templates and the lm-eval model class.
    ("register", {"tasks/promote.py", "eval/suite.py", "eval/tasks/forgeline_mmlu.yaml", "eval/lm.py"}),
    ("data", {"tasks/data/clean.py", "tasks/pretrained.py", "model/training/shards.py"}),
])
def test_a_stages_code_is_what_its_entry_points_import_start_and_read(stage: str, expected: set[str]) -> None:
    assert expected <= set(stage_named(stage).code_files)


def test_a_stage_runs_nothing_it_does_not_import() -> None:
    assert not any(name.startswith(("flows/", "tasks/data/")) for name in stage_named("eval").code_files)
    assert not any(name.startswith("tasks/train/") for name in stage_named("data").code_files)
    assert "tasks/promote.py" not in stage_named("eval").code_files


def test_a_function_local_import_counts() -> None:
    """eval/periodic.py imports the suite inside its function."""
    assert "eval/suite.py" in code_files(("forgeline.eval.periodic",))


def test_every_way_a_module_is_reached_is_read_from_the_source(tmp_path: Path) -> None:
    source = tmp_path / "job.py"
    source.write_text(
        "from __future__ import annotations\n"
        "import json\n"
        "import forgeline.model.transformer\n"
        "from forgeline.tasks import atomic\n"
        "from . import sibling\n"
        "from .train.launch import run_streaming\n"
        "def run():\n"
        "    from forgeline.eval.suite import render_suite\n"
        "    importlib.import_module('forgeline.eval.lm')\n"
        "    return [sys.executable, '-m', 'forgeline.model.training.worker', '--config', 'x']\n")
    assert imports_of(source, "forgeline.tasks.job") == {
        "forgeline.model.transformer", "forgeline.tasks", "forgeline.tasks.atomic", "forgeline.tasks.sibling",
        "forgeline.tasks.train.launch", "forgeline.tasks.train.launch.run_streaming", "forgeline.eval.suite",
        "forgeline.eval.suite.render_suite", "forgeline.eval.lm", "forgeline.model.training.worker"}


def test_a_folder_stands_for_its_files_only_where_every_one_is_used() -> None:
    for stage in STAGES:
        for entry in stage.code:
            files = [entry] if (REPO_ROOT / entry).is_file() else [
                str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / entry).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
            assert set(files) <= set(stage.code_files), (stage.name, entry)
    assert "eval" in stage_named("eval").code  # every file of eval/ is read or run
    assert "model" not in stage_named("eval").code  # not the planner, model/parallel/planner.py
    assert collapsed(["tasks/train/job.py"]) == ("tasks/train/job.py",)


def reads_package_files(path: Path) -> bool:
    """Whether the source opens files of the package: resources.files("forgeline..."), __file__."""
    def opens(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "__file__"
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "files" and bool(node.args) and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("forgeline"))
    return any(map(opens, ast.walk(ast.parse(path.read_text()))))


# Modules that open files of the package without a stage's output depending on them.
READS_NO_STAGE_INPUT = {
    "configs/loader.py": "the shipped configs, by name, for the CLI: a stage is given its config",
    "tasks/code_inputs.py": "the package's sources, to hash them",
    "tasks/stage.py": "the checkout (PACKAGE_ROOT), to hash the sources",
    "flows/kubernetes.py": "deploy/'s job template, for `forgeline deploy`: no stage",
}


def test_every_module_that_reads_package_files_lists_them() -> None:
    listed = {module.removeprefix("forgeline.").replace(".", "/") + ".py" for module in PACKAGE_DATA}
    readers = {str(p.relative_to(REPO_ROOT)) for layer in LAYERS for p in (REPO_ROOT / layer).rglob("*.py")
               if "__pycache__" not in p.parts and reads_package_files(p)}
    assert readers - set(READS_NO_STAGE_INPUT) == listed


def package_copy(root: Path) -> Path:
    """A `forgeline` package made of copies of this checkout's folders, under `root`."""
    package = root / "forgeline"
    for layer in LAYERS:
        shutil.copytree(REPO_ROOT / layer, package / layer, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def code_hashes(package: Path) -> dict[str, str]:
    """Each stage's code hash, and the base step's code, computed by the copy's own code."""
    script = ("import json; from forgeline.tasks.stage import STAGES, BASE\n"
              "print(json.dumps({s.name: s.code_hash() for s in STAGES} | {'base-code': BASE.code}))")
    done = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(package.parent)},
                          capture_output=True, text=True, timeout=120, check=True, cwd=package.parent)
    return json.loads(done.stdout)


def touch(path: Path) -> None:
    with open(path, "a") as f:
        f.write("# one more line\n")


def test_a_byte_in_a_helper_module_changes_the_key_of_each_stage_that_runs_it(tmp_path: Path) -> None:
    package = package_copy(tmp_path)
    before = code_hashes(package)
    assert before == {s.name: s.code_hash() for s in STAGES} | {"base-code": list(BASE.code)}

    # The stages that load a model: those that train, evaluate, register, or sample (pairs).
    loads_a_model = {"pairs", "train", "sft", "preference", "eval", "register"}
    touch(package / "model" / "inference.py")  # imported by eval/lm.py, not by the data stage
    after = code_hashes(package)
    assert {name for name in before if after[name] != before[name]} == loads_a_model

    # A template the suite renders: pairs reads IFEval's prompts through eval/suite.py.
    touch(package / "eval" / "tasks" / "forgeline_boolq.yaml")
    again = code_hashes(package)
    assert {name for name in after if again[name] != after[name]} == loads_a_model

    touch(package / "tasks" / "data" / "clean.py")
    last = code_hashes(package)
    assert {name for name in again if last[name] != again[name]} == {"data"}

    touch(package / "configs" / "schema.py")  # imported by every stage
    shared = code_hashes(package)
    assert {name for name in last if shared[name] != last[name]} == set(STAGE_NAMES)


def test_a_module_keys_as_this_process_imported_it_not_as_edited_since(tmp_path: Path) -> None:
    """A stage that starts after its code was edited on disk (eval, hours after the CLI imported
    it) runs the imported code: its key is of that code, and a new process keys the edit."""
    package = package_copy(tmp_path)
    script = """import json, sys
from pathlib import Path
from forgeline.tasks.stage import stage_named
import forgeline.model.inference  # imported, as the eval stage imports it
before = {name: stage_named(name).code_hash() for name in ("eval", "data")}
for edited in ("model/inference.py", "tasks/data/clean.py"):  # the second is not imported here
    with open(Path(sys.argv[1]) / edited, "a") as f:
        f.write("# edited after import\\n")
print(json.dumps([before, {name: stage_named(name).code_hash() for name in before}]))
"""
    done = subprocess.run([sys.executable, "-c", script, str(package)], env={"PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path)
    before, after = json.loads(done.stdout)
    assert after["eval"] == before["eval"]  # the edit is not what this process runs
    assert after["data"] != before["data"]  # a module it has not imported counts as on disk
    assert code_hashes(package)["eval"] != before["eval"]  # the next run keys the edit


def test_the_third_party_modules_a_file_imports_are_read_from_its_source(tmp_path: Path) -> None:
    source = tmp_path / "job.py"
    source.write_text(
        "from __future__ import annotations\n"
        "import json, os.path\n"
        "import transformers.models\n"
        "from yaml import safe_load\n"
        "from forgeline.tasks import atomic\n"
        "from . import sibling\n"
        "def run():\n"
        "    import datasketch\n")
    assert third_party_imports_of(source, "forgeline.tasks.job") == {"transformers", "yaml", "datasketch"}


def test_a_stage_keys_the_installed_version_of_each_distribution_its_code_imports() -> None:
    data, eval_ = stage_named("data").package_versions(), stage_named("eval").package_versions()
    assert {"datasketch", "tokenizers", "transformers", "PyYAML"} <= set(data)  # yaml is PyYAML's
    assert {"lm_eval", "transformers", "tokenizers"} <= set(eval_) and "datasketch" not in eval_
    assert eval_["transformers"] == metadata.version("transformers")
    assert eval_["torch"] == torch.__version__  # its build too: 2.13.0+cpu, or +cu128


def test_an_import_no_installed_distribution_provides_is_recorded_as_absent() -> None:
    assert installed_versions({"no_such_module_anywhere", "yaml"}) == {
        "no_such_module_anywhere": None, "PyYAML": metadata.version("PyYAML")}


def test_the_eval_suite_keys_the_lm_eval_task_files_it_includes_by_content() -> None:
    files = stage_named("eval").installed_files()
    # forgeline_arc_challenge includes arc_challenge.yaml, which includes arc_easy.yaml beside it;
    # hellaswag's YAML names its hook module (`!function utils.process_docs`).
    assert {"lm_eval/tasks/arc/arc_easy.yaml", "lm_eval/tasks/arc/arc_challenge.yaml",
            "lm_eval/tasks/hellaswag/utils.py"} <= set(files)
    assert stage_named("data").installed_files() == {}


def test_a_dask_workers_look_at_its_code_imports_none_of_it() -> None:
    """What the data stage asks each worker of a cluster (tasks/data/on_workers.py `code_here`):
    the hash of every module its partition functions import and the libraries' versions, found
    as an import would find them but importing none (a worker's memory is for the partitions)."""
    from forgeline.tasks.code_inputs import imported_source, module_file, reached

    modules = sorted(reached(("forgeline.tasks.data.work",)).modules)
    script = ("import json, sys\nfrom forgeline.tasks.data.on_workers import code_here\n"
              "before = set(sys.modules)\n"
              f"hashes, versions = code_here({modules!r}, ['numpy', 'no-such-distribution'], "
              "'forgeline.tasks.code_inputs')\n"
              "print(json.dumps([hashes, versions, sorted(set(sys.modules) - before)]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          check=True, cwd=REPO_ROOT)
    hashes, versions, imported = json.loads(done.stdout.splitlines()[-1])
    here = {name: hashlib.sha256(imported_source(module_file(name))).hexdigest() for name in modules}
    assert hashes == here
    assert versions == {"numpy": metadata.version("numpy"), "no-such-distribution": None}
    assert "forgeline.configs.schema" in modules  # whose package imports pydantic
    heavy = {"forgeline"} | reached(("forgeline.tasks.data.work",)).third_party  # numpy, pydantic...
    assert [name for name in imported if name.split(".")[0] in heavy] == []
