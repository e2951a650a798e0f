"""bench/load_memory: what a rank holds in memory while `model.init_from` loads a base into a
sharded layout -- its shard plus one tensor, or the whole model?

    .venv/bin/python bench/load_memory.py [--layouts dp4 pp2xdp2]

The model is SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (538 MB of weights). For each
layout, 4 torchrun ranks (CPU, gloo) build the trainer's model as a train stage rank does
(build_model_parts with model.init_from set: FSDP-sharded, materialized with to_empty), then
call load_hf_weights -- DCP's HuggingFaceStorageReader reading the safetensors. Per rank,
against the memory just before the load: the peak RSS increase (VmHWM), and its anonymous and
file-backed parts sampled every millisecond (the file-backed part is the memory-mapped
safetensors: page cache, shared by the ranks), next to the rank's shard in bytes, its largest
local shard of one tensor, and the largest whole tensor of the model. Writes
bench/results/load_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before transformers is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from cpt import MB, MODEL_NAME, PeakSampler, smollm2_dir  # noqa: E402  (bench/, the script's own directory)
from results_file import write_results  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from forgeline.configs import Config, load_config  # noqa: E402
from forgeline.model.hf import load_hf_weights  # noqa: E402
from forgeline.model.parallel.mesh import build_meshes, init_distributed  # noqa: E402
from forgeline.model.training.worker import build_model_parts  # noqa: E402
from forgeline.model.transformer import Transformer  # noqa: E402
from forgeline.tasks.pretrained import resolve_base, with_base  # noqa: E402
from forgeline.tasks.train.job import rank_config_yaml  # noqa: E402

WORLD_SIZE = 4
LAYOUTS = {
    "dp4": {"parallel.dp_shard": 4},
    "pp2xdp2": {"parallel.pp": 2, "parallel.dp_shard": 2},
}


def layout_config(base_dir: Path, layout: str) -> Config:
    cfg = Config().with_values({"model.init_from": str(base_dir), "train.precision": "fp32",
                                **LAYOUTS[layout]})
    return with_base(cfg, resolve_base(cfg))


def local_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


def rank_main(config_path: Path, out: Path) -> None:
    """One rank: the model in the layout, then the load under the sampler."""
    cfg = load_config(config_path)
    device, rank, world_size = init_distributed()
    try:
        mesh, _ = build_meshes(cfg.parallel, world_size, device.type)
        parts = [module for _, module in build_model_parts(cfg, cfg.model, mesh, device, torch.float32)]
        params = [p for part in parts for p in part.parameters()]
        dist.barrier()
        with PeakSampler() as loading:
            load_hf_weights(parts, Path(cfg.model.init_from), cfg.model)
        figures = {
            "rank": rank, "params": len(params),
            "shard_mb": round(sum(local_bytes(p) for p in params) / MB, 1),
            "largest_local_shard_mb": round(max(local_bytes(p) for p in params) / MB, 1),
            "largest_whole_tensor_of_rank_mb": round(
                max(p.numel() * p.element_size() for p in params) / MB, 1),
            **loading.increases(),
        }
        gathered = [None] * world_size
        dist.all_gather_object(gathered, figures)
        if rank == 0:
            out.write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def run_layout(base_dir: Path, layout: str, workdir: Path) -> list[dict]:
    cfg = layout_config(base_dir, layout)
    config_path, out = workdir / f"{layout}.yaml", workdir / f"{layout}.json"
    config_path.write_text(rank_config_yaml(cfg))
    env = os.environ | {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={WORLD_SIZE}", __file__, "--rank-config", str(config_path),
                    "--out", str(out)], env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    parser.add_argument("--rank-config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        rank_main(args.rank_config, args.out)
        return

    base_dir = smollm2_dir()
    cfg = layout_config(base_dir, args.layouts[0])
    with torch.device("meta"):
        whole = {name: p.numel() * p.element_size() for name, p in Transformer(cfg.model).named_parameters()}
    results: dict = {
        "model": MODEL_NAME, "world_size": WORLD_SIZE,
        "model_mb": round(sum(whole.values()) / MB, 1),
        "largest_tensor": max(whole, key=whole.get),
        "largest_tensor_mb": round(max(whole.values()) / MB, 1),
        "layouts": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-load-memory-") as scratch:
        for layout in args.layouts:
            ranks = run_layout(base_dir, layout, Path(scratch))
            for rank in ranks:
                rank["anon_peak_minus_shard_mb"] = round(rank["peak_anon_increase_mb"] - rank["shard_mb"], 1)
            results["layouts"][layout] = {"config": LAYOUTS[layout], "ranks": ranks}
    write_results("load_memory", results)


if __name__ == "__main__":
    main()
