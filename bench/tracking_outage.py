"""bench/tracking_outage: what a tracking-server outage costs a training run -- its step time while
the server is down ÷ while it answers, in the same session.

    .venv/bin/python bench/tracking_outage.py [--steps 200] [--rounds 2]

Each round runs two pp2 x dp2 train stages of the debug config (`forgeline stage train`, fresh
outputs, the same data) against a real `mlflow server` on 127.0.0.1, in alternating order:

    up     the server answers throughout
    down   the server is killed (SIGKILL) at step 10 and started again after the stage ended;
           `forgeline sync` then sends what the spool kept

Step times are every step's `step_time_s` from MLflow (all there after the sync), steps 21 to
the end: the median of each kind over all rounds, and their ratio (goal <= 1.05). Also the seconds
from the last step's progress line to the command's end, and what `forgeline sync` sent. Writes
bench/results/tracking_outage.json.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from mlflow import MlflowClient
from results_file import write_results  # bench/, the script's own directory

BIN = Path(sys.executable).parent
FIRST_STEP = 21  # steps before it: start-up, and (down) the kill


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(root: Path, port: int) -> subprocess.Popen:
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
           str(root / "mlartifacts")]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("mlflow server did not start")


def stop(server: subprocess.Popen, sig: int) -> None:
    os.killpg(server.pid, sig)
    server.wait(timeout=60)


def train(workdir: Path, data_dir: Path, port: int, steps: int, kill_at: int | None,
          server: subprocess.Popen) -> float:
    """One train stage; returns the seconds from its last progress line to its end."""
    settings = [f"data.out_dir={data_dir}", "parallel.pp=2", "parallel.dp_shard=2", f"train.steps={steps}",
                "train.log_every=10", "train.peak_tflops=1", f"registry.tracking_uri=http://127.0.0.1:{port}"]
    cmd = [str(BIN / "forgeline"), "stage", "train", "--config", "debug.yaml"]
    cmd += [arg for setting in settings for arg in ("--set", setting)]
    stage = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=os.environ | {"PREFECT_HOME": str(workdir / ".prefect")})
    last_step_at = None
    for line in stage.stdout:
        if kill_at is not None and re.search(rf"step {kill_at}/{steps}\b", line):
            stop(server, signal.SIGKILL)
        if re.search(rf"step {steps}/{steps}\b", line):
            last_step_at = time.monotonic()
    if stage.wait() != 0 or last_step_at is None:
        raise RuntimeError(f"the train stage failed in {workdir}")
    return time.monotonic() - last_step_at


def step_times(port: int) -> list[float]:
    client = MlflowClient(f"http://127.0.0.1:{port}")
    experiment = client.get_experiment_by_name("forgeline-debug").experiment_id
    [run] = client.search_runs([experiment], filter_string="tags.`forgeline.stage` = 'train'")
    history = client.get_metric_history(run.info.run_id, "step_time_s")
    return [m.value for m in sorted(history, key=lambda m: m.step) if m.step >= FIRST_STEP]


def one_stage(root: Path, data_dir: Path, steps: int, down: bool) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="down-" if down else "up-", dir=root))
    port = free_port()
    server = start_server(workdir, port)
    tail_s = train(workdir, data_dir, port, steps, 10 if down else None, server)
    sent = None
    if down:
        server = start_server(workdir, port)
        synced = subprocess.run([str(BIN / "forgeline"), "sync"], cwd=workdir, capture_output=True, text=True,
                                env=os.environ | {"PREFECT_HOME": str(workdir / ".prefect")})
        sent = synced.stdout.strip()
    times = step_times(port)
    stop(server, signal.SIGTERM)
    if len(times) != steps - FIRST_STEP + 1:
        raise RuntimeError(f"{len(times)} step times in MLflow, expected {steps - FIRST_STEP + 1}")
    return {"median_step_s": statistics.median(times), "times": times, "end_after_last_step_s": tail_s,
            "sync": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="forgeline-bench-outage-") as scratch:
        root = Path(scratch)
        subprocess.run([str(BIN / "forgeline"), "stage", "data", "--config", "debug.yaml",
                        "--set", f"data.out_dir={root / 'data'}", "--set", f"data.raw_dir={root / 'raw'}"],
                       cwd=root, check=True, capture_output=True,
                       env=os.environ | {"PREFECT_HOME": str(root / ".prefect")})
        runs: dict[str, list[dict]] = {"up": [], "down": []}
        for index in range(args.rounds):
            order = ("up", "down") if index % 2 == 0 else ("down", "up")
            for kind in order:
                result = one_stage(root, root / "data", args.steps, kind == "down")
                runs[kind].append(result)
                print(f"round {index + 1} {kind:>4}: median step {result['median_step_s'] * 1000:.1f} ms, "
                      f"ended {result['end_after_last_step_s']:.1f} s after its last step"
                      + (f"; sync: {result['sync']}" if result["sync"] else ""), flush=True)
    medians = {kind: statistics.median([t for r in results for t in r["times"]])
               for kind, results in runs.items()}
    ratio = medians["down"] / medians["up"]
    print(f"step time while the server is down / while it answers: {ratio:.3f} "
          f"({medians['down'] * 1000:.1f} vs {medians['up'] * 1000:.1f} ms; goal <= 1.05)")
    write_results("tracking_outage", {
        "steps": args.steps, "rounds": args.rounds, "ratio": ratio, "median_step_s": medians,
        "end_after_last_step_s": {kind: [r["end_after_last_step_s"] for r in results]
                                  for kind, results in runs.items()},
        "sync": [r["sync"] for r in runs["down"]],
    })


if __name__ == "__main__":
    main()
