import dataclasses
import math

import pytest

from forgeline.configs.schema import ModelConfig
from forgeline.model.parallel.planner import (
    GIB,
    Cluster,
    Workload,
    bubble_fraction,
    daly_interval,
    format_report,
    memory_estimate,
    plan,
    plan_for_params,
    shape_from_params,
    storage_bandwidth,
    tp_candidates,
    young_interval,
)

MICROBATCHES = 16

# The article's table (section 1.2), with the hardware each row implies. The same workload for every
# row: seq 2048, micro-batch 1 (global batch = DP x 16), no recomputation, plain DP. Bandwidths are
# per accelerator: NVLink 300 GB/s; IB / RoCE at 200 Gbit/s = 25 GB/s. The 1T row's TP=16 exceeds an
# 8-GPU node, so it assumes 16-accelerator NVLink domains.
ROWS = {
    "10B": dict(params=10e9, tp=4, pp=2, dp=32, memory_gib=40, per_node=8),
    "100B": dict(params=100e9, tp=8, pp=4, dp=64, memory_gib=80, per_node=8),
    "1T": dict(params=1e12, tp=16, pp=8, dp=128, memory_gib=80, per_node=16),
}


def row_inputs(name: str, **workload_overrides) -> tuple[ModelConfig, Cluster, Workload]:
    row = ROWS[name]
    world = row["tp"] * row["pp"] * row["dp"]
    cluster = Cluster(row["per_node"], world // row["per_node"], row["memory_gib"], 300.0, 25.0)
    settings = dict(seq_len=2048, global_batch_size=row["dp"] * MICROBATCHES, num_microbatches=MICROBATCHES,
                    activation_checkpointing="none", max_pp=max(4, row["pp"]))
    workload = Workload(**{**settings, **workload_overrides})
    return shape_from_params(row["params"]), cluster, workload


@pytest.mark.parametrize("name", ["10B", "100B"])
def test_reference_rows_match_the_table(name: str) -> None:
    result = plan(*row_inputs(name))
    row = ROWS[name]
    assert (result.tp, result.pp, result.dp) == (row["tp"], row["pp"], row["dp"])
    assert result.micro_batch_size == 1


def test_10b_row_needs_activations_kept() -> None:
    # Documented in REFERENCE_DIFFERENCES: recomputation makes TP=2 PP=4 fit first.
    result = plan(*row_inputs("10B", activation_checkpointing="selective"))
    assert (result.tp, result.pp) == (2, 4)


def test_1t_row_differs_state_alone_overflows_under_plain_dp() -> None:
    # Documented in REFERENCE_DIFFERENCES: 16 B/param over TP*PP = 128 is ~114 GiB of state per
    # 80 GiB card, so the planner raises; the table's layout only fits with sharded optimizer state.
    shape, cluster, workload = row_inputs("1T")
    with pytest.raises(ValueError, match=r"TP=16 PP=8, needs 1\d\d\.\d GiB.*zero_stage, now 0"):
        plan(shape, cluster, workload)
    plain = memory_estimate(shape, cluster, workload, 16, 8, 128)
    assert 110 * GIB < plain.state < 120 * GIB
    sharded = dataclasses.replace(workload, zero_stage=1, activation_checkpointing="selective")
    assert memory_estimate(shape, cluster, sharded, 16, 8, 128).fits


def test_shape_from_params_is_llama_like_and_close() -> None:
    shape = shape_from_params(100e9)
    assert (shape.dim, shape.n_layers, shape.n_heads, shape.ffn_dim) == (10240, 80, 80, 27392)
    for target in (10e9, 100e9, 1e12):
        assert abs(shape_from_params(target).num_params() / target - 1) < 0.05


def test_memory_totals_add_up() -> None:
    result = plan(*row_inputs("100B"))
    memory = result.memory
    assert memory.grads == memory.params
    assert memory.optimizer == pytest.approx(6 * memory.params)  # 12 B vs 2 B per parameter
    assert memory.total == pytest.approx(memory.params + memory.grads + memory.optimizer
                                         + memory.activations["none"])
    assert memory.activations["full"] < memory.activations["selective"] < memory.activations["none"]
    assert memory.total <= memory.usable == 80 * GIB * 0.9
    # 16 B/param of the heaviest stage (20 blocks + the head) split over TP=8.
    stage = 20 * result.shape.layer_params + result.shape.vocab_size * result.shape.dim + result.shape.dim
    assert memory.state == pytest.approx(16 * stage / 8)


def test_zero_stages_shard_over_dp() -> None:
    shape, cluster, workload = row_inputs("100B")
    plain = memory_estimate(shape, cluster, workload, 8, 4, 64)
    for stage, sharded_fields in ((1, {"optimizer"}), (2, {"optimizer", "grads"}),
                                  (3, {"optimizer", "grads", "params"})):
        sharded = memory_estimate(shape, cluster, dataclasses.replace(workload, zero_stage=stage), 8, 4, 64)
        for field in ("params", "grads", "optimizer"):
            ratio = 64 if field in sharded_fields else 1
            assert getattr(sharded, field) == pytest.approx(getattr(plain, field) / ratio)


def test_bubble_fraction() -> None:
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)
    assert plan(*row_inputs("100B")).bubble_fraction == pytest.approx(3 / 19)


def test_young_and_daly_worked_example() -> None:
    # C = 5 min, MTBF = 24 h: Young sqrt(2 * 300 * 86400) = 7200 s exactly;
    # Daly 7200 * (1 + (1/24)/3 + (1/576)/9) - 300 = 7001.39 s.
    assert young_interval(300, 86400) == pytest.approx(7200)
    assert daly_interval(300, 86400) == pytest.approx(7200 * (1 + 1 / 72 + 1 / 5184) - 300)
    assert daly_interval(300, 86400) == pytest.approx(7001.39, abs=0.01)
    assert daly_interval(1000, 400) == 400  # C >= 2M: checkpoint once per MTBF


def test_storage_bandwidth_article_example() -> None:
    # The article: 200 GB within 5 minutes "needs at least 5.3GB/s"; the x8 makes that Gbit/s.
    gb_per_s, gbit_per_s = storage_bandwidth(200e9, 300)
    assert gb_per_s == pytest.approx(0.6667, abs=1e-4)
    assert gbit_per_s == pytest.approx(5.333, abs=1e-3)


def test_checkpoint_estimate_of_a_plan() -> None:
    result = plan(*row_inputs("100B", checkpoint_window_s=600, mtbf_hours=12))
    ckpt = result.checkpoint
    assert ckpt.size_bytes == result.shape.num_params() * 14  # bf16 weights + 12 B optimizer
    assert ckpt.write_gb_per_s == pytest.approx(ckpt.size_bytes / 1e9 / 600)
    assert ckpt.young_interval_s == pytest.approx(math.sqrt(2 * 600 * 12 * 3600))


def test_comm_volumes() -> None:
    result = plan(*row_inputs("100B"))
    activation = 2048 * 1 * 10240 * 2  # s * b * h * bytes
    comm = result.comm
    assert comm.tp_bytes == pytest.approx(MICROBATCHES * 20 * 4 * 2 * 7 / 8 * activation)
    assert comm.pp_bytes == 2 * MICROBATCHES * activation
    assert comm.dp_bytes == pytest.approx(2 * 63 / 64 * result.memory.params)
    assert comm.tp_s == pytest.approx(comm.tp_bytes / 300e9)
    assert comm.dp_s == pytest.approx(comm.dp_bytes / 25e9)


def test_plan_for_config_on_one_small_node() -> None:
    cluster = Cluster(8, 1, 80, 300, 25)
    shape = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=4096)
    result = plan(shape, cluster, Workload(seq_len=128, global_batch_size=64, num_microbatches=1))
    assert (result.tp, result.pp, result.dp) == (1, 1, 8)
    assert result.bubble_fraction == 0 and result.comm.pp_bytes == 0


def test_format_report_is_readable() -> None:
    report = format_report(plan_for_params(100e9, *row_inputs("100B")[1:]))
    assert "TP=8 PP=4 DP=64" in report
    for label in ("params", "grads", "optimizer", "act none", "total", "bubble", "Gbit/s", "Young", "Daly"):
        assert label in report


def test_tp_only_divides_heads_and_stays_in_node() -> None:
    shape = ModelConfig(dim=1536, n_layers=8, n_heads=12, n_kv_heads=6, ffn_dim=4096, vocab_size=1000)
    assert tp_candidates(shape, Cluster(8, 1, 80, 300, 25)) == [1, 2]


def test_world_not_divisible_names_the_numbers() -> None:
    # 100B needs TP=8 PP=4 on 80 GiB cards; on 5 nodes x 8 = 40 accelerators that fits memory, but
    # tp*pp = 32 does not divide 40.
    shape, _, workload = row_inputs("100B")
    with pytest.raises(ValueError, match="tp\\*pp=32 does not divide the world size 40"):
        plan(shape, Cluster(8, 5, 80, 300, 25), dataclasses.replace(workload, global_batch_size=16))


def test_batch_not_divisible_names_the_numbers() -> None:
    shape, cluster, workload = row_inputs("100B")
    with pytest.raises(ValueError, match="global_batch_size=1000 does not split into dp=64 x "
                                         "num_microbatches=16"):
        plan(shape, cluster, dataclasses.replace(workload, global_batch_size=1000))


def test_a_pipeline_deeper_than_its_micro_batches_is_not_chosen() -> None:
    # 5 heads: TP=1 only. PP=1 and PP=2 leave a batch of 16 to more ranks than it has sequences.
    shape = ModelConfig(dim=320, n_layers=4, n_heads=5, n_kv_heads=5, ffn_dim=688, vocab_size=4096)
    workload = Workload(seq_len=128, global_batch_size=16, num_microbatches=2)
    with pytest.raises(ValueError, match="TP=1 PP=4 fits, but 1F1B needs num_microbatches >= pp: 2 < 4"):
        plan(shape, Cluster(8, 4, 80, 300, 25), workload)


def test_no_tp_fits_says_what_to_change() -> None:
    shape, cluster, workload = row_inputs("100B")
    with pytest.raises(ValueError) as err:
        plan(shape, dataclasses.replace(cluster, memory_gib=24), workload)
    message = str(err.value)
    assert "21.6 GiB usable each (24 GiB x 0.9)" in message
    assert "TP=8 PP=4" in message and "max_pp (now 4)" in message and "more memory" in message


@pytest.mark.parametrize("change, message", [
    ({"activation_checkpointing": "some"}, "activation_checkpointing='some'"),
    ({"zero_stage": 4}, "zero_stage=4"),
    ({"usable_memory_fraction": 1.5}, "usable_memory_fraction=1.5"),
])
def test_invalid_options_are_rejected(change: dict, message: str) -> None:
    shape, cluster, workload = row_inputs("10B")
    with pytest.raises(ValueError, match=message):
        plan(shape, cluster, dataclasses.replace(workload, **change))


def test_inconsistent_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=8"):
        ModelConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=3, ffn_dim=512, vocab_size=100)
