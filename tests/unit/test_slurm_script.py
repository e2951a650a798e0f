"""The sbatch script of the train stage on Slurm (tasks/train/slurm.py `batch_script`): what each
node asks for -- GPUs, CPUs, memory -- from the layout and the `slurm` section. How the stage
follows the job: test_slurm_follow.py; a real cluster: tests/integration/test_slurm.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from forgeline.tasks.train import slurm
from tests.conftest import debug_config


def script(tmp_path: Path, *overrides: str) -> str:
    cfg = debug_config(tmp_path, "parallel.launcher=slurm", "parallel.dp_shard=2", *overrides)
    return slurm.batch_script(cfg, ["train.py"], tmp_path / "slurm-%j.out", tmp_path / "preempted.json")


def directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def srun_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("srun "))


def test_each_node_asks_for_a_gpu_per_rank_and_the_cpus_and_memory_set(tmp_path: Path) -> None:
    text = script(tmp_path, "slurm.gpus_per_node=2", "slurm.cpus_per_rank=4", "slurm.mem_per_cpu=4G")
    asked = directives(text)
    assert {"--gpus-per-node=2", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem-per-cpu=4G"} <= set(asked)
    assert "--ntasks-per-node=1 --cpus-per-task=8 bash -c" in srun_line(text)  # srun takes no job's cpus
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


@pytest.mark.parametrize("device, setting, gpus", [
    ("cuda", [], "--gpus-per-node=2"),  # the layout's 2 ranks per node
    ("cpu", [], None),
    ("cpu", ["slurm.gpus_per_node=8"], "--gpus-per-node=8"),  # a login node without GPUs
    ("cuda", ["slurm.gpus_per_node=0"], None),  # a CPU job
])
def test_gpus_follow_the_layout_on_a_cuda_machine_unless_set(device: str, setting: list[str],
                                                             gpus: str | None, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "local_device_type", lambda: device)
    asked = [d for d in directives(script(tmp_path, *setting)) if d.startswith("--gpus-per-node")]
    assert asked == ([gpus] if gpus else [])


def test_cpus_and_memory_are_the_partitions_unless_set(tmp_path: Path) -> None:
    text = script(tmp_path)
    assert not [d for d in directives(text) if d.startswith(("--cpus-per-task", "--mem-per-cpu"))]
    assert srun_line(text).startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c")
