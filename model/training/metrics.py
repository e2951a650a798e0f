"""Training metrics: throughput, MFU, memory, per-rank step times (to name stragglers), written
to the tracking spool (model/spool.py) -- the loop never waits on the tracking store, and a store
that is down loses nothing -- and printed as a progress line, from global rank 0. Every step is
recorded; they are spooled once per log interval, one batch per interval rather than one write
per step. A step with validation figures (`val/loss`, callbacks.ValidationCallback) also prints
a progress line."""

from __future__ import annotations

import logging
import math
import resource
import socket
import statistics
import time

import torch
import torch.distributed as dist

from forgeline.model.spool import flush_deadline_s, spool_from_environment
from forgeline.model.training.alerts import emit_alert

log = logging.getLogger(__name__)

STRAGGLER_RATIO = 1.2  # a rank this much slower than the median is named


def measure_peak_flops(device: torch.device, size: int = 2048, repeats: int = 5) -> float:
    """Achieved fp32 matmul FLOP/s on this rank (with its share of the CPU threads). All ranks
    measure at once, so on a shared CPU their sum is what the machine gives them together."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b  # warm-up: allocation, thread pool, clocks
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def bits_per_byte(loss: float, tokens: int, text_bytes: int) -> float:
    """Bits per UTF-8 byte of text from a mean loss in nats per token over `tokens` tokens that
    encode `text_bytes` bytes: a figure that tokenizers of any vocabulary share."""
    return loss * tokens / (math.log(2) * text_bytes)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size of the process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MetricsLogger:
    """Collective (every rank calls log_step); only global rank 0 logs."""

    def __init__(self, run_id: str | None, rank: int, log_every: int, total_steps: int,
                 flops_per_step: float, peak_flops: float, device: torch.device):
        self.rank = rank
        self.spool = spool_from_environment(run_id, "rank0") if run_id and rank == 0 else None
        self.log_every = log_every
        self.total_steps = total_steps
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops  # summed over all ranks
        self.device = device
        self.hosts = _gather_hostnames()
        self._interval_time = 0.0
        self._interval_steps = 0
        self._buffer: list[tuple[str, float, int, int]] = []
        self._events = 0

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        step_time = metrics["step_time_s"]
        metrics = metrics | {
            "mfu": self.flops_per_step / step_time / self.peak_flops,
            "peak_memory_gib": peak_memory_gib(self.device),
        }
        self._interval_time += step_time
        self._interval_steps += 1
        at_interval = step % self.log_every == 0 or step == self.total_steps or "val/loss" in metrics
        if at_interval:
            metrics |= self._rank_step_times(step)
        if self.rank != 0:
            return
        if self.spool is not None:
            now = int(time.time() * 1000)
            self._buffer += [(key, float(value), now, step) for key, value in metrics.items()]
        if at_interval:
            self._send()
            log.info("%s step %d/%d  %s%s", _bar(step, self.total_steps), step, self.total_steps,
                     "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()), self._pending_note())

    def _rank_step_times(self, step: int) -> dict[str, float]:
        """Mean step time of every rank over the interval; the slowest is named (and alerted, with
        its host) when it lags."""
        mine = torch.tensor([self._interval_time / self._interval_steps], device=self.device)
        self._interval_time, self._interval_steps = 0.0, 0
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        times = [t.item() for t in gathered]
        median = statistics.median(times)
        slow = straggler(times)
        if self.rank == 0 and slow is not None:
            message = (f"rank {slow} on {self.hosts[slow]} averages {times[slow]:.3f}s per step, "
                       f"{100 * (times[slow] / median - 1):.0f}% above the median {median:.3f}s")
            log.warning("straggler: %s", message)
            emit_alert("straggler", message, step, rank=slow, host=self.hosts[slow])
        return {"step_time_max_s": max(times), "step_time_median_s": median}

    def log_event(self, step: int, message: str, counters: dict[str, float]) -> None:
        """A rare, notable event (a skipped update, a rollback): a warning in the logs, a run
        tag and counters in MLflow, sent at once."""
        if self.rank != 0:
            return
        log.warning("step %d: %s", step, message)
        self._events += 1
        if self.spool is not None:
            now = int(time.time() * 1000)
            tag = {f"forgeline.event.{self._events:04d}": f"step {step}: {message}"[:5000]}
            self.spool.log_batch([(key, float(v), now, step) for key, v in counters.items()], tags=tag)

    def _send(self) -> None:
        if self.spool is not None and self._buffer:
            self.spool.log_batch(self._buffer)
        self._buffer = []

    def _pending_note(self) -> str:
        """How many tracking writes wait for a store that does not answer, when any do."""
        waiting = self.spool.waiting if self.spool is not None else 0
        return f"  (tracking store down: {waiting} write(s) pending)" if waiting else ""

    def close(self) -> None:
        """Spool what is buffered and give the store ops.tracking_flush_s to take it all; what it
        has not taken by then stays in the spool for `forgeline sync`."""
        self._send()
        if self.spool is not None:
            self.spool.close(flush_deadline_s())


def straggler(step_times: list[float], ratio: float = STRAGGLER_RATIO) -> int | None:
    """The rank whose mean step time exceeds the median of all ranks by `ratio`, if any."""
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    if step_times[slowest] > ratio * statistics.median(step_times):
        return slowest
    return None


def _gather_hostnames() -> list[str]:
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def _bar(step: int, total: int, width: int = 20) -> str:
    done = width * step // total
    return f"[{'#' * done}{'.' * (width - done)}] {100 * step // total:3d}%"


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
