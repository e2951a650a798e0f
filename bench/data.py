"""bench/data: the streaming data stage at corpus scale, and the training loader, against baselines
measured in the same run.

    .venv/bin/python bench/data.py [--rounds 3 --scales 1 2 4 --every 1 --config tiny-single.yaml --steps 40]
    .venv/bin/python bench/data.py --quick   # --every 4 --scales 1 2 --rounds 1 --steps 20

The full run takes about 30 minutes on 2 quiet cores; --quick about 3.

(a) The data stage (tasks/data) on the corpus of configs/corpus-docs.yaml (`make corpus` unpacks
it under corpus/; 57 MB in 9,342 documents). The k-times corpus is its files copied k times,
each copy but the first with every word swapped for one of nearly the same frequency (ranks r
and r + c trade places in copy c: a bijection on lowercased words). The copies are about as long
and tokenize alike (the tokens per corpus are reported), and hold the same exact and near
duplicates among themselves, but share practically no 5-word shingle with each other, so
dedup keeps every copy (the kept documents are reported against k times the 1x's). Every corpus,
the 1x too, is read as `files` sources over these copies, one per source of corpus-docs.yaml,
with its name and weight. `--every N` keeps every Nth file of each source.

1. Peak memory and CPU vs corpus size: the whole stage (`build_dataset`: snapshot, then build;
   data.executor=dask, one worker per core) on the k = 1, 2, 4 corpora, each in a fresh process
   (this script with --measure) whose process tree, the stage and its Dask workers, is sampled
   from here every 0.2 s. Reported: the tree's peak RSS sum (the goal's figure; a spike shorter
   than a sample can be missed) and PSS sum (shared pages counted once), the same sums just
   before the build (imports done, cluster up), the stage process's own peak (ru_maxrss) and
   the largest worker's (VmHWM). The local cluster is started before the measurement (a fixed
   cost, which 3. reports), so the CPU seconds -- the tree's user + system time -- are the
   corpus's. Goals: the peak RSS sum grows <= 10 % from 1x to 4x; input MB (and documents) per
   CPU second within 15 % of the 1x figure.
2. 2 Dask workers / 1 (data.num_workers), 1x corpus (`--executors-scale`): wall time of
   `build_from_snapshot` from one snapshot taken before; goal >= 1.7 on 2 cores.
3. local Dask / pool (data.executor, 2 workers each), the same build: goal >= 0.9. For 2. and 3.
   each executor builds twice in one fresh process: "cold" is the first build, which for Dask
   also starts the local cluster; "warm" the second, on the running cluster (the pool forks its
   workers anew for every build). Their CPU seconds are reported beside the wall times.
4. Near-dedup documents/s as the corpus grows, from the runs of 1.: the documents that passed
   the filters over the wall time of the dedup step (`build.deduplicate`: the `exact-dedup` and
   `near-dedup` maps and the decision in document order); goal: roughly constant, a linear cost.

The phase times come from wrappers the measuring process puts around build.py's executor (each
map or submission, by name, from submission to its last result: the tokenize and shard phases of
the two splits overlap) and steps (snapshot, deduplicate, tokenizer training). Rounds alternate the order
of the measurements; times keep each measurement's best round (the least disturbed by other
load), memory its largest; the 1-minute load average before each measurement is recorded.

(b) Loader: samples/s of a cold `ShardedSampleLoader` (sha256 check on first open, decode,
shuffle, background prefetch) vs samples/s the trainer consumes, and the trainer's data-wait
share of the step (sum of data_wait_s / sum of step_time_s after warm-up; target <= 1 %), from a
real training run's per-step MLflow metrics on `--config`.

Writes bench/results/data.json.
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import psutil

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before torch, MLflow, Prefect and datasets are imported

from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs import Config, load_config  # noqa: E402
from forgeline.configs.schema import SourceConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CORPUS_CONFIG = "corpus-docs.yaml"
CORPUS_ROOT = REPO / "corpus" / "root"
WORD = re.compile(r"\w+")  # clean.py's word: what shingles and the exact-dedup key are made of
SAMPLE_S = 0.2
MB = 2**20
WARMUP_STEPS = 5
EXECUTORS = {"pool_2": ("pool", 2), "dask_1": ("dask", 1), "dask_2": ("dask", 2)}


# -- the k-times corpus --------------------------------------------------------------------------


def source_files(source: SourceConfig) -> tuple[Path, list[Path]]:
    """The directory a source's files are named relative to, and its files in reading order."""
    from forgeline.tasks.data.sources import matching_files, stdlib_files

    if source.kind == "stdlib":
        import sysconfig

        return Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
    parts = Path(source.path).parts
    fixed = Path(*parts[:next(i for i, part in enumerate(parts) if re.search(r"[*?[]", part))])
    return REPO / fixed, [REPO / path for path in matching_files(str(REPO / source.path))]


def read_text(path: Path) -> str:
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8", errors="surrogateescape")


def swaps(counts: Counter, copy: int) -> dict[str, str]:
    """Copy `copy`'s bijection on lowercased words: ranks r and r + copy of the frequency order
    trade places in every block of 2 * copy ranks (the incomplete last block stays)."""
    ranked = [word for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    mapping = {}
    for start in range(0, len(ranked) - 2 * copy + 1, 2 * copy):
        for i in range(start, start + copy):
            mapping[ranked[i]], mapping[ranked[i + copy]] = ranked[i + copy], ranked[i]
    return mapping


def swapped(text: str, mapping: dict[str, str], cache: dict[str, str]) -> str:
    def replace(match: re.Match) -> str:
        word = match.group()
        if (new := cache.get(word)) is None:
            new = mapping.get(word.lower(), word)
            new = new.upper() if word.isupper() else new.capitalize() if word[:1].isupper() else new
            cache[word] = new
        return new

    return WORD.sub(replace, text)


def write_copies(directory: Path, copies: int, every: int) -> tuple[list[SourceConfig], dict]:
    """`copies` copies of every `every`th file of each source of corpus-docs.yaml under
    directory/<source>/copy-<c>/; returns corpus-docs.yaml's sources and what was written."""
    started, written = time.perf_counter(), 0
    sources = load_config(CORPUS_CONFIG).data.sources
    files = {}
    for source in sources:
        base, paths = source_files(source)
        files[source.label] = (base, paths[::every])
    counts = Counter(word.lower() for _, paths in files.values() for path in paths
                     for word in WORD.findall(read_text(path)))
    for copy in range(copies):
        mapping, cache = swaps(counts, copy) if copy else {}, {}
        for label, (base, paths) in files.items():
            for path in paths:
                target = directory / label / f"copy-{copy}" / path.relative_to(base)
                target.parent.mkdir(parents=True, exist_ok=True)
                if copy == 0:
                    shutil.copyfile(path, target)
                else:
                    data = swapped(read_text(path), mapping, cache).encode("utf-8", errors="surrogateescape")
                    target.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
                written += target.stat().st_size
    return sources, {"files_per_copy": sum(len(paths) for _, paths in files.values()), "every": every,
                     "copies": copies, "distinct_words": len(counts), "written_mb": round(written / MB, 1),
                     "seconds": round(time.perf_counter() - started, 1)}


def scaled_sources(directory: Path, sources: list[SourceConfig], scale: int) -> str:
    """`files` sources over copies 0..scale-1 (scale <= 10), named and weighted as corpus-docs.yaml's,
    as an override of data.sources."""
    scaled = [{"kind": "files", "name": source.label, "weight": source.weight,
               "path": f"{directory}/{source.label}/copy-[0-{scale - 1}]/**/*"} for source in sources]
    return f"data.sources={json.dumps(scaled)}"


# -- the measuring process (bench/data.py --measure SPEC) ----------------------------------------


class Phases:
    """Wall seconds of build.py's steps and executor maps, by name, summed over a build."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.near_pairs = 0  # the pairs found similar, per bucket (a pair can share several bands)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)
        return wrapper

    def install(self, build) -> None:
        """Wrap the module-level names build_from_snapshot calls."""
        executor_for, near_duplicates = build.executor_for, build.near_duplicates
        phases = self

        class TimedExecutor:
            def __init__(self, *args):
                self.inner = executor_for(*args)

            def __enter__(self):
                started = time.perf_counter()
                self.inner.__enter__()
                phases.add("executor_start", time.perf_counter() - started)
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def submit(self, name, fn, items):
                started, submitted = time.perf_counter(), self.inner.submit(name, fn, items)

                def results():
                    try:
                        return submitted.results()
                    finally:
                        phases.add(name, time.perf_counter() - started)
                return SimpleNamespace(results=results)

            def map(self, name, fn, items):
                return self.submit(name, fn, items).results()

        def counted_near_duplicates(pairs):
            self.near_pairs += len(pairs)
            return near_duplicates(pairs)

        build.executor_for = TimedExecutor
        build.near_duplicates = self.timed("near_decision", counted_near_duplicates)
        build.take_snapshot = self.timed("snapshot", build.take_snapshot)
        build.deduplicate = self.timed("dedup", build.deduplicate)
        build.build_tokenizer = self.timed("tokenizer", build.build_tokenizer)


def tree_cpu_seconds() -> float:
    """User + system seconds of this process, its exited children and its live descendants."""
    own, done = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def tree_memory_mb() -> tuple[float, float]:
    """RSS and PSS summed over this process and its descendants, in MB."""
    rss = pss = 0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            memory = process.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        rss, pss = rss + memory.rss, pss + memory.pss
    return round(rss / MB, 1), round(pss / MB, 1)


def warm_cluster(num_workers: int) -> float:
    """Start this process's local Dask cluster and import the work on each worker; seconds."""
    from distributed import Client

    from forgeline.tasks.data.executor import local_cluster

    started = time.perf_counter()
    with Client(local_cluster(num_workers).scheduler_address, set_as_default=False) as client:
        client.run(lambda: __import__("forgeline.tasks.data.work") and None)
    return time.perf_counter() - started


def corpus_counts(out_dir: Path) -> dict:
    from forgeline.model.training.shards import MANIFEST_NAME

    manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
    sources, removed = manifest["sources"].values(), Counter()
    for source in sources:
        removed.update(source["removed"])
    kept = manifest["documents"]
    return {"input_documents": sum(s["input"]["documents"] for s in sources),
            "input_mb": round(sum(s["input"]["bytes"] for s in sources) / MB, 2),
            "kept_documents": kept, "exact_duplicates": removed["exact_duplicate"],
            "near_duplicates": removed["near_duplicate"],
            "deduplicated_documents": kept + removed["exact_duplicate"] + removed["near_duplicate"],
            "tokens": sum(split["tokens"] for split in manifest["splits"].values())}


def measure(spec: dict) -> None:
    """One measuring process: `spec["builds"]` builds (with the snapshot or from data.raw_dir),
    each into its own output; prints one JSON line last, after the local cluster has closed."""
    import logging

    from forgeline.tasks.data import build

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(relativeCreated)8.0f ms %(message)s")
    report: dict = {"builds": []}

    def final_report():  # registered before the cluster's own atexit close: runs after it
        # Not RUSAGE_CHILDREN's ru_maxrss: a spawned worker's counts the forked copy of this
        # process it was before its exec; the workers' own peaks are sampled (TreeMemory).
        report["own_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB, 1)
        print(json.dumps(report), flush=True)

    atexit.register(final_report)
    phases = Phases()
    phases.install(build)
    if spec["warm"]:
        report["cluster_start_s"] = round(warm_cluster(spec["num_workers"]), 2)
    report["rss_before_mb"] = round(psutil.Process().memory_info().rss / MB, 1)
    report["tree_rss_sum_before_mb"], report["tree_pss_sum_before_mb"] = tree_memory_mb()
    for number in range(spec["builds"]):
        out_dir = Path(f"{spec['out_dir']}-{number}")
        cfg = load_config(CORPUS_CONFIG, [*spec["overrides"], f"data.out_dir={out_dir}"])
        phases.seconds, phases.near_pairs = {}, 0
        cpu, started = tree_cpu_seconds(), time.perf_counter()
        if spec["snapshot"]:
            build.build_dataset(cfg)
        else:
            build.build_from_snapshot(cfg)
        wall, cpu = time.perf_counter() - started, tree_cpu_seconds() - cpu
        report["builds"].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                                 "phases_s": {k: round(v, 2) for k, v in phases.seconds.items()},
                                 "near_dedup_pairs": phases.near_pairs, **corpus_counts(out_dir)})
        shutil.rmtree(out_dir)


class TreeMemory(threading.Thread):
    """Samples the memory of a process and its descendants every SAMPLE_S until it exits."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.rss_sum = self.pss_sum = 0
        self.worker_hwm = 0  # the largest VmHWM of a descendant
        self.processes = 0

    def run(self) -> None:
        while True:
            try:
                if self.root.status() == psutil.STATUS_ZOMBIE:
                    break
                tree = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            rss = pss = 0
            for process in tree:
                try:
                    memory = process.memory_full_info()
                    if process is not self.root:
                        self.worker_hwm = max(self.worker_hwm, peak_rss(process.pid))
                except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                    continue
                rss, pss = rss + memory.rss, pss + memory.pss
            self.rss_sum, self.pss_sum = max(self.rss_sum, rss), max(self.pss_sum, pss)
            self.processes = max(self.processes, len(tree))
            time.sleep(SAMPLE_S)


def peak_rss(pid: int) -> int:
    """VmHWM of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_measure(spec: dict, log_path: Path) -> dict:
    """A measuring process for `spec`, its process tree's memory sampled from here."""
    load = os.getloadavg()[0]
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, __file__, "--measure", json.dumps(spec)], cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=log, text=True)
        memory = TreeMemory(process.pid)
        memory.start()
        stdout, _ = process.communicate()
        memory.join()
    if process.returncode:
        sys.exit(f"the measuring process failed (exit {process.returncode}); its log, {log_path}:\n"
                 + "\n".join(log_path.read_text().splitlines()[-30:]))
    report = json.loads(stdout.strip().splitlines()[-1])
    return report | {"tree_peak_rss_sum_mb": round(memory.rss_sum / MB, 1),
                     "tree_peak_pss_sum_mb": round(memory.pss_sum / MB, 1),
                     "largest_worker_peak_rss_mb": round(memory.worker_hwm / MB, 1),
                     "processes": memory.processes, "load_average_1min_before": round(load, 2)}


# -- (a) the data stage ------------------------------------------------------------------------


def scaling(corpus: Path, sources: list[SourceConfig], scales: list[int], rounds: int, scratch: Path) -> dict:
    """1. and 4.: the whole stage on each k-times corpus, rounds alternating the order."""
    runs: dict[int, list[dict]] = {scale: [] for scale in scales}
    workers = len(os.sched_getaffinity(0))
    for round_number in range(rounds):
        for scale in scales if round_number % 2 == 0 else scales[::-1]:
            spec = {"overrides": [scaled_sources(corpus, sources, scale), "data.executor=dask",
                                  f"data.raw_dir={scratch / f'raw-{scale}x'}"],
                    "out_dir": str(scratch / f"out-{scale}x"), "snapshot": True, "builds": 1, "warm": True,
                    "num_workers": workers}
            run = run_measure(spec, scratch / f"stage-{scale}x-{round_number}.log")
            shutil.rmtree(scratch / f"raw-{scale}x")
            runs[scale].append(run)
            print(f"  {scale}x round {round_number}: {run['builds'][0]['wall_s']} s, "
                  f"peak RSS sum {run['tree_peak_rss_sum_mb']} MB", file=sys.stderr, flush=True)
    table = {}
    for scale, measured in runs.items():
        builds = [run["builds"][0] for run in measured]
        best = min(builds, key=lambda b: b["cpu_s"])
        fastest = min(builds, key=lambda b: b["phases_s"]["dedup"])
        table[f"{scale}x"] = {
            "input_documents": best["input_documents"], "input_mb": best["input_mb"],
            "kept_documents": best["kept_documents"], "tokens": best["tokens"],
            "tree_peak_rss_sum_mb": max(run["tree_peak_rss_sum_mb"] for run in measured),
            "tree_peak_pss_sum_mb": max(run["tree_peak_pss_sum_mb"] for run in measured),
            "stage_process_peak_rss_mb": max(run["own_peak_rss_mb"] for run in measured),
            "largest_worker_peak_rss_mb": max(run["largest_worker_peak_rss_mb"] for run in measured),
            # Before the build (imports done, cluster started): the part no corpus can change.
            "stage_process_rss_before_mb": max(run["rss_before_mb"] for run in measured),
            "tree_rss_sum_before_mb": max(run["tree_rss_sum_before_mb"] for run in measured),
            "tree_pss_sum_before_mb": max(run["tree_pss_sum_before_mb"] for run in measured),
            "tree_peak_rss_sum_above_before_mb": round(max(
                run["tree_peak_rss_sum_mb"] - run["tree_rss_sum_before_mb"] for run in measured), 1),
            "wall_s": min(b["wall_s"] for b in builds),
            "cpu_s": best["cpu_s"],
            "documents_per_cpu_s": round(best["input_documents"] / best["cpu_s"], 1),
            "mb_per_cpu_s": round(best["input_mb"] / best["cpu_s"], 3),
            "phases_s": best["phases_s"],
            "load_average_1min_before": [run["load_average_1min_before"] for run in measured],
            "dedup": {"documents": fastest["deduplicated_documents"], "seconds": fastest["phases_s"]["dedup"],
                      "exact_map_s": fastest["phases_s"].get("exact-dedup", 0.0),
                      "near_map_s": fastest["phases_s"].get("near-dedup", 0.0),
                      "decision_s": fastest["phases_s"].get("near_decision", 0.0),
                      "similar_pairs": fastest["near_dedup_pairs"],
                      "exact_duplicates": fastest["exact_duplicates"],
                      "near_duplicates": fastest["near_duplicates"],
                      "documents_per_s": round(fastest["deduplicated_documents"]
                                               / fastest["phases_s"]["dedup"])},
        }
    base, top = table[f"{scales[0]}x"], table[f"{scales[-1]}x"]
    ratio = scales[-1] // scales[0]
    return {
        "corpora": table,
        f"kept_documents_{scales[-1]}x_over_{ratio}_times_{scales[0]}x":
            round(top["kept_documents"] / (ratio * base["kept_documents"]), 4),
        f"peak_rss_sum_{scales[-1]}x_over_{scales[0]}x":
            round(top["tree_peak_rss_sum_mb"] / base["tree_peak_rss_sum_mb"], 3),
        f"peak_pss_sum_{scales[-1]}x_over_{scales[0]}x":
            round(top["tree_peak_pss_sum_mb"] / base["tree_peak_pss_sum_mb"], 3),
        f"mb_per_cpu_s_{scales[-1]}x_over_{scales[0]}x": round(top["mb_per_cpu_s"] / base["mb_per_cpu_s"], 3),
        f"documents_per_cpu_s_{scales[-1]}x_over_{scales[0]}x":
            round(top["documents_per_cpu_s"] / base["documents_per_cpu_s"], 3),
        f"dedup_documents_per_s_{scales[-1]}x_over_{scales[0]}x":
            round(top["dedup"]["documents_per_s"] / base["dedup"]["documents_per_s"], 3),
    }


def executors(corpus: Path, sources: list[SourceConfig], rounds: int, scratch: Path, scale: int) -> dict:
    """2. and 3.: build_from_snapshot of the `scale`-times corpus by each executor, cold then warm,
    in a fresh process per executor and round."""
    from forgeline.tasks.data.snapshot import take_snapshot

    raw_dir = scratch / "raw-shared"
    corpus_override = scaled_sources(corpus, sources, scale)
    take_snapshot(load_config(CORPUS_CONFIG, [corpus_override, f"data.raw_dir={raw_dir}"]))
    runs: dict[str, list[dict]] = {name: [] for name in EXECUTORS}
    names = list(EXECUTORS)
    for round_number in range(rounds):
        for name in names[round_number % len(names):] + names[:round_number % len(names)]:
            executor, workers = EXECUTORS[name]
            spec = {"overrides": [corpus_override, f"data.raw_dir={raw_dir}", f"data.executor={executor}",
                                  f"data.num_workers={workers}"],
                    "out_dir": str(scratch / f"out-{name}"), "snapshot": False, "builds": 2, "warm": False}
            run = run_measure(spec, scratch / f"build-{name}-{round_number}.log")
            runs[name].append(run)
            print(f"  {name} round {round_number}: cold {run['builds'][0]['wall_s']} s, "
                  f"warm {run['builds'][1]['wall_s']} s", file=sys.stderr, flush=True)
    best = {name: {when: min(run["builds"][n]["wall_s"] for run in measured)
                   for n, when in enumerate(("cold", "warm"))} for name, measured in runs.items()}
    # CPU seconds (the process tree's): what each costs whatever else loads the machine.
    cpu = {name: {when: min(run["builds"][n]["cpu_s"] for run in measured)
                  for n, when in enumerate(("cold", "warm"))} for name, measured in runs.items()}
    phases = {name: {when: measured[0]["builds"][n]["phases_s"] for n, when in enumerate(("cold", "warm"))}
              for name, measured in runs.items()}
    return {
        "corpus_scale": scale,
        "build_s": best,
        "build_cpu_s": cpu,
        "load_average_1min_before": {name: [run["load_average_1min_before"] for run in measured]
                                     for name, measured in runs.items()},
        "phases_s_first_round": phases,
        "dask_2_over_1_workers_warm": round(best["dask_1"]["warm"] / best["dask_2"]["warm"], 3),
        "dask_2_over_1_workers_cold": round(best["dask_1"]["cold"] / best["dask_2"]["cold"], 3),
        "dask_over_pool_warm": round(best["pool_2"]["warm"] / best["dask_2"]["warm"], 3),
        "dask_over_pool_cold": round(best["pool_2"]["cold"] / best["dask_2"]["cold"], 3),
    }


# -- (b) the loader --------------------------------------------------------------------------


def loader_samples_per_s(cfg: Config, batches: int) -> float:
    from forgeline.model.training.loader import ShardedSampleLoader
    from forgeline.model.training.shards import read_manifest, split_shards

    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    loader = ShardedSampleLoader(split_shards(data_dir, manifest, "train"), cfg.train.global_batch_size,
                                 0, 1, cfg.train.seed)
    started = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return batches * cfg.train.global_batch_size / (time.perf_counter() - started)


def trainer_metrics(cfg: Config) -> tuple[list[float], list[float]]:
    """Per-step step_time_s and data_wait_s of a real train stage run, from MLflow."""
    from mlflow import MlflowClient

    from forgeline.tasks.tracking import experiment_id, resolve_tracking_uri
    from forgeline.tasks.train.job import train_model

    client = MlflowClient(resolve_tracking_uri(cfg))
    run = client.create_run(experiment_id(client, cfg), run_name="bench-data")
    train_model(cfg, mlflow_run_id=run.info.run_id)

    def history(key: str) -> list[float]:
        metrics = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(metrics, key=lambda m: m.step)]

    return history("step_time_s")[WARMUP_STEPS:], history("data_wait_s")[WARMUP_STEPS:]


def loader(config: str, steps: int, workdir: Path) -> dict:
    from forgeline.tasks.data.build import build_dataset

    cfg = load_config(config, [
        f"data.out_dir={workdir / 'data'}", f"data.raw_dir={workdir / 'raw'}",
        f"train.out_dir={workdir / 'train'}", f"train.steps={steps}", "train.warmup_steps=2",
        f"checkpoint.every_steps={steps}", f"train.log_every={steps}", "train.peak_tflops=1",
        f"registry.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
        f"registry.artifact_location={workdir / 'mlartifacts'}"])
    started = time.perf_counter()
    build_dataset(cfg)
    stage_s = time.perf_counter() - started
    step_times, waits = trainer_metrics(cfg)
    samples = loader_samples_per_s(cfg, batches=len(step_times) * 4)
    consumed = cfg.train.global_batch_size * len(step_times) / sum(step_times)
    return {
        "config": config,
        "data_stage_s": round(stage_s, 1),
        "loader_samples_per_s": round(samples),
        "trainer_samples_per_s": round(consumed, 1),
        "loader_over_trainer": round(samples / consumed, 1),
        "data_wait_share_of_step": round(sum(waits) / sum(step_times), 5),
        "steps_measured": len(step_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a check in ~3 minutes: --every 4 --scales 1 2 --rounds 1 --steps 20")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 2, 4], help="corpus sizes, ascending")
    parser.add_argument("--every", type=int, default=1, help="keep every Nth file of each source")
    parser.add_argument("--executors-scale", type=int, default=1,
                        help="the corpus size of 2. and 3., one of --scales")
    parser.add_argument("--config", default="tiny-single.yaml", help="(b)'s training config")
    parser.add_argument("--steps", type=int, default=40, help="(b)'s training steps")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the measuring process's spec
    args = parser.parse_args()
    if args.measure:
        return measure(json.loads(args.measure))
    if args.quick:
        args.every, args.scales, args.rounds, args.steps = 4, [1, 2], 1, 20
    if args.scales != sorted(set(args.scales)) or not 1 <= args.scales[0] <= args.scales[-1] <= 10:
        parser.error(f"--scales {args.scales}: distinct corpus sizes from 1 to 10, ascending")
    if args.executors_scale not in args.scales:
        parser.error(f"--executors-scale {args.executors_scale}: one of --scales {args.scales}")
    if not CORPUS_ROOT.is_dir():
        sys.exit(f"no corpus under {CORPUS_ROOT}: run `make corpus` first (configs/{CORPUS_CONFIG})")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        workdir = Path(scratch)
        corpus = workdir / "corpus"
        print(f"writing {max(args.scales)} copies of the corpus", file=sys.stderr, flush=True)
        sources, written = write_copies(corpus, max(args.scales), args.every)
        results = {"quick": args.quick, "rounds": args.rounds, "cpus": len(os.sched_getaffinity(0)),
                   "corpus": {"config": CORPUS_CONFIG, **written}}
        print("1. and 4.: the stage at each corpus size", file=sys.stderr, flush=True)
        results["scaling"] = scaling(corpus, sources, args.scales, args.rounds, workdir)
        print("2. and 3.: executors and workers", file=sys.stderr, flush=True)
        results["executors"] = executors(corpus, sources, args.rounds, workdir, args.executors_scale)
        print("(b) the loader", file=sys.stderr, flush=True)
        results["loader"] = loader(args.config, args.steps, workdir / "loader")
    results["wall_s"] = round(time.perf_counter() - started)
    results["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    write_results("data", results)


if __name__ == "__main__":
    main()
