"""The in-training evaluation's scores (eval/periodic.py): each with its standard error, the eval
stage's number under the eval stage's name, on a tiny random model over the debug data."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeline.configs.schema import DimensionConfig
from forgeline.eval.dimensions import task_score
from forgeline.eval.periodic import describe, score_tasks
from forgeline.eval.scores import stderr_metrics
from forgeline.eval.suite import render_suite, suite_task_manager
from forgeline.tasks.evaluate import score_lm
from tests.conftest import random_lm

TASKS = ["forgeline_heldout", "forgeline_arc_easy"]  # a bootstrapped aggregation and a mean
LIMIT = 4


def test_every_in_training_score_has_the_standard_error_the_eval_stage_gives_it(
        data_root: Path, tmp_path: Path) -> None:
    lm = random_lm(data_root / "data" / "tokenizer", tmp_path / "bundle", max_seq_len=512, batch_size=8)
    task_manager = suite_task_manager(render_suite(tmp_path / "suite", data_root / "data"))
    scores = score_tasks(lm, TASKS, LIMIT, task_manager)

    named = {name for name in scores if not name.startswith("stderr/")}
    assert {"forgeline_heldout/bits_per_byte", "forgeline_heldout/word_perplexity",
            "forgeline_heldout/byte_perplexity", "forgeline_arc_easy/acc",
            "forgeline_arc_easy/acc_norm"} <= named
    assert {f"stderr/{name}" for name in named} == set(scores) - named
    assert scores["stderr/forgeline_heldout/bits_per_byte"] > 0

    plan = {"language_modeling": ([task_score("forgeline_heldout")], DimensionConfig(limit=LIMIT)),
            "reasoning": ([task_score("forgeline_arc_easy")], DimensionConfig(limit=LIMIT))}
    stage = stderr_metrics(score_lm(lm, plan, task_manager).report(plan))
    for name in ("stderr/forgeline_heldout/bits_per_byte", "stderr/forgeline_arc_easy/acc_norm"):
        assert scores[name] == pytest.approx(stage[name], rel=1e-9)


def test_the_log_line_gives_each_score_its_95_percent_interval() -> None:
    line = describe({"forgeline_arc_easy/acc": 0.5, "stderr/forgeline_arc_easy/acc": 0.1,
                     "forgeline_heldout/bits_per_byte": 4.25})
    assert line == "forgeline_arc_easy/acc 0.5000 ± 0.1960, forgeline_heldout/bits_per_byte 4.2500"
