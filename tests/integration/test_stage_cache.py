"""Stage caching on the data stage against a real MLflow store: a rerun with nothing changed is
skipped and returns the earlier result; a changed config section, a changed source file (through
the raw snapshot taken on every run), a modified output or --force makes it run again, and each
decision is recorded on the stage's MLflow run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.tasks.cache import CACHE_SOURCE_TAG, CACHE_TAG, stamp_path
from forgeline.tasks.runner import STAGE_TAG, run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from tests.conftest import debug_config, output_overrides
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
