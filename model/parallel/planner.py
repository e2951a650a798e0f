"""Layout planner: pick tensor/pipeline/data-parallel degrees for a Llama-style model on a
cluster, and estimate what the layout costs in memory, communication and checkpointing.

Pure arithmetic (no torch), so a layout can be checked before any accelerator is booked.

Rules, after section 1.2 and FAQ Q2 of the article in shared/seeds/000_033f0b1e1acd671c.txt
("First determine TP so that a single card can hold its portion of the model. Then determine PP
depth ... Finally, use remaining resources to scale DP. For smaller clusters, PP <= 4"):

1. TP stays inside a node: a power of two, at most `accelerators_per_node`, dividing `n_heads`
   and `n_kv_heads`.
2. PP is the outer model-parallel dimension (ranks tp apart, so it crosses nodes once tp*pp
   exceeds a node): 1 <= pp <= min(max_pp, n_layers); `max_pp` defaults to the article's 4 for
   small clusters. Layers need not split evenly: no stage gets more than ceil(n_layers / pp),
   and the memory estimate is for that heaviest stage, which also holds the embedding or head.
3. TP is searched upwards and, for each TP, PP upwards; the first (tp, pp) whose per-device
   memory (state + activations of the chosen checkpointing mode, 1F1B schedule) fits
   `usable_memory_fraction` of the card wins. The shallowest fitting PP is taken because every
   extra stage adds bubble; bandwidths are reported, they do not steer the choice.
4. DP fills the rest: dp = world / (tp * pp) must be whole, and the global batch must split into
   dp * num_microbatches whole micro-batches.

Memory accounting (mixed precision, the ZeRO paper's 16 B/param): bf16 weights (2 B) + bf16
grads (2 B) + fp32 master weights and two Adam moments (12 B). zero_stage=0 (default) is plain
DP as in Megatron without its distributed optimizer: the state is replicated over DP and split
only by TP and PP. That is the accounting under which the reference table's 10B and 100B rows
come out. zero_stage 1/2/3 shard the optimizer state / also grads / also weights over DP
(forgeline's FSDP2 is stage 3).

How this reproduces the article's reference table: see REFERENCE_DIFFERENCES.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from forgeline.configs.schema import ACTIVATION_CHECKPOINT_MODES, ActivationCheckpoint, Config, ModelConfig

GIB = 2**30
GB = 1e9

REFERENCE_DIFFERENCES = """Where the planner meets the article's table (section 1.2) and where it does not.

tests/unit/test_plan.py builds each row with the shape `shape_from_params` derives, seq_len 2048,
micro-batch 1 (global batch = DP x 16 micro-batches), no recomputation, plain DP (zero_stage=0),
90% of the card usable, and world = TP*PP*DP of the row.
- 10B-class (9.98B), 40 GiB cards, 8-GPU nodes: TP=4 PP=2, as in the table. This hinges on keeping
  all activations, which 1F1B does not shrink with PP: with selective or full recomputation
  TP=2 PP=4 already fits and the planner, smallest TP first, returns that instead.
- 100B-class (101.5B), 80 GiB cards, 8-GPU nodes: TP=8 PP=4, as in the table (69.9 of 72 GiB
  usable; any TP=4 layout with PP <= 4 holds at least 95 GiB of state).
- 1T-class (977B), 80 GiB cards: TP=16 exceeds an 8-GPU node, so the test assumes 16-accelerator
  NVLink domains. Even then the row does not hold under the accounting that reproduces the other
  two: 16 B/param over TP*PP = 128 is 114 GiB of state per card, more than the 80 GiB the table
  asks for, so the planner raises ValueError (with max_pp=8, the article's PP). The table's row
  implies the optimizer state is sharded over DP: with zero_stage=1 its TP=16 PP=8 layout fits.
"""


@dataclass(frozen=True)
class Cluster:
    """Hardware. Bandwidths are per accelerator, in GB/s (1e9 bytes/s)."""

    accelerators_per_node: int
    num_nodes: int
    memory_gib: float
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float

    @property
    def world_size(self) -> int:
        return self.accelerators_per_node * self.num_nodes


@dataclass(frozen=True)
class Workload:
    """Batch, precision and resilience settings the layout must serve."""

    seq_len: int
    global_batch_size: int
    """Sequences per optimizer step."""
    num_microbatches: int
    """Micro-batches per step on each pipeline; the micro-batch size is G / (dp * m)."""
    activation_checkpointing: ActivationCheckpoint = "selective"
    param_bytes: int = 2
    """Bytes per weight and per gradient (bf16); activations use the same 16-bit type."""
    optimizer_bytes: int = 12
    """fp32 master weight + Adam first and second moments, bytes per parameter."""
    zero_stage: int = 0
    """0: plain DP; 1, 2, 3: optimizer state / also grads / also weights sharded over DP."""
    max_pp: int = 4
    """Deepest pipeline allowed; the article's cap for small clusters, raise it for large ones."""
    usable_memory_fraction: float = 0.9
    """Share of the card left after CUDA context, communication buffers and fragmentation."""
    checkpoint_window_s: float = 300.0
    mtbf_hours: float = 24.0
    """Mean time between failures of the whole job (node MTBF / number of nodes)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device on the heaviest pipeline stage."""

    params: float
    grads: float
    optimizer: float
    activations: dict[str, float]
    """Activation bytes under each checkpointing mode, so the report can compare them."""
    mode: str
    usable: float

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations[self.mode]

    @property
    def fits(self) -> bool:
        return self.total <= self.usable


@dataclass(frozen=True)
class CommEstimate:
    """Bytes each device sends per optimizer step, and seconds at the given bandwidth, unoverlapped."""

    tp_bytes: float
    dp_bytes: float
    pp_bytes: float
    tp_s: float
    dp_s: float
    pp_s: float


@dataclass(frozen=True)
class CheckpointEstimate:
    """What checkpointing costs: size, bandwidth for the save window, and the best interval."""

    size_bytes: float
    """Weights plus optimizer state (master weights and moments); gradients are not saved."""
    write_gb_per_s: float
    write_gbit_per_s: float
    young_interval_s: float
    daly_interval_s: float


@dataclass(frozen=True)
class Plan:
    """The chosen layout, its inputs, and what it costs."""

    shape: ModelConfig
    cluster: Cluster
    workload: Workload
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    layers_per_stage: int
    """Layers on the heaviest stage, ceil(n_layers / pp)."""
    memory: MemoryEstimate
    bubble_fraction: float
    comm: CommEstimate
    checkpoint: CheckpointEstimate


def activation_bytes_per_layer(shape: ModelConfig, seq_len: int, micro_batch: float, tp: int,
                               mode: str) -> float:
    """Bytes one block keeps for backward per micro-batch, with TP and sequence parallelism.

    Korthikanti et al. 2022, "Reducing Activation Recomputation", Table 2:
    none: s*b*h*(34 + 5*a*s/h) / t; selective (attention core recomputed): 34*s*b*h / t;
    full (only the block input kept): 2*s*b*h / t. The 34 counts the 16-bit tensors and 1-byte
    dropout masks of a GPT block; a Llama block differs by a few s*b*h, kept as published.
    """
    sbh = seq_len * micro_batch * shape.dim
    if mode == "full":
        return 2 * sbh / tp
    per_element = 34 if mode == "selective" else 34 + 5 * shape.n_heads * seq_len / shape.dim
    return sbh * per_element / tp


def bubble_fraction(pp: int, num_microbatches: int) -> float:
    """Idle share of a 1F1B or GPipe schedule: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (num_microbatches + pp - 1)


def storage_bandwidth(size_bytes: float, window_s: float) -> tuple[float, float]:
    """(GB/s, Gbit/s) needed to write `size_bytes` within `window_s`.

    The article's "size (GB) x 8 / window (s)" is the Gbit/s figure: its 200 GB in 300 s gives
    5.33 Gbit/s, i.e. 0.67 GB/s, although the article labels it "5.3GB/s".
    """
    gb_per_s = size_bytes / GB / window_s
    return gb_per_s, 8 * gb_per_s


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young 1974: the compute time between checkpoints minimizing lost work, sqrt(2*C*M)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly 2006 higher-order optimum, more accurate when C is not small against M.

    sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else M.
    """
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return young_interval(checkpoint_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s


def shape_from_params(num_params: float, vocab_size: int = 32000) -> ModelConfig:
    """A plausible Llama-like shape with about `num_params` parameters.

    Rule: head_dim 128 and full multi-head attention (n_kv_heads = n_heads); dim ~ 128 * n_layers,
    as in Llama 7B/13B and GPT-3, so with ~12*dim^2 weights per block dim = cbrt(128 * N / 12),
    rounded to a multiple of 2048 (16 heads, so every power-of-two TP up to 16 divides the heads);
    ffn_dim = 8/3 * dim rounded up to a multiple of 256; n_layers fills the remaining count, rounded
    to a multiple of 8 so PP up to 8 splits evenly. Meant for N of about 1B and up.
    """
    dim = 2048 * max(1, round((128 * num_params / 12) ** (1 / 3) / 2048))
    ffn_dim = 256 * math.ceil(8 * dim / 3 / 256)
    head = ModelConfig(dim=dim, n_layers=1, n_heads=dim // 128, n_kv_heads=dim // 128, ffn_dim=ffn_dim,
                       vocab_size=vocab_size)
    n_layers = (num_params - 2 * vocab_size * dim) / head.layer_params
    return head.model_copy(update={"n_layers": max(8, 8 * round(n_layers / 8))})


def memory_estimate(shape: ModelConfig, cluster: Cluster, workload: Workload, tp: int, pp: int,
                    dp: float) -> MemoryEstimate:
    """Per-device bytes for a layout; activations assume 1F1B, whose first stage keeps min(p, m)
    micro-batches of ceil(L/p) layers in flight, so PP barely shrinks activations and TP does."""
    params = _stage_params(shape, pp) / tp

    def sharded(stage: int) -> float:
        return dp if workload.zero_stage >= stage else 1

    micro_batch = workload.global_batch_size / (dp * workload.num_microbatches)
    in_flight = min(pp, workload.num_microbatches) * math.ceil(shape.n_layers / pp)

    def per_layer(mode: str) -> float:
        return activation_bytes_per_layer(shape, workload.seq_len, micro_batch, tp, mode)

    activations = {mode: in_flight * per_layer(mode) for mode in ACTIVATION_CHECKPOINT_MODES}
    activations["full"] += per_layer("none")  # the block being recomputed holds all its tensors
    return MemoryEstimate(
        params=params * workload.param_bytes / sharded(3),
        grads=params * workload.param_bytes / sharded(2),
        optimizer=params * workload.optimizer_bytes / sharded(1),
        activations=activations,
        mode=workload.activation_checkpointing,
        usable=cluster.memory_gib * GIB * workload.usable_memory_fraction,
    )


def comm_estimate(shape: ModelConfig, cluster: Cluster, workload: Workload, tp: int, pp: int,
                  dp: int) -> CommEstimate:
    """Per-step traffic of one device, ring algorithms.

    TP: 4 all-reduces of s*b*h per block per micro-batch (2 forward, 2 backward; 6 with full
    recomputation), each moving 2(t-1)/t of the tensor. DP: gradient all-reduce, or reduce-scatter
    plus all-gather under ZeRO, 2(d-1)/d of the stage's weights / t (3(d-1)/d under ZeRO-3, which
    gathers weights again for backward). PP: one s*b*h activation forward and its gradient backward
    per micro-batch. TP runs on NVLink; DP crosses nodes once the job does; PP once tp*pp does.
    """
    activation = workload.seq_len * _micro_batch(workload, dp) * shape.dim * workload.param_bytes
    all_reduces = 6 if workload.activation_checkpointing == "full" else 4
    layers = math.ceil(shape.n_layers / pp)
    tp_bytes = workload.num_microbatches * layers * all_reduces * 2 * (tp - 1) / tp * activation
    dp_factor = 3 if workload.zero_stage == 3 else 2
    dp_bytes = dp_factor * (dp - 1) / dp * _stage_params(shape, pp) / tp * workload.param_bytes
    pp_bytes = 0 if pp == 1 else 2 * workload.num_microbatches * activation
    intra, inter = cluster.intra_node_gb_per_s * GB, cluster.inter_node_gb_per_s * GB
    dp_link = inter if cluster.world_size > cluster.accelerators_per_node else intra
    pp_link = inter if tp * pp > cluster.accelerators_per_node else intra
    return CommEstimate(tp_bytes, dp_bytes, pp_bytes,
                        tp_bytes / intra, dp_bytes / dp_link, pp_bytes / pp_link)


def checkpoint_estimate(shape: ModelConfig, workload: Workload) -> CheckpointEstimate:
    """Checkpoint size, the storage bandwidth the save window needs, and the Young/Daly interval.

    C (the write time) is the save window, i.e. storage delivering exactly the needed bandwidth.
    """
    size = shape.num_params() * (workload.param_bytes + workload.optimizer_bytes)
    gb_per_s, gbit_per_s = storage_bandwidth(size, workload.checkpoint_window_s)
    mtbf_s = workload.mtbf_hours * 3600
    return CheckpointEstimate(size, gb_per_s, gbit_per_s,
                              young_interval(workload.checkpoint_window_s, mtbf_s),
                              daly_interval(workload.checkpoint_window_s, mtbf_s))


def tp_candidates(shape: ModelConfig, cluster: Cluster) -> list[int]:
    """Powers of two within a node that divide both head counts, smallest first."""
    powers = [2**k for k in range(int(math.log2(cluster.accelerators_per_node)) + 1)]
    return [tp for tp in powers if shape.n_heads % tp == 0 and shape.n_kv_heads % tp == 0]


def plan(shape: ModelConfig, cluster: Cluster, workload: Workload) -> Plan:
    """The layout the module docstring's rules choose, with its estimates.

    Raises:
        ValueError: when the inputs are invalid or no layout fits; the message names the numbers
            and what to change.
    """
    _validate(workload)
    world = cluster.world_size
    leanest: tuple[float, int, int] | None = None
    rejected: list[str] = []
    for tp in tp_candidates(shape, cluster):
        for pp in range(1, min(workload.max_pp, shape.n_layers) + 1):
            if tp * pp > world:
                break
            memory = memory_estimate(shape, cluster, workload, tp, pp, world / (tp * pp))
            problem = _layout_problem(world, workload, tp, pp)
            if memory.fits and not problem:
                return _make_plan(shape, cluster, workload, tp, pp, memory)
            if memory.fits:
                rejected.append(problem)
            elif world % (tp * pp) == 0:
                leanest = min(leanest or (math.inf, 0, 0), (memory.total, tp, pp))
    raise ValueError(_no_fit_message(cluster, workload, leanest, rejected))


def plan_for_params(num_params: float, cluster: Cluster, workload: Workload,
                    vocab_size: int = 32000) -> Plan:
    """`plan` for a parameter count, using the shape `shape_from_params` derives."""
    return plan(shape_from_params(num_params, vocab_size), cluster, workload)


def format_report(result: Plan) -> str:
    """A readable two-column table of a plan: layout, memory, bubble, traffic, checkpointing."""
    s, c, w, m, comm, ckpt = (result.shape, result.cluster, result.workload, result.memory, result.comm,
                              result.checkpoint)
    rows = [
        ("model", f"{_count(s.num_params())} params: dim {s.dim}, {s.n_layers} layers, heads "
                  f"{s.n_heads}/{s.n_kv_heads}, ffn {s.ffn_dim}, vocab {s.vocab_size}"),
        ("layout", f"TP={result.tp} PP={result.pp} DP={result.dp}, {c.num_nodes}x{c.accelerators_per_node}"),
        ("micro-batches", f"{w.num_microbatches} x {result.micro_batch_size} seq of {w.seq_len}; "
                          f"{result.layers_per_stage} layers on the heaviest stage"),
    ]
    per_device = [("params", m.params), ("grads", m.grads), (f"optimizer (ZeRO-{w.zero_stage})", m.optimizer)]
    per_device += [(f"act {mode}{' <- used' * (mode == m.mode)}", m.activations[mode])
                   for mode in ACTIVATION_CHECKPOINT_MODES]
    rows += [(label, f"{value / GIB:.2f} GiB/device") for label, value in per_device]
    rows += [
        ("total", f"{m.total / GIB:.2f} of {m.usable / GIB:.2f} GiB usable "
                  f"({c.memory_gib:g} GiB x {w.usable_memory_fraction:g})"),
        ("bubble", f"{result.bubble_fraction:.1%} = (p-1)/(m+p-1)"),
        ("TP traffic/step", f"{comm.tp_bytes / GB:.2f} GB, {comm.tp_s:.3f} s"),
        ("DP traffic/step", f"{comm.dp_bytes / GB:.2f} GB, {comm.dp_s:.3f} s"),
        ("PP traffic/step", f"{comm.pp_bytes / GB:.2f} GB, {comm.pp_s:.3f} s"),
        ("checkpoint", f"{ckpt.size_bytes / GB:.1f} GB (weights + optimizer state)"),
        (f"save in {w.checkpoint_window_s:g} s", f"{ckpt.write_gb_per_s:.2f} GB/s = "
                                                 f"{ckpt.write_gbit_per_s:.2f} Gbit/s"),
        (f"interval, MTBF {w.mtbf_hours:g} h", f"Young {ckpt.young_interval_s / 60:.1f} min, "
                                               f"Daly {ckpt.daly_interval_s / 60:.1f} min"),
    ]
    return "\n".join(f"{label:<24}{value}" for label, value in rows)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _stage_params(shape: ModelConfig, pp: int) -> int:
    """Weights of the heaviest stage: ceil(L/p) blocks plus the embedding or the head and final
    norm (both when pp == 1). Norms are counted whole on every TP rank: they are tiny."""
    ends = 2 if pp == 1 else 1
    blocks = math.ceil(shape.n_layers / pp) * shape.layer_params
    return blocks + ends * shape.vocab_size * shape.dim + shape.dim


def _micro_batch(workload: Workload, dp: int) -> int:
    return workload.global_batch_size // (dp * workload.num_microbatches)


def _layout_problem(world: int, workload: Workload, tp: int, pp: int) -> str | None:
    """Why a layout that fits memory cannot run: its degrees or batch do not divide, or the
    pipeline has fewer micro-batches than stages (1F1B, which the estimate assumes, refuses it)."""
    if pp > workload.num_microbatches:
        return (f"TP={tp} PP={pp} fits, but 1F1B needs num_microbatches >= pp: {workload.num_microbatches} "
                f"< {pp}; raise num_microbatches")
    if world % (tp * pp):
        return (f"TP={tp} PP={pp} fits, but tp*pp={tp * pp} does not divide the world size {world}; "
                f"change num_nodes")
    dp = world // (tp * pp)
    if workload.global_batch_size % (dp * workload.num_microbatches):
        return (f"TP={tp} PP={pp} fits, but global_batch_size={workload.global_batch_size} does not "
                f"split into dp={dp} x num_microbatches={workload.num_microbatches} whole micro-batches; "
                f"change either")
    return None


def _no_fit_message(cluster: Cluster, workload: Workload, leanest: tuple[float, int, int] | None,
                    rejected: list[str]) -> str:
    """Why nothing was chosen: layouts that fit but do not divide, else the leanest memory miss."""
    memory, fraction = cluster.memory_gib, workload.usable_memory_fraction
    lines = [f"no layout fits {cluster.num_nodes} nodes x {cluster.accelerators_per_node} accelerators with "
             f"{memory * fraction:.1f} GiB usable each ({memory:g} GiB x {fraction:g})"]
    lines += [f"  {problem}" for problem in rejected]
    if leanest and not rejected:
        total, tp, pp = leanest
        lines.append(f"  the leanest layout, TP={tp} PP={pp}, needs {total / GIB:.1f} GiB per device: raise "
                     f"max_pp (now {workload.max_pp}), use cards with more memory, shard optimizer state "
                     f"(zero_stage, now {workload.zero_stage}) or recompute activations "
                     f"(activation_checkpointing, now {workload.activation_checkpointing!r})")
    return "\n".join(lines)


def _validate(workload: Workload) -> None:
    """Reject option values that would otherwise silently act like another one."""
    if workload.activation_checkpointing not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpointing={workload.activation_checkpointing!r}; "
                         f"use one of {ACTIVATION_CHECKPOINT_MODES}")
    if workload.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={workload.zero_stage}; use 0, 1, 2 or 3")
    if not 0 < workload.usable_memory_fraction <= 1:
        raise ValueError(f"usable_memory_fraction={workload.usable_memory_fraction} must be in (0, 1]")


def _make_plan(shape: ModelConfig, cluster: Cluster, workload: Workload, tp: int, pp: int,
               memory: MemoryEstimate) -> Plan:
    dp = cluster.world_size // (tp * pp)
    return Plan(shape, cluster, workload, tp, pp, dp, micro_batch_size=_micro_batch(workload, dp),
                layers_per_stage=math.ceil(shape.n_layers / pp), memory=memory,
                bubble_fraction=bubble_fraction(pp, workload.num_microbatches),
                comm=comm_estimate(shape, cluster, workload, tp, pp, dp),
                checkpoint=checkpoint_estimate(shape, workload))


def plan_run_config(cfg: Config, cluster: Cluster, workload: Workload,
                    num_params: float | None = None) -> Plan:
    """Plan for a forgeline config's model (or, given `num_params`, a derived shape of that size);
    the vocabulary is the model's, else the size the data stage trains its tokenizer to."""
    vocab_size = cfg.model.vocab_size or cfg.data.vocab_size
    if num_params is not None:
        return plan_for_params(num_params, cluster, workload, vocab_size=vocab_size)
    return plan(cfg.model.for_vocabulary(vocab_size), cluster, workload)


def apply_plan(cfg: Config, result: Plan) -> tuple[dict[str, Any], str | None]:
    """`cfg`'s keys with its parallel section and global batch set to the plan -- data parallel
    as FSDP2 shards -- validated like any config, and what the user must still set before the
    launch takes it (None: nothing). That is the rendezvous of a layout across nodes under
    torchrun, which only the user knows: the keys keep `parallel.rdzv_endpoint` empty, and the
    launch refuses them, naming it, until it is set."""
    raw = cfg.dump_to_write()  # read again, the planned file names a run of its own
    raw["parallel"] |= {"tp": result.tp, "pp": result.pp, "dp_shard": result.dp, "dp_replicate": 1,
                        "pp_microbatches": result.workload.num_microbatches,
                        "activation_checkpoint": result.workload.activation_checkpointing,
                        "nnodes": result.cluster.num_nodes}
    raw["train"]["global_batch_size"] = result.workload.global_batch_size
    open_rendezvous = (result.cluster.num_nodes > 1 and raw["parallel"]["launcher"] == "torchrun"
                       and not raw["parallel"]["rdzv_endpoint"])
    if not open_rendezvous:
        Config.model_validate(raw)
        return raw, None
    Config.model_validate(raw | {"parallel": raw["parallel"] | {"rdzv_endpoint": "host:0"}})  # all else
    return raw, (f"the layout spans {result.cluster.num_nodes} nodes: set parallel.rdzv_endpoint to the "
                 "HOST:PORT of a rendezvous reachable from every node (or run with parallel.launcher=slurm, "
                 "whose job's first node is the rendezvous)")
