"""The in-training evaluation's scores (eval/periodic.py): each the eval stage's, asked the same
way (few-shot count and seeds), with the standard error the eval stage gives it, under the eval
stage's name, on a tiny random model over the debug data."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeline.configs.schema import DimensionConfig
from forgeline.eval.dimensions import fewshot_counts, task_score
from forgeline.eval.periodic import describe, score_tasks
from forgeline.eval.scores import stderr_metrics
from forgeline.eval.suite import render_suite, suite_task_manager
from forgeline.tasks.evaluate import score_lm
from tests.conftest import random_lm

# A bootstrapped aggregation, a mean, and a task asked with shots whose perplexity they move.
TASKS = ["forgeline_heldout", "forgeline_arc_easy", "forgeline_lambada"]
LIMIT = 4
SHOTS = {"language_modeling": 2}


def test_every_in_training_score_is_the_eval_stages_with_its_standard_error(
        data_root: Path, tmp_path: Path) -> None:
    lm = random_lm(data_root / "data" / "tokenizer", tmp_path / "bundle", max_seq_len=512, batch_size=8)
    task_manager = suite_task_manager(render_suite(tmp_path / "suite", data_root / "data"))
    assert fewshot_counts(TASKS, SHOTS) == {"forgeline_heldout": 2, "forgeline_arc_easy": 0,
                                            "forgeline_lambada": 2}
    scores = score_tasks(lm, TASKS, fewshot_counts(TASKS, SHOTS), LIMIT, task_manager)

    named = {name for name in scores if not name.startswith("stderr/")}
    assert {"forgeline_heldout/bits_per_byte", "forgeline_heldout/word_perplexity",
            "forgeline_heldout/byte_perplexity", "forgeline_arc_easy/acc",
            "forgeline_arc_easy/acc_norm"} <= named
    assert {f"stderr/{name}" for name in named} == set(scores) - named
    assert scores["stderr/forgeline_heldout/bits_per_byte"] > 0

    plan = {"language_modeling": ([task_score("forgeline_heldout"), task_score("forgeline_lambada")],
                                  DimensionConfig(limit=LIMIT, num_fewshot=2)),
            "reasoning": ([task_score("forgeline_arc_easy")], DimensionConfig(limit=LIMIT))}
    scored = score_lm(lm, plan, task_manager)
    assert {name: scores[name] for name in scored.raw} == pytest.approx(scored.raw, rel=1e-9)
    zero_shot = score_tasks(lm, ["forgeline_lambada"], {}, LIMIT, task_manager)
    assert zero_shot["forgeline_lambada/perplexity"] != scores["forgeline_lambada/perplexity"]  # shots count
    stage = stderr_metrics(scored.report(plan))
    for name in ("stderr/forgeline_heldout/bits_per_byte", "stderr/forgeline_arc_easy/acc_norm"):
        assert scores[name] == pytest.approx(stage[name], rel=1e-9)


def test_the_log_line_gives_each_score_its_95_percent_interval() -> None:
    line = describe({"forgeline_arc_easy/acc": 0.5, "stderr/forgeline_arc_easy/acc": 0.1,
                     "forgeline_heldout/bits_per_byte": 4.25})
    assert line == "forgeline_arc_easy/acc 0.5000 ± 0.1960, forgeline_heldout/bits_per_byte 4.2500"
