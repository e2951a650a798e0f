"""Loss parity: every parallel layout trains, with real torchrun ranks, fp32, the same seed and
data, to the losses of one process -- within 1e-4 relative at each of 12 steps.

Parity follows from three things this checks together: initialization that depends only on the
seed and parameter names (not on sharding or the pipeline split), a loader whose global batch
is the same for every data-parallel degree, and steps that compute the gradient of the global
batch mean whatever the layout (microbatches, accumulation, clipping over all stages).

Every pipeline schedule forgeline offers runs here, and so do torch.compile (to the same 1e-4)
and the low precisions (fp16, bf16: the same curve within a measured tolerance)."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
from mlflow import MlflowClient

from forgeline.configs.schema import PipelineSchedule
from forgeline.model.parallel.mesh import cpu_has_native_bf16, local_device_type
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from tests.conftest import debug_config

pytestmark = pytest.mark.integration

STEPS = 12
# 4 layers so an interleaved schedule can place 2 stages on each of 2 pipeline ranks.
BASE = ["model.n_layers=4", f"train.steps={STEPS}", "checkpoint.every_steps=100", "train.peak_tflops=1"]
LAYOUTS = {
    "dp2": ["parallel.dp_shard=2"],
    "tp2": ["parallel.tp=2"],
    "pp2-1F1B": ["parallel.pp=2"],
    "dp2xtp2": ["parallel.dp_shard=2", "parallel.tp=2"],
    "pp2xdp2": ["parallel.pp=2", "parallel.dp_shard=2"],
    "pp2xdp2xtp2": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"],
    "pp2-GPipe": ["parallel.pp=2", "parallel.pp_schedule=GPipe"],
    "pp2-Interleaved1F1B": ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B",
                            "parallel.pp_stages_per_rank=2"],
    "pp2-LoopedBFS": ["parallel.pp=2", "parallel.pp_schedule=LoopedBFS", "parallel.pp_stages_per_rank=2"],
    "pp2-InterleavedZeroBubble": ["parallel.pp=2", "parallel.pp_schedule=InterleavedZeroBubble",
                                  "parallel.pp_stages_per_rank=2"],
    "pp2-ZBVZeroBubble": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble",
                          "parallel.pp_stages_per_rank=2"],
    # DualPipeV needs at least as many microbatches as its 4 stages.
    "pp2-DualPipeV": ["parallel.pp=2", "parallel.pp_schedule=DualPipeV", "parallel.pp_stages_per_rank=2",
                      "parallel.pp_microbatches=4"],
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "pp2-accum2-full-ac": ["parallel.pp=2", "train.grad_accum_steps=2",
                           "parallel.activation_checkpoint=full"],
    "tp2-no-sp-selective-ac": ["parallel.tp=2", "parallel.sequence_parallel=false",
                               "parallel.loss_parallel=false", "parallel.activation_checkpoint=selective"],
}
# torch.compile of every block against the eager single process, to the same 1e-4 (measured:
# bit-identical in one process, 7.6e-8 on dp2). The first step compiles: 17-34 s a test on 2
# cores with an empty inductor cache (12-16 s warm), hence slow. tp2 with compile is not here:
# on torch 2.13 its backward fails (AttributeError: 'Tensor' object has no attribute
# '_local_tensor'; docs/parallelism.md says so).
COMPILED = {
    "compile": ["parallel.compile=true"],
    "dp2-compile": ["parallel.dp_shard=2", "parallel.compile=true"],
}
# bf16 both ways forgeline applies it: torch.autocast where no FSDP casts the parameters (one
# process; any layout with dp == 1), FSDP2's MixedPrecisionPolicy under data parallelism.
BF16 = {
    "bf16-autocast": ["train.precision=bf16"],
    "dp2-bf16-fsdp": ["parallel.dp_shard=2", "train.precision=bf16"],
}
# Measured on the development CPU (AVX-512 BF16 and AMX), seeds 0-3, largest relative gap to
# fp32 over the 12 steps: autocast 3.0e-5 to 7.5e-5, FSDP 1.7e-4 to 2.8e-4 (the residual stream
# is bf16 there too); fp32 layouts agree within 2e-7. 1e-3 leaves 3.5x room for other bf16
# kernels' rounding (AVX-512 BF16 without AMX, a GPU), yet is a sixth of the 6e-3 relative one
# step of this run moves the loss on average (6.755 -> 6.281 in 12 steps): a bf16 path that
# lost, repeated or mis-scaled an update would stand out.
BF16_REL_TOLERANCE = 1e-3
FP32_REL_GAP = 1e-6  # at least this far somewhere: the run did compute in bf16


def step_losses(data_root: Path, root: Path, name: str, overrides: list[str]) -> list[float]:
    cfg = debug_config(root, f"data.out_dir={data_root / 'data'}", f"train.out_dir={root / name}",
                       *BASE, *overrides)
    result = run_stage(stage_named("train"), cfg)
    assert result.step == STEPS
    client = MlflowClient(resolve_tracking_uri(cfg))
    checkpoint = Path(result.checkpoint).resolve()
    [run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                               filter_string=f"tags.`forgeline.checkpoint` = '{checkpoint}'")
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, STEPS + 1))
    return [m.value for m in history]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def reference(data_root: Path, runs_root: Path) -> list[float]:
    losses = step_losses(data_root, runs_root, "single", [])
    assert losses[-1] < losses[0] - 0.3  # it learns: parity is not two flat lines
    return losses


def test_every_pipeline_schedule_has_a_layout() -> None:
    scheduled = {"1F1B"}  # the default
    for overrides in LAYOUTS.values():
        scheduled |= {key.split("=")[1] for key in overrides if key.startswith("parallel.pp_schedule=")}
    assert scheduled == set(get_args(PipelineSchedule))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_losses(name: str, data_root: Path, runs_root: Path,
                                              reference: list[float]) -> None:
    losses = step_losses(data_root, runs_root, name, LAYOUTS[name])
    assert losses == pytest.approx(reference, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_matches_eager_losses(name: str, data_root: Path, runs_root: Path,
                                       reference: list[float]) -> None:
    losses = step_losses(data_root, runs_root, name, COMPILED[name])
    assert losses == pytest.approx(reference, rel=1e-4)


@pytest.mark.skipif(local_device_type() == "cpu" and not cpu_has_native_bf16(),
                    reason="train.precision=bf16 is refused on a CPU without native bf16")
@pytest.mark.parametrize("name", list(BF16))
def test_bf16_tracks_fp32(name: str, data_root: Path, runs_root: Path, reference: list[float]) -> None:
    losses = step_losses(data_root, runs_root, name, BF16[name])
    gaps = [abs(loss - ref) / ref for loss, ref in zip(losses, reference, strict=True)]
    assert FP32_REL_GAP < max(gaps) < BF16_REL_TOLERANCE, gaps


def test_fp16_with_loss_scaling_tracks_fp32(data_root: Path, runs_root: Path, reference: list[float]) -> None:
    """Not parity -- fp16 rounds -- but the same curve: FSDP's MixedPrecisionPolicy computes in
    fp16 under pipeline parallelism, the dynamic loss scaler keeps gradients finite."""
    losses = step_losses(data_root, runs_root, "pp2xdp2-fp16",
                         ["parallel.pp=2", "parallel.dp_shard=2", "train.precision=fp16"])
    assert losses == pytest.approx(reference, rel=2e-3)
