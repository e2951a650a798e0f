"""How the train stage follows its Slurm job (tasks/train/slurm.py), against stand-ins for
`sbatch`, `scontrol` and `scancel` on PATH that replay a script of controller answers: a
controller that is silent for a while, a preempted job that is requeued, a job that outlives
train.timeout_s, a stage stopped from outside. The real cluster: tests/integration/test_slurm.py."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from forgeline.tasks.train import slurm
from forgeline.tasks.train.launch import LaunchError
from forgeline.tasks.train.slurm import run_slurm_job
from tests.conftest import debug_config

JOB_ID = "4242"
# One answer a call, the last one repeated; once scancel ran, the job is CANCELLED.
SCONTROL = """#!/bin/bash
dir=$(dirname "$0")/..
calls=$(( $(cat "$dir/scontrol-calls" 2>/dev/null || echo 0) + 1 ))
echo $calls > "$dir/scontrol-calls"
answer=$(sed -n "${calls}p" "$dir/answers")
[ -n "$answer" ] || answer=$(tail -n 1 "$dir/answers")
[ -f "$dir/cancelled" ] && answer="CANCELLED 0"
case "$answer" in
  SILENT) echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2; exit 1;;
  FORGOTTEN) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
esac
set -- $answer
echo "JobId=$4 JobName=forgeline-train JobState=$1 Reason=None Restarts=$2 ExitCode=0:0"
"""
SBATCH = f"""#!/bin/bash
echo "$@" >> "$(dirname "$0")/../submitted"
echo {JOB_ID}
"""
SCANCEL = """#!/bin/bash
echo "$@" >> "$(dirname "$0")/../cancelled"
"""


@pytest.fixture
def controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-ins' directory: write its `answers` (`STATE RESTARTS`, SILENT or FORGOTTEN, one
    a line); read `submitted` and `cancelled`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {"scontrol": SCONTROL.replace("$4", JOB_ID), "sbatch": SBATCH, "scancel": SCANCEL}
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path


def answer(controller: Path, *answers: str) -> None:
    (controller / "answers").write_text("\n".join(answers) + "\n")


def run(controller: Path, *overrides: str, on_line=None) -> None:
    cfg = debug_config(controller / "out", "parallel.launcher=slurm", "slurm.poll_s=0.01",
                       "train.preemption_grace_s=1", *overrides)
    run_slurm_job(cfg, ["train.py"], {"PATH": os.environ["PATH"]}, controller / "jobs",
                  controller / "preempted.json", logging.getLogger("test.slurm"), on_line)


def cancelled(controller: Path) -> bool:
    return (controller / "cancelled").exists()


def submissions(controller: Path) -> int:
    return len((controller / "submitted").read_text().splitlines())


def test_a_controller_silent_for_a_moment_costs_the_job_nothing(controller: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.slurm")
    answer(controller, "PENDING 0", "RUNNING 0", "SILENT", "SILENT", "SILENT", "RUNNING 0", "COMPLETED 0")
    run(controller)
    assert submissions(controller) == 1 and not cancelled(controller)
    assert "does not answer about job 4242" in caplog.text and "answers again" in caplog.text


def test_a_controller_silent_past_the_bound_cancels_the_job_and_fails(controller: Path) -> None:
    answer(controller, "RUNNING 0", "SILENT")
    with pytest.raises(LaunchError, match=r"did not answer about job 4242 .*slurm.controller_timeout_s"):
        run(controller, "slurm.controller_timeout_s=0.3")
    assert cancelled(controller)  # a retry must not run beside it


def test_a_preempted_job_that_is_requeued_is_followed_to_its_end(controller: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.slurm")
    answer(controller, "RUNNING 0", "PREEMPTED 0", "PREEMPTED 0", "PENDING 1", "RUNNING 1", "COMPLETED 1")
    run(controller)
    assert submissions(controller) == 1 and not cancelled(controller)
    assert "Slurm job 4242: PREEMPTED" in caplog.text and "RUNNING (requeued 1x)" in caplog.text


def test_a_preempted_job_that_is_not_requeued_has_ended(controller: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "REQUEUE_MARGIN_S", 0.0)  # waits train.preemption_grace_s (1 s) alone
    answer(controller, "RUNNING 0", "PREEMPTED 0")
    with pytest.raises(LaunchError, match="Slurm job 4242 ended PREEMPTED"):
        run(controller)
    assert not cancelled(controller)


def test_a_job_past_train_timeout_s_is_cancelled(controller: Path) -> None:
    answer(controller, *["PENDING 0"] * 20, *["RUNNING 0"] * 400, "COMPLETED 0")  # ends after ~5 s
    with pytest.raises(LaunchError, match=r"had not ended after train.timeout_s \(1 s"):
        run(controller, "train.timeout_s=1")
    assert cancelled(controller)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_a_stage_stopped_from_outside_cancels_its_job(controller: Path, stop: type[BaseException]) -> None:
    """Ctrl-C, a SIGTERM the CLI turns into SystemExit, an error while following: the job goes."""
    (controller / "jobs").mkdir()
    (controller / "jobs" / f"slurm-{JOB_ID}.out").write_text("step 1/24\n")
    answer(controller, "RUNNING 0")

    def stop_here(line: str) -> None:
        raise stop("stopped")

    with pytest.raises(stop):
        run(controller, on_line=stop_here)
    assert cancelled(controller)


def test_a_job_whose_cancel_failed_is_cancelled_before_the_retry_submits_another(controller: Path) -> None:
    scancel = controller / "bin" / "scancel"
    working = scancel.read_text()
    scancel.write_text('#!/bin/bash\necho "$@" >> "$(dirname "$0")/../refused"\n'
                       'echo "scancel: error: Unable to contact slurm controller" >&2\nexit 1\n')
    (controller / "jobs").mkdir()
    (controller / "jobs" / f"slurm-{JOB_ID}.out").write_text("step 1/24\n")
    answer(controller, "RUNNING 0")

    def stop_here(line: str) -> None:
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        run(controller, on_line=stop_here)
    assert not cancelled(controller)  # the job runs on: scancel failed
    with pytest.raises(LaunchError, match=f"Slurm job {JOB_ID}, of an earlier attempt of this stage, is "
                                          "still RUNNING and could not be cancelled"):
        run(controller)  # the retry
    assert submissions(controller) == 1  # none beside it
    assert (controller / "refused").read_text().splitlines() == [JOB_ID, JOB_ID]

    scancel.write_text(working)  # the controller takes cancels again
    with pytest.raises(LaunchError, match=f"Slurm job {JOB_ID} ended CANCELLED"):
        run(controller)  # the stand-in's one job id: the new job reads CANCELLED too
    assert cancelled(controller) and submissions(controller) == 2
