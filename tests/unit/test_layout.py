"""The parallel layout: validation before launch, the pipeline split rule, precision."""

from pathlib import Path

import pytest
import torch

from forgeline.configs import ConfigError, load_config
from forgeline.configs.schema import LayoutError, ModelConfig
from forgeline.flows.cli import main
from forgeline.model.parallel import mesh
from forgeline.model.parallel.mesh import resolve_precision
from forgeline.model.parallel.pipelining import layer_ranges, pipeline_split, stage_ids_of_rank
from forgeline.model.transformer import Transformer


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2", "parallel.pp_microbatches=1", "train.global_batch_size=16"],
     "pp_schedule 1F1B needs pp_microbatches >= stages: 1 < 2"),
    (["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
     "pp_schedule ZBVZeroBubble runs exactly 2 stages per rank; got pp_stages_per_rank=1"),
    (["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
     "pp_schedule Interleaved1F1B interleaves stages: set pp_stages_per_rank >= 2"),
    (["parallel.pp=2", "parallel.pp_stages_per_rank=2"],
     "pp_schedule 1F1B runs one stage per rank; got pp_stages_per_rank=2"),
    (["parallel.pp_stages_per_rank=2"], "pp_stages_per_rank=2 needs pp > 1"),
    (["parallel.pp=4", "parallel.pp_stages_per_rank=2", "parallel.pp_schedule=LoopedBFS",
      "parallel.pp_microbatches=4"],
     "8 pipeline stages (pp=4 x pp_stages_per_rank=2) need at least as many layers; model.n_layers=4"),
    (["parallel.pp=2", "parallel.pp_microbatches=3"],
     "the per-rank batch of one accumulation step, 16 sequences, must divide into "
     "parallel.pp_microbatches=3"),
    (["parallel.dp_shard=3"], "must be divisible by dp_replicate*dp_shard*grad_accum_steps = 1*3*1 = 3"),
    (["parallel.dp_shard=3", "parallel.nnodes=2", "train.global_batch_size=12"],
     "world size pp*dp_replicate*dp_shard*tp = 3 is not divisible by nnodes=2"),
    (["parallel.tp=4", "parallel.nnodes=2", "parallel.rdzv_endpoint=h:1"],
     "tp=4 must divide the 2 ranks per node, so no tensor-parallel group crosses a node"),
    (["parallel.dp_shard=2", "parallel.nnodes=2"], "nnodes=2 needs rdzv_endpoint"),
    (["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=2",
      "parallel.pp_microbatches=5", "train.global_batch_size=20"],
     "needs pp_microbatches to be a multiple of max(1, pp_microbatches // pp) = 2; got 5"),
])
def test_invalid_layouts_fail_before_launch_naming_the_numbers(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-single.yaml", overrides)
    assert message in str(err.value)


def test_invalid_layout_launches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=1"]) == 2
    assert "needs pp_microbatches >= stages" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_world_size_must_match_the_degrees() -> None:
    expected = r"pp\*dp_replicate\*dp_shard\*tp = 2\*1\*2\*2 = 8 but WORLD_SIZE = 6"
    overrides = ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"]
    layout = load_config("tiny-single.yaml", overrides).parallel
    with pytest.raises(LayoutError, match=expected):
        layout.check_world_size(6)


def test_auto_precision_is_fp32_on_cpu() -> None:
    assert resolve_precision("auto", "cpu") == torch.float32
    assert resolve_precision("fp16", "cpu") == torch.float16


def test_bf16_is_refused_on_a_cpu_without_native_support(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(LayoutError, match="30-90x slower than fp32; use train.precision=fp32"):
        resolve_precision("bf16", "cpu")


def test_bf16_refusal_happens_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(mesh, "cpu_has_native_bf16", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--set", "train.precision=bf16"]) == 2
    assert "use train.precision=fp32" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_layers_split_contiguously_earlier_stages_take_the_extra() -> None:
    assert layer_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]


def test_stage_placement_loops_or_forms_a_v() -> None:
    assert [stage_ids_of_rank(r, 2, 2, v_style=False) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_of_rank(r, 2, 2, v_style=True) for r in range(2)] == [[0, 3], [1, 2]]
    assert [stage_ids_of_rank(r, 4, 1, v_style=False) for r in range(4)] == [[0], [1], [2], [3]]


def test_pipeline_split_keeps_parameter_names() -> None:
    cfg = load_config("tiny.yaml", ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B",
                                    "parallel.pp_stages_per_rank=2"])
    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                        ffn_dim=64))
    names = set()
    for pp_rank in range(2):
        for stage_id, stage in pipeline_split(model, pp_rank, cfg.parallel):
            assert list(stage.layers) == [str(stage_id)]
            assert (stage.tok_embeddings is not None) == (stage_id == 0)
            assert (stage.output is not None) == (stage_id == 3)
            names |= {name for name, _ in stage.named_parameters()}
    assert names == {name for name, _ in model.named_parameters()}
