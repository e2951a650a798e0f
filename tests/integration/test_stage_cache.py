"""Stage caching on the data stage against a real MLflow store: a rerun with nothing changed is
skipped and returns the earlier result; a changed config section, a changed source file (through
the raw snapshot taken on every run), a modified output or --force makes it run again, and each
decision is recorded on the stage's MLflow run. In a DVC repository, the stage it runs or skips is
recorded in dvc.lock as `dvc commit` records it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from forgeline.configs import Config, load_config
from forgeline.tasks.cache import CACHE_SOURCE_TAG, CACHE_TAG, stamp_path
from forgeline.tasks.dvc_yaml import render_dvc_yaml
from forgeline.tasks.runner import STAGE_TAG, run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from tests.conftest import REPO_ROOT, debug_config, output_overrides
from tests.integration.helpers import VENV_BIN, run
from tests.unit.test_code_inputs import package_copy, touch

pytestmark = pytest.mark.integration


def last_data_run(cfg: Config):
    client = MlflowClient(resolve_tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.registry.experiment).experiment_id
    [latest] = client.search_runs([experiment], f"tags.`{STAGE_TAG}` = 'data'", max_results=1,
                                  order_by=["attributes.start_time DESC"])
    return latest


def small_corpus(root: Path) -> str:
    """A data.sources override: 24 short text files, so that each data stage run takes seconds."""
    (root / "corpus").mkdir()
    for i in range(24):
        (root / "corpus" / f"{i}.txt").write_text(f"Document {i}. " + "To be or not to be, that is "
                                                  f"the question number {i}. " * 40)
    return f"data.sources=[{{kind: files, path: '{root / 'corpus' / '*.txt'}'}}]"


def test_the_data_stage_is_skipped_only_while_inputs_and_outputs_are_unchanged(tmp_path: Path) -> None:
    corpus = small_corpus(tmp_path)
    cfg = debug_config(tmp_path, corpus, "data.val_fraction=0.3")
    first = run_stage(stage_named("data"), cfg)
    first_run = last_data_run(cfg)
    assert first_run.data.tags[CACHE_TAG] == "miss" and stamp_path(stage_named("data"), cfg).is_file()

    assert run_stage(stage_named("data"), cfg) == first
    hit = last_data_run(cfg)
    assert hit.data.tags[CACHE_TAG] == "hit" and hit.data.tags[CACHE_SOURCE_TAG] == first_run.info.run_id

    (Path(cfg.data.out_dir) / "val_docs.jsonl").write_text("edited by hand\n")
    run_stage(stage_named("data"), cfg)
    assert last_data_run(cfg).data.tags[f"{CACHE_TAG}.reason"].startswith("its output")
    assert last_data_run(cfg).data.tags[CACHE_TAG] == "miss"

    changed = debug_config(tmp_path, corpus, "data.val_fraction=0.4")
    run_stage(stage_named("data"), changed)
    assert last_data_run(cfg).data.tags[f"{CACHE_TAG}.reason"] == "changed: config"

    run_stage(stage_named("data"), changed, force=True)
    assert last_data_run(cfg).data.tags[f"{CACHE_TAG}.reason"] == "--force"
    run_stage(stage_named("data"), changed)
    assert last_data_run(cfg).data.tags[CACHE_TAG] == "hit"

    # A source file changes, the config does not: the raw snapshot, taken on every run, changes.
    (tmp_path / "corpus" / "0.txt").write_text("Document 0, rewritten. " + "Words upon words. " * 60)
    run_stage(stage_named("data"), changed)
    assert last_data_run(cfg).data.tags[f"{CACHE_TAG}.reason"] == "changed: sources"


def test_a_stage_reruns_when_a_module_only_its_helpers_import_changes(tmp_path: Path) -> None:
    """The data stage run by a copy of the package: model/hf.py, which tasks/pretrained.py imports
    and no stage record names, gets one more line; the next run misses the cache on its code."""
    package = package_copy(tmp_path / "code")
    overrides = output_overrides(tmp_path) + [small_corpus(tmp_path), "data.val_fraction=0.3"]
    script = ("from forgeline.configs.environment import apply_environment_defaults\n"
              "apply_environment_defaults()\n"
              "from forgeline.configs import load_config\n"
              "from forgeline.tasks.runner import run_stage\n"
              "from forgeline.tasks.stage import stage_named\n"
              f"run_stage(stage_named('data'), load_config('debug.yaml', {overrides!r}))\n")

    def run_data_stage() -> None:
        env = os.environ | {"PYTHONPATH": str(package.parent)}
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, timeout=600,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]

    cfg = debug_config(tmp_path)
    run_data_stage()
    assert last_data_run(cfg).data.tags[CACHE_TAG] == "miss"
    touch(package / "model" / "hf.py")
    run_data_stage()
    assert last_data_run(cfg).data.tags[f"{CACHE_TAG}.reason"] == "changed: code"


def dvc_repository(root: Path, sources: str) -> Path:
    """`root`/repo: git and DVC initialized, the package's folders (dvc.yaml's code deps), and
    configs/tiny.yaml -- the config dvc.yaml runs -- the debug one on `sources`, with dvc.yaml
    rendered for it (`forgeline stages --write`)."""
    repo = root / "repo"
    for layer in ("configs", "model", "eval", "tasks", "flows"):
        shutil.copytree(REPO_ROOT / layer, repo / layer, ignore=shutil.ignore_patterns("__pycache__"))
    config = yaml.safe_load((REPO_ROOT / "configs" / "debug.yaml").read_text())
    config["data"] |= {"sources": yaml.safe_load(sources.partition("=")[2]), "val_fraction": 0.3,
                       "executor": "pool"}
    config["registry"] |= {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}"}
    (repo / "configs" / "tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (repo / "dvc.yaml").write_text(render_dvc_yaml(root=repo))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    run([str(VENV_BIN / "dvc"), "init", "-q"], repo)
    return repo


def dvc(repo: Path, *args: str) -> str:
    return run([str(VENV_BIN / "dvc"), *args], repo).stdout


def lock_of(repo: Path) -> dict:
    return yaml.safe_load((repo / "dvc.lock").read_text())["stages"]


@pytest.mark.slow  # three data stage runs and four DVC commands: ~50 s on a busy 2-core machine
def test_the_data_stage_run_or_skipped_is_recorded_in_dvc_lock(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The data stage run in a DVC repository: dvc.lock then records it, with its snapshot
    (`sources`) and base stamp (`base`), byte for byte as `dvc commit -f` does; `dvc status` has
    only the always-changed stages to show and `dvc repro --dry` would run nothing else. Skipped
    as cached, it is recorded again. A run whose data dvc.yaml does not name (another
    data.val_fraction: another directory) records no data stage."""
    repo = dvc_repository(tmp_path, small_corpus(tmp_path))
    monkeypatch.chdir(repo)
    data = stage_named("data")
    cfg = load_config("configs/tiny.yaml")
    run_stage(data, cfg)
    assert set(lock_of(repo)) == {"base", "sources", "data"}
    assert json.loads(dvc(repo, "status", "--json", "base", "sources", "data")) == {
        "base": ["always changed"], "sources": ["always changed"]}
    dry = dvc(repo, "repro", "--dry", "data")
    assert [line for line in dry.splitlines() if line.startswith("Running stage")] == [
        "Running stage 'base':", "Running stage 'sources':"], dry
    written = (repo / "dvc.lock").read_text()
    dvc(repo, "commit", "-f", "base", "sources", "data")
    assert (repo / "dvc.lock").read_text() == written

    (repo / "dvc.lock").unlink()
    run_stage(data, cfg)
    assert last_data_run(cfg).data.tags[CACHE_TAG] == "hit"
    assert (repo / "dvc.lock").read_text() == written

    (repo / "dvc.lock").unlink()
    run_stage(data, load_config("configs/tiny.yaml", ["data.val_fraction=0.4"]))
    assert set(lock_of(repo)) == {"sources"}  # the snapshot of the same sources, where dvc.yaml says
