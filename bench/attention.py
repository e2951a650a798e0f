"""bench/attention: attention over a packed row, document by document (DocumentSpans) against the
dense (B, 1, T, T) block-causal mask it replaced, in one run.

    .venv/bin/python bench/attention.py [--lengths 1024 2048 4096 8192] [--batch 1] [--longest-document 1024]
                                        [--repeats 5]

Each measurement is a fresh subprocess: a one-layer model of tiny.yaml's width and heads (dim 256,
8 heads, 4 key/value heads), fp32 on CPU, the forward and backward of packed rows (B = 1 unless --batch) of
documents of random lengths (uniform in 16..--longest-document tokens, the same rows for both paths), from the
document numbers to the gradients: the positions and the mask or spans are built in the pass, as
`Transformer.forward` builds them. Peak memory is the rise of the process's maximum resident set
(getrusage's ru_maxrss) during the first pass over its resident set just before it: torch's CPU
allocator has no cache, so the resident set follows what is allocated, the scores and masks
included, which tracemalloc does not see. Time is the fastest of the passes after it: on a shared
machine other processes only ever add time. Prints the
table and the ratios (memory at the longest / shortest row; time spans / dense at each length);
writes bench/results/attention.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from results_file import write_results  # bench/, the script's own directory

from forgeline.configs.schema import ModelConfig
from forgeline.model.transformer import DocumentSpans, Transformer, dense_document_mask, document_positions

PATHS = ("dense", "spans")
SHAPE = dict(vocab_size=256, dim=256, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=688)


def packed_rows(batch: int, T: int, longest: int) -> torch.Tensor:
    """(B, T) document numbers of documents of random lengths, the last one of a row cut at T."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        lengths = torch.randint(16, longest + 1, (T // 16 + 1,), generator=generator)
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:T])
    return torch.stack(rows)


def resident_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() // 1024


def measure(path: str, args: argparse.Namespace) -> dict:
    """Peak memory (MiB) of the first forward and backward, and the fastest time (s) of the next ones."""
    torch.manual_seed(0)
    batch, T = args.batch, args.lengths[0]
    model = Transformer(ModelConfig(**SHAPE, max_seq_len=T))
    model.init_weights(0)
    documents = packed_rows(batch, T, args.longest_document)
    tokens = torch.randint(0, SHAPE["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        mask = dense_document_mask(documents) if path == "dense" else DocumentSpans.of(documents)
        model.hidden_states(tokens, positions=document_positions(documents), mask=mask).sum().backward()

    before = resident_kib()
    step()
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return {"peak_mib": peak_mib, "seconds": min(seconds),
            "documents": len(DocumentSpans.of(documents).rows[0])}  # of the first row


def in_subprocess(path: str, T: int, args: argparse.Namespace) -> dict:
    options = {"--measure": path, "--lengths": T, "--batch": args.batch, "--repeats": args.repeats,
               "--longest-document": args.longest_document}
    command = [sys.executable, __file__, *(str(part) for option in options.items() for part in option)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--longest-document", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure", choices=PATHS, help="(internal) one measurement, as JSON")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    figures = {T: {path: in_subprocess(path, T, args) for path in PATHS} for T in args.lengths}
    speeds = {T: row["spans"]["seconds"] / row["dense"]["seconds"] for T, row in figures.items()}
    print(f"{'T':>6} {'docs':>5} {'dense MiB':>10} {'spans MiB':>10} {'dense s':>9} {'spans s':>9} "
          f"{'time spans/dense':>17}")
    for T, row in figures.items():
        dense, spans = row["dense"], row["spans"]
        print(f"{T:>6} {spans['documents']:>5} {dense['peak_mib']:>10.1f} {spans['peak_mib']:>10.1f} "
              f"{dense['seconds']:>9.3f} {spans['seconds']:>9.3f} {speeds[T]:>17.3f}")
    shortest, longest = figures[min(figures)], figures[max(figures)]
    ratios = {path: longest[path]["peak_mib"] / shortest[path]["peak_mib"] for path in PATHS}
    print(f"memory {max(figures)} / {min(figures)}: spans {ratios['spans']:.2f} (goal <= 10), "
          f"dense {ratios['dense']:.2f}")
    write_results("attention", {"batch": args.batch, "longest_document": args.longest_document,
                                "figures": figures, "memory_longest_over_shortest": ratios,
                                "time_spans_over_dense": speeds})


if __name__ == "__main__":
    main()
