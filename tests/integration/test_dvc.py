"""`dvc repro` of dvc.yaml in a fresh copy of this repository, on the debug sizes: every stage
runs once, `dvc status` is then clean (but for `sources`, which always reads its inputs again),
the outputs go to the default (local) remote and to an S3 remote (a real moto server on
127.0.0.1) and come back, `dvc plots` shows the loss curve, and `dvc exp run -S` of a config
value is an experiment `dvc metrics diff` compares. forgeline's stage cache decides as `dvc repro`
does: the same change -- to each stage's config section, to its code, to an upstream output, an
eval rerun whose scores do not move -- reruns the same stages in both. Inputs from outside the
repository (a base rewritten in place, raw files): tests/integration/test_dvc_inputs.py.

The stages DVC runs report to the session's real Prefect server (PREFECT_API_URL), as on a team's
machine, instead of each starting a temporary one (test_pipeline_e2e.py runs that way).
The `forgeline` that DVC runs is the copy's own code (`PYTHONPATH` to a `forgeline` package made
of the copy's folders), so a change to a source file there is one that DVC hashes and forgeline
runs and hashes alike."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from forgeline.configs import Config, load_config
from forgeline.tasks.cache import CACHE_TAG
from forgeline.tasks.dvc_yaml import render_dvc_yaml
from forgeline.tasks.runner import STAGE_TAG
from forgeline.tasks.stage import STAGE_NAMES
from forgeline.tasks.tracking import dvc_hash
from tests.conftest import REPO_ROOT
from tests.integration.conftest import make_bucket
from tests.integration.helpers import VENV_BIN, run

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

DVC = str(VENV_BIN / "dvc")


LAYERS = ("configs", "model", "eval", "tasks", "flows")


@pytest.fixture(scope="module", autouse=True)
def prefect_api(session_prefect_api: str) -> Iterator[str]:
    """The session's `prefect server start`, named by PREFECT_API_URL to every process started
    here, the module's `dvc repro` (a fixture of its own) too."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_API_URL", session_prefect_api)
        yield session_prefect_api


def fresh_repo(root: Path) -> Path:
    """The repository's files (committed or not, minus ignored ones) in a new git repo,
    `root`/repo, with configs/tiny.yaml -- which dvc.yaml runs -- shrunk to the debug sizes."""
    repo = root / "repo"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if (REPO_ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, repo / name)
    debug = yaml.safe_load((repo / "configs" / "debug.yaml").read_text())
    (repo / "configs" / "tiny.yaml").write_text(yaml.safe_dump(debug, sort_keys=False))
    write_dvc_yaml(repo)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    commit(repo, "fresh")
    return repo


def params(repo: Path) -> Config:
    """The config dvc.yaml runs in `repo`: where its outputs are, relative to the repository."""
    return load_config(repo / "configs" / "tiny.yaml")


def write_dvc_yaml(repo: Path) -> None:
    """dvc.yaml for the config there (`forgeline stages --write`): its directories follow the keys
    that name the run."""
    (repo / "dvc.yaml").write_text(render_dvc_yaml(root=repo))


def code_of(repo: Path) -> dict[str, str]:
    """Variables under which `forgeline` runs the code of `repo`: a `forgeline` package beside it
    whose folders are the repo's."""
    package = repo.parent / "code" / "forgeline"
    package.mkdir(parents=True, exist_ok=True)
    for layer in LAYERS:
        (package / layer).unlink(missing_ok=True)
        (package / layer).symlink_to(repo / layer)
    return {"PYTHONPATH": str(package.parent)}


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return run([DVC, *args], repo, env=code_of(repo))


def commit(repo: Path, message: str) -> None:
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], cwd=repo,
                   check=True)


def find_key(tree: object, key: str) -> object:
    """The value under `key` anywhere in nested dicts (DVC nests metrics by revision and file)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            if (found := find_key(value, key)) is not None:
                return found
    return None


def stages_run(repro_output: str) -> list[str]:
    return [line.split("'")[1] for line in repro_output.splitlines() if line.startswith("Running stage")]


# The stages that read inputs from outside the repository again on every `dvc repro` (the raw
# sources, the base model.init_from resolves to), and leave their output untouched if unchanged.
ALWAYS_CHANGED = ("base", "sources")


def others(ran: list[str]) -> list[str]:
    """The stages run but for the always-changed ones, which have to be among them."""
    assert set(ALWAYS_CHANGED) <= set(ran), ran
    return [name for name in ran if name not in ALWAYS_CHANGED]


def stages_restored(repro_output: str) -> list[str]:
    """The stages `dvc repro` restored from its run cache (the outputs it recorded for the same deps
    and params) instead of running them."""
    return [line.split("'")[1] for line in repro_output.splitlines()
            if line.endswith("is cached - skipping run, checking out outputs")]


def status(repo: Path, *targets: str) -> dict:
    """`dvc status` of `targets` alone, or of every stage less the always-changed ones."""
    shown = json.loads(dvc(repo, "status", "--json", *targets).stdout)
    if not targets:
        for name in ALWAYS_CHANGED:
            assert shown.pop(name) == ["always changed"]
    return shown


def round_trip(repo: Path, fields: tuple[str, ...], *args: str) -> None:
    """Push the outputs (of these config fields), lose them and the cache, pull them back: the same
    bytes. `args`: for `dvc push` and `dvc pull` (stages, remote)."""
    outputs = [repo / params(repo).value(field) for field in fields]
    before = [dvc_hash(out) for out in outputs]
    dvc(repo, "push", *args)
    for path in [*outputs, repo / ".dvc" / "cache"]:
        shutil.rmtree(path)
    dvc(repo, "pull", *args)
    assert [dvc_hash(out) for out in outputs] == before


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh copy of the repository after its first `dvc repro`, committed; tests work on copies."""
    repo = fresh_repo(tmp_path_factory.mktemp("reproduced"))
    first = dvc(repo, "repro")
    assert others(stages_run(first.stdout)) == ["data", "train", "eval", "register"]
    assert status(repo) == {}
    commit(repo, "first run")
    return repo


def copy_of(repo: Path, root: Path) -> Path:
    shutil.copytree(repo, root / "repo", symlinks=True)
    return root / "repo"


@pytest.mark.slow
def test_dvc_repro_records_the_data_version_moves_the_outputs_and_runs_experiments(
        reproduced: Path, tmp_path: Path, s3_endpoint: str) -> None:
    repo = copy_of(reproduced, tmp_path)
    # The data version MLflow recorded is the hash dvc.lock holds for the data stage's output.
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    [data_out] = lock["stages"]["data"]["outs"]
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    [data_run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                                    filter_string=f"tags.`{STAGE_TAG}` = 'data'")
    assert data_run.data.tags["forgeline.data.dvc_md5"] == data_out["md5"]
    cfg = params(repo)
    metrics = json.loads((repo / cfg.eval.out_dir / "metrics.json").read_text())
    shown = json.loads(dvc(repo, "metrics", "show", "--json").stdout)
    assert find_key(shown, "overall") == pytest.approx(metrics["overall"])

    # Remotes: the default local one (dvc-storage/), then S3.
    round_trip(repo, ("data.raw_dir", "data.out_dir", "train.out_dir"))
    assert status(repo) == {}
    assert (repo / "dvc-storage" / "files" / "md5").is_dir()
    make_bucket("dvc")
    dvc(repo, "remote", "add", "s3", "s3://dvc/forgeline")
    dvc(repo, "remote", "modify", "s3", "endpointurl", s3_endpoint)
    round_trip(repo, ("data.raw_dir", "data.out_dir", "train.out_dir"), "-r", "s3")
    assert status(repo) == {}

    # The loss curve, one point per step.
    plots = json.loads(dvc(repo, "plots", "show", "--json").stdout)["data"]
    assert plots[f"{cfg.eval.out_dir}/dimensions.png"][0]["type"] == "image"
    [curve] = plots[f"{cfg.train.out_dir}/loss.csv"]
    assert {int(point["step"]) for point in find_key(curve["content"], "values")} == set(range(1, 21))

    # An experiment with more items changes the scores: eval reruns, register records them (in the
    # same run's directories: eval keys do not name the run).
    third = dvc(repo, "exp", "run", "-S", "configs/tiny.yaml:eval.dimensions.reasoning.limit=5")
    assert others(stages_run(third.stdout)) == ["eval", "register"]
    assert status(repo) == {}
    diff = json.loads(dvc(repo, "metrics", "diff", "--json").stdout)  # against the first run
    changed = diff[f"{cfg.eval.out_dir}/metrics.json"]
    assert changed and all(entry["old"] != entry["new"] for entry in changed.values()), diff


def set_value(key: str, value: object):
    def change(repo: Path) -> None:
        path = repo / "configs" / "tiny.yaml"
        config = yaml.safe_load(path.read_text())
        section, *keys, last = key.split(".")
        target = config[section]
        for name in keys:
            target = target.setdefault(name, {})
        target[last] = value
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        write_dvc_yaml(repo)  # `forgeline stages --write`: a key that names the run moves its directories
    return change


def touch_code(path: str):
    def change(repo: Path) -> None:
        with open(repo / path, "a") as f:
            f.write("\n# touched by the test\n")
    return change


def edit_output(field: str, path: str):
    def change(repo: Path) -> None:
        with open(repo / params(repo).value(field) / path, "a") as f:
            f.write('{"source": "by hand", "name": "x", "text": "an edit"}\n')
    return change


# What changes, and the stages `dvc repro` then reruns or restores (besides the always-changed
# ones), in pipeline order. A stage's code is what it imports (tasks/code_inputs.py): eval's
# helpers are train's (the in-training evaluation) and register's (the gate re-evaluates) too.
# A change marked FORGELINE_RUN is run by `forgeline run` instead, without DVC.
FORGELINE_RUN = "forgeline run"
CHANGES = [
    ("the register stage's config section", set_value("registry.promotion_margin", 0.01), ["register"]),
    ("the eval stage's config section, its scores unchanged", set_value("eval.during_training.limit", 2),
     ["eval"]),
    ("the data stage's output, edited by hand", edit_output("data.out_dir", "val_docs.jsonl"), ["data"]),
    # A module only imported helpers use (eval/lm.py), in no record: the hand-written lists missed
    # it in eval's and register's. Train resumes at its last step, its output unchanged. Run by
    # `forgeline run`: it records what it ran and skipped in dvc.lock, as `dvc commit` does, so
    # that DVC has nothing left to do; register finds the version it registered for the same
    # checkpoint and scores.
    ("a module train, eval and register import", touch_code("model/inference.py"),
     ["train", "eval", "register"], FORGELINE_RUN),
    ("the train stage's config section", set_value("train.lr", 0.002), ["train", "eval", "register"]),
    # build.json, in the data's output, records the code: train resumes, eval scores the same.
    # (Not the data stage's config section: like register's and eval's here, its key holds it,
    # tests/unit/test_stage_records.py, and the four stage runs it takes are CI's longest minutes.)
    ("the data stage's code", touch_code("tasks/data/clean.py"), ["data", "train", "eval"]),
]


def forgeline_runs(repo: Path, known: set[str]) -> list[str]:
    """The stages whose cache decided to run them in the stage runs MLflow recorded since `known`
    (`known` is updated)."""
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("forgeline-debug").experiment_id
    ran = []
    runs = client.search_runs([experiment], order_by=["attributes.start_time ASC"], max_results=5000)
    for stage_run in runs:
        info, tags = stage_run.info, stage_run.data.tags
        if info.run_id not in known and tags.get(STAGE_TAG) in STAGE_NAMES and tags[CACHE_TAG] == "miss":
            ran.append(tags[STAGE_TAG])
        known.add(info.run_id)
    return ran


@pytest.mark.slow
# 20 stage runs through DVC, 10 of them the always-changed base and sources, and a `forgeline run`:
# about 8 min on this 2-core machine.
@pytest.mark.timeout(3000)
def test_the_stage_cache_decides_as_dvc_repro_does(reproduced: Path, tmp_path: Path) -> None:
    """After each change, `dvc status` and `forgeline status` name the same stages; `dvc repro` then
    runs the stages forgeline's cache runs (DVC restores from its run cache what it recorded for
    the same deps, an output edited by hand: forgeline, which keeps no copies, would run the stage
    again, as its status said), and so does `forgeline run`, which leaves DVC nothing to do;
    afterwards neither has anything left to do."""
    repo = copy_of(reproduced, tmp_path)
    known: set[str] = set()
    forgeline_runs(repo, known)
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    for what, change, expected, *by in CHANGES:
        change(repo)
        assert changed_per_forgeline(repo) == sorted(status(repo), key=STAGE_NAMES.index), what
        if by == [FORGELINE_RUN]:
            versions = [version.version for version in client.search_model_versions()]
            forgeline = [str(VENV_BIN / "forgeline"), "run", "--config", "configs/tiny.yaml"]
            run(forgeline, repo, env=code_of(repo))
            assert forgeline_runs(repo, known) == expected, what
            assert [version.version for version in client.search_model_versions()] == versions, what
            assert changed_per_forgeline(repo) == [] and status(repo) == {}, what
            assert others(stages_run(dvc(repo, "repro", "--dry").stdout)) == [], what
            continue
        output = dvc(repo, "repro").stdout
        ran = others(stages_run(output))
        restored = stages_restored(output)
        assert sorted(ran + restored, key=STAGE_NAMES.index) == expected, \
            f"{what}: dvc repro ran {ran} and restored {restored}"
        assert forgeline_runs(repo, known) == ran, what
    # A stage left to run after a change would run at the next one's repro, beside its expected
    # stages: only the last change needs the check.
    assert changed_per_forgeline(repo) == [] and status(repo) == {}


def changed_per_forgeline(repo: Path) -> list[str]:
    """The stages `forgeline status` says would run."""
    shown = run([str(VENV_BIN / "forgeline"), "status", "--json"], repo, env=code_of(repo))
    return [name for name, reason in json.loads(shown.stdout.splitlines()[-1]).items() if reason]
