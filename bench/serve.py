"""bench/serve: the registered pyfunc model generating a request's rows together, against the
same rows one at a time, in one run; then `mlflow models serve` answering a request of them.

    .venv/bin/python bench/serve.py [--config tiny.yaml] [--rows 16] [--new-tokens 64] [--rounds 3]

The model is the config's architecture with seed-0 random weights over the tokenizer its data
stage trains, exported and logged as the register stage logs it (tasks/register.py HFGenerator)
to a sqlite store, and loaded with mlflow.pyfunc.load_model. The rows are prompts of unlike
lengths cut from the held-out documents. Greedy decoding, so both ways must give the same texts
(checked), hence the same tokens: throughput is new tokens per second of `predict`, best of the
rounds, batched / one row per call (goal >= 4). The served check posts all rows in one
`/invocations` request to a server bound to 127.0.0.1 and checks its replies are the batched
ones. Writes bench/results/serve.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before MLflow and transformers are imported

import httpx  # noqa: E402
import mlflow  # noqa: E402
import pandas as pd  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs import load_config  # noqa: E402
from forgeline.model.hf import export_hf  # noqa: E402
from forgeline.model.training.shards import read_manifest  # noqa: E402
from forgeline.model.transformer import Transformer  # noqa: E402
from forgeline.tasks.data.build import build_dataset  # noqa: E402
from forgeline.tasks.register import SIGNATURE, HFGenerator  # noqa: E402


def logged_model(config: str, workdir: Path) -> tuple[str, Path]:
    """(the pyfunc's model URI in a sqlite store under `workdir`, the data directory)."""
    cfg = load_config(config, [f"data.out_dir={workdir / 'data'}", f"data.raw_dir={workdir / 'raw'}"])
    build_dataset(cfg)
    model = Transformer(cfg.model.for_vocabulary(read_manifest(workdir / "data")["vocab_size"]))
    model.init_weights(0)
    export = export_hf(model, workdir / "data" / "tokenizer", workdir / "hf")
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = mlflow.create_experiment("serve", artifact_location=str(workdir / "mlartifacts"))
    with mlflow.start_run(experiment_id=experiment):
        info = mlflow.pyfunc.log_model(name="model", python_model=HFGenerator(),
                                       artifacts={"hf": str(export)}, signature=SIGNATURE,
                                       pip_requirements=["torch", "transformers"])
    return info.model_uri, workdir / "data"


def prompts(data_dir: Path, rows: int) -> list[str]:
    """`rows` prompts of 20 to 20 + 12 * (rows - 1) characters from the held-out documents."""
    docs = [json.loads(line)["text"] for line in (data_dir / "val_docs.jsonl").read_text().splitlines()]
    return [docs[row % len(docs)][:20 + 12 * row] for row in range(rows)]


def timed(predict, frame: pd.DataFrame, params: dict) -> tuple[float, list[str]]:
    start = time.perf_counter()
    texts = predict(frame, params=params)
    return time.perf_counter() - start, list(texts)


def one_at_a_time(generator, frame: pd.DataFrame, params: dict) -> tuple[float, list[str]]:
    seconds, texts = 0.0, []
    for row in range(len(frame)):
        elapsed, [text] = timed(generator.predict, frame.iloc[[row]], params)
        seconds, texts = seconds + elapsed, texts + [text]
    return seconds, texts


def served(model_uri: str, frame: pd.DataFrame, params: dict, workdir: Path) -> tuple[float, list[str]]:
    """`mlflow models serve` on 127.0.0.1: the seconds one request of all rows took, and its replies."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    venv_bin = Path(sys.executable).parent
    cmd = [str(venv_bin / "mlflow"), "models", "serve", "-m", model_uri,
           "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    env = os.environ | {"MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),  # it starts the venv's uvicorn
                        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(workdir / "serve.log", "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(f"{url}/ping", server, workdir / "serve.log")
        start = time.perf_counter()
        answer = httpx.post(f"{url}/invocations", timeout=600, json={
            "dataframe_records": frame.to_dict(orient="records"), "params": params})
        seconds = time.perf_counter() - start
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn workers
            server.wait(timeout=60)
    answer.raise_for_status()
    return seconds, answer.json()["predictions"]


def wait_for(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mlflow models serve did not answer {url}:\n{log.read_text()[-4000:]}")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny.yaml")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    params = {"max_new_tokens": args.new_tokens}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        workdir = Path(scratch)
        model_uri, data_dir = logged_model(args.config, workdir)
        generator = mlflow.pyfunc.load_model(model_uri)
        frame = pd.DataFrame({"prompt": prompts(data_dir, args.rows)})
        generator.predict(frame.iloc[[0]], params=params)  # warm-up: first-call allocations and lazy init
        batched, single = [], []
        for _ in range(args.rounds):  # alternating, so that a slower spell of the machine hits both
            batched.append(timed(generator.predict, frame, params))
            single.append(one_at_a_time(generator, frame, params))
        texts = batched[0][1]
        assert all(b[1] == texts and s[1] == texts for b, s in zip(batched, single, strict=True)), \
            "greedy replies differ between a batch and its rows one at a time"
        tokenizer = generator.unwrap_python_model().tokenizer
        new_tokens = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in texts)
        print(f"batched {min(s for s, _ in batched):.2f} s, one at a time {min(s for s, _ in single):.2f} s "
              f"for {new_tokens} new tokens", file=sys.stderr)
        serve_s, served_texts = served(model_uri, frame, params, workdir)
    batched_s, single_s = min(s for s, _ in batched), min(s for s, _ in single)
    write_results("serve", {
        "config": args.config, "rows": args.rows, "max_new_tokens": args.new_tokens, "rounds": args.rounds,
        "new_tokens": new_tokens,
        "batched_tokens_per_s": round(new_tokens / batched_s, 1),
        "one_at_a_time_tokens_per_s": round(new_tokens / single_s, 1),
        "ratio": round(single_s / batched_s, 2),
        "served_request_s": round(serve_s, 2),
        "served_rows": len(served_texts),
        "served_replies_are_the_batched_ones": served_texts == texts,
    })


if __name__ == "__main__":
    main()
