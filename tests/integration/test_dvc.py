"""`dvc repro` of dvc.yaml in a fresh copy of this repository, on the debug sizes: every stage
runs once, `dvc status` is then clean (but for `sources`, which always reads its inputs again),
the outputs go to the default (local) remote and to an S3 remote (a real moto server on
127.0.0.1) and come back, `dvc plots` shows the loss curve, a change that touches only eval
reruns eval (and register only when the scores moved), and `dvc exp run -S` of a config value
is an experiment `dvc metrics diff` compares. The data stage on its own: the raw snapshot is
rewritten, and the data rebuilt, only when a raw input changed, and the shards a forced rerun
writes are byte-identical."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from forgeline.tasks.tracking import dvc_hash
from tests.conftest import REPO_ROOT
from tests.integration.conftest import make_bucket
from tests.integration.helpers import VENV_BIN, run

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

DVC = str(VENV_BIN / "dvc")


def fresh_repo(dest: Path) -> Path:
    """The repository's files (committed or not, minus ignored ones) in a new git repo, with
    configs/tiny.yaml -- which dvc.yaml runs -- shrunk to the debug sizes."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if (REPO_ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, dest / name)
    debug = yaml.safe_load((dest / "configs" / "debug.yaml").read_text())
    (dest / "configs" / "tiny.yaml").write_text(yaml.safe_dump(debug, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    commit(dest, "fresh")
    return dest


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


def status(repo: Path, *targets: str) -> dict:
    """`dvc status` of `targets` alone, or of every stage less `sources`: that one always changed."""
    shown = json.loads(run([DVC, "status", "--json", *targets], repo).stdout)
    if not targets:
        assert shown.pop("sources") == ["always changed"]
    return shown


def round_trip(repo: Path, names: tuple[str, ...], *args: str) -> None:
    """Push the outputs, lose them and the cache, pull them back: the same bytes. `args`: for
    `dvc push` and `dvc pull` (stages, remote)."""
    outputs = [repo / "artifacts" / name for name in names]
    before = [dvc_hash(out) for out in outputs]
    run([DVC, "push", *args], repo)
    for path in [*outputs, repo / ".dvc" / "cache"]:
        shutil.rmtree(path)
    run([DVC, "pull", *args], repo)
    assert [dvc_hash(out) for out in outputs] == before


@pytest.mark.slow
def test_dvc_repro_runs_the_pipeline_and_reruns_only_what_changed(tmp_path: Path, s3_endpoint: str) -> None:
    repo = fresh_repo(tmp_path)
    first = run([DVC, "repro"], repo)
    assert stages_run(first.stdout) == ["sources", "data", "train", "eval", "register"]
    assert status(repo) == {}

    # The data version MLflow recorded is the hash dvc.lock holds for the data stage's output.
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    [data_out] = lock["stages"]["data"]["outs"]
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    [data_run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                                    filter_string="attributes.run_name = 'data'")
    assert data_run.data.tags["forgeline.data.dvc_md5"] == data_out["md5"]
    metrics = json.loads((repo / "artifacts" / "eval" / "metrics.json").read_text())
    shown = json.loads(run([DVC, "metrics", "show", "--json"], repo).stdout)
    assert find_key(shown, "overall") == pytest.approx(metrics["overall"])

    commit(repo, "first run")

    # Remotes: the default local one (dvc-storage/), then S3.
    round_trip(repo, ("raw", "data", "train"))
    assert status(repo) == {}
    assert (repo / "dvc-storage" / "files" / "md5").is_dir()
    make_bucket("dvc")
    run([DVC, "remote", "add", "s3", "s3://dvc/forgeline"], repo)
    run([DVC, "remote", "modify", "s3", "endpointurl", s3_endpoint], repo)
    round_trip(repo, ("raw", "data", "train"), "-r", "s3")
    assert status(repo) == {}

    # The loss curve, one point per step.
    plots = json.loads(run([DVC, "plots", "show", "--json"], repo).stdout)["data"]
    assert plots["artifacts/eval/dimensions.png"][0]["type"] == "image"
    [curve] = plots["artifacts/train/loss.csv"]
    assert {int(point["step"]) for point in find_key(curve["content"], "values")} == set(range(1, 21))

    # A change to the eval code that leaves the scores as they were: only eval reruns.
    with open(repo / "eval" / "lm.py", "a") as f:
        f.write("\n# touched by the test\n")
    second = run([DVC, "repro"], repo)
    assert stages_run(second.stdout) == ["sources", "eval"]
    assert "Stage 'data' didn't change" in second.stdout and "Stage 'train' didn't change" in second.stdout

    # An experiment with more items changes the scores: eval reruns, register records them.
    third = run([DVC, "exp", "run", "-S", "configs/tiny.yaml:eval.dimensions.reasoning.limit=5"], repo)
    assert stages_run(third.stdout) == ["sources", "eval", "register"]
    assert status(repo) == {}
    diff = json.loads(run([DVC, "metrics", "diff", "--json"], repo).stdout)  # against the first run
    changed = diff["artifacts/eval/metrics.json"]
    assert changed and all(entry["old"] != entry["new"] for entry in changed.values()), diff


@pytest.mark.slow
def test_dvc_repro_of_the_data_stage_rebuilds_only_for_changed_raw_inputs_and_byte_identically(
        tmp_path: Path) -> None:
    repo = fresh_repo(tmp_path)
    # A local files source beside the packaged Shakespeare: raw input that can change.
    config = yaml.safe_load((repo / "configs" / "tiny.yaml").read_text())
    config["data"]["sources"].append({"kind": "files", "path": "notes/*.txt", "name": "notes"})
    (repo / "configs" / "tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (repo / "notes").mkdir()
    for number in range(3):
        (repo / "notes" / f"{number}.txt").write_text(" ".join(f"note{number}-word{i}" for i in range(300)))
    commit(repo, "a files source")
    raw, out = repo / "artifacts" / "raw", repo / "artifacts" / "data"
    assert stages_run(run([DVC, "repro", "data"], repo).stdout) == ["sources", "data"]
    assert status(repo, "data") == {}

    def stamps() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [raw, *raw.iterdir()]}

    # Nothing changed: the sources are read again, the snapshot stays as it was, data is not rerun.
    before = stamps()
    again = run([DVC, "repro", "data"], repo).stdout
    assert stages_run(again) == ["sources"] and "Stage 'data' didn't change" in again
    assert stamps() == before

    # A raw file changes: a new snapshot, and the data stage reruns on it.
    (repo / "notes" / "1.txt").write_text(" ".join(f"rewritten-word{i}" for i in range(300)))
    manifest = json.loads((out / "manifest.json").read_text())
    assert stages_run(run([DVC, "repro", "data"], repo).stdout) == ["sources", "data"]
    assert json.loads((out / "manifest.json").read_text())["sources"]["notes"] != manifest["sources"]["notes"]
    assert status(repo, "data") == {}

    # The snapshot goes to the remote and comes back with the data.
    round_trip(repo, ("raw", "data"), "sources", "data")
    assert status(repo, "data") == {}

    def digests() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(out.rglob("*")) if p.is_file()}

    first = digests()
    shutil.rmtree(out)
    run([DVC, "repro", "--force", "data"], repo)
    assert digests() == first
    assert any(name.startswith("train-") for name in first)
