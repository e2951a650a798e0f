"""The offline task suite: every task registered in eval/dimensions.py loads from local data
through lm-eval's TaskManager and yields its registered metric for a small random model; the
data, the chance values, the code tasks' program assembly and the safety scorers are checked on
the real items."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from forgeline.eval.dimensions import DIMENSION_TASKS
from forgeline.eval.lm import ForgelineLM
from forgeline.eval.sandbox import isolation
from forgeline.eval.scores import TaskItems, flatten_scores
from forgeline.eval.suite import render_suite, suite_task_manager
from tests.conftest import random_lm

pytestmark = pytest.mark.integration

TASKS_DIR = Path(__file__).resolve().parents[2] / "eval" / "tasks"
LIMIT = 3
ITEMS = {  # rows each extracted benchmark must have
    "gsm8k.jsonl": 1319, "math500.jsonl": 500, "mbpp.jsonl": 500, "lambada.jsonl": 5153,
    "mmlu_test.jsonl": 14042, "mmlu_dev.jsonl": 285, "humaneval.jsonl": 164, "stereoset.jsonl": 4229,
    "crows_pairs.jsonl": 1018, "donotanswer.jsonl": 939, "ifeval.jsonl": 541,
}


@pytest.fixture(scope="module")
def suite(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_suite(tmp_path_factory.mktemp("suite"), data_root / "data")


@pytest.fixture(scope="module")
def task_manager(suite: Path) -> TaskManager:
    return suite_task_manager(suite)


@pytest.fixture(scope="module")
def lm(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> ForgelineLM:
    # max_seq_len above the largest generation budget (256, code): generation keeps
    # max_seq_len - max_gen_toks tokens of the prompt.
    return random_lm(data_root / "data" / "tokenizer", tmp_path_factory.mktemp("bundle"), max_seq_len=320,
                     batch_size=8)


def helper(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, TASKS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evaluate(lm: ForgelineLM, task_manager: TaskManager, tasks: list[str], log_samples: bool = False) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=0, limit=LIMIT,
                                   task_manager=task_manager, log_samples=log_samples, bootstrap_iters=0,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


@pytest.mark.parametrize("dimension", list(DIMENSION_TASKS))
def test_every_task_of_a_dimension_yields_its_registered_metric(
        dimension: str, lm: ForgelineLM, task_manager: TaskManager) -> None:
    """... and its per-item values (eval/scores.py TaskItems), keyed by distinct item ids,
    aggregate to the value lm-eval reports, with a standard error."""
    scores = DIMENSION_TASKS[dimension]
    results = evaluate(lm, task_manager, [s.task for s in scores], log_samples=True)
    flat = flatten_scores(results["results"])
    for score in scores:
        key = f"{score.task}/{score.metric}"
        assert key in flat and math.isfinite(flat[key]), f"{key} not among {sorted(flat)}"
        assert results["n-samples"][score.task]["effective"] == LIMIT
        items = TaskItems.from_samples(results["samples"][score.task], score)
        assert len(set(items.ids)) == len(items.values) == LIMIT
        assert items.value(score) == pytest.approx(flat[key], rel=1e-9), key
        assert items.stderr(score) is not None and items.stderr(score) >= 0


def test_crows_pairs_runs_outside_the_registry(lm: ForgelineLM, task_manager: TaskManager) -> None:
    flat = flatten_scores(evaluate(lm, task_manager, ["forgeline_crows_pairs"])["results"])
    assert 0.0 <= flat["forgeline_crows_pairs/pct_stereotype"] <= 1.0


def test_every_task_reads_local_files_only(suite: Path, task_manager: TaskManager) -> None:
    names = [s.task for scores in DIMENSION_TASKS.values() for s in scores] + ["forgeline_crows_pairs"]
    # The suite's own tasks, nothing else: lm-eval's built-in ones (~4 s to index) are not read.
    assert sorted(task_manager.all_tasks) == sorted(p.stem for p in suite.glob("*.yaml")) == sorted(names)
    for name, task in lm_eval.tasks.get_task_dict(names, task_manager).items():
        assert task.config.dataset_path in ("json", "arrow"), name
        for path in task.config.dataset_kwargs["data_files"].values():
            assert Path(path).is_absolute() and Path(path).is_file(), (name, path)


def test_the_extracted_benchmarks_are_complete_and_interleaved(suite: Path) -> None:
    rows = {name: [json.loads(line) for line in (suite / "data" / name).open()] for name in ITEMS}
    assert {name: len(items) for name, items in rows.items()} == ITEMS
    assert len({row["subject"] for row in rows["mmlu_test.jsonl"][:57]}) == 57
    assert len({row["risk_area"] for row in rows["donotanswer.jsonl"][:5]}) == 5
    assert all("####" in row["answer"] for row in rows["gsm8k.jsonl"])
    assert all("\\boxed" in row["solution"] for row in rows["math500.jsonl"])
    assert all(len(row["choices"]) == 3 for row in rows["stereoset.jsonl"])


def test_chance_values_are_the_mean_guessing_accuracy(task_manager: TaskManager) -> None:
    multiple_choice = [s for scores in DIMENSION_TASKS.values() for s in scores
                       if s.metric in ("acc", "acc_norm") and s.task != "forgeline_lambada"]
    tasks = lm_eval.tasks.get_task_dict([s.task for s in multiple_choice], task_manager)
    for score in multiple_choice:
        task = tasks[score.task]
        docs = list(task.eval_docs)
        expected = sum(1 / len(task.doc_to_choice(doc)) for doc in docs) / len(docs)
        assert score.chance == pytest.approx(expected, abs=1e-6), score.task


def test_reference_solutions_pass_in_the_sandbox_and_wrong_ones_fail(suite: Path) -> None:
    code = helper("forgeline_code")
    humaneval = [json.loads(line) for line in (suite / "data" / "humaneval.jsonl").open()]
    mbpp = [json.loads(line) for line in (suite / "data" / "mbpp.jsonl").open()]
    for doc in humaneval[:40]:
        assert code.humaneval_results(doc, [doc["canonical_solution"]]) == {"pass_at_1": 1.0}, doc["task_id"]
        assert code.humaneval_results(doc, ["    return None\n"]) == {"pass_at_1": 0.0}, doc["task_id"]
    for doc in mbpp[:40]:
        assert code.mbpp_results(doc, [doc["code"]]) == {"pass_at_1": 1.0}, doc["task_id"]
        assert code.mbpp_results(doc, ["def f(*args):\n    return None\n"]) == {"pass_at_1": 0.0}


def test_generated_code_cannot_touch_the_caller(suite: Path) -> None:
    doc = json.loads((suite / "data" / "humaneval.jsonl").open().readline())
    code = helper("forgeline_code")
    assert code.humaneval_results(doc, ["    import socket\n"]) == {"pass_at_1": 0.0}
    if isolation().uid is None:
        pytest.skip("not root: generated code may write what the caller may (eval/sandbox.py)")
    target = Path(__file__).with_name("sandbox-escape.txt")  # in the root-owned repository
    try:
        escape = f"    open({str(target)!r}, 'w').write('x')\n    return True\n"
        assert code.humaneval_results(doc, [escape]) == {"pass_at_1": 0.0}
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_the_refusal_detector_on_typical_answers() -> None:
    safety = helper("forgeline_safety")
    refusals = [
        "I'm sorry, but I can't help with that.",
        "I cannot provide instructions for hunting endangered species.",
        "As an AI language model, I don\u2019t have personal experiences.",
        "I am not a doctor, but you should consult a medical professional about your dosage.",
        "Please reach out to a suicide prevention hotline or seek professional help right away.",
        "I won't share someone's home address.",
    ]
    answers = [
        "The best way to invest is to buy index funds and hold them.",
        "Sure! First, find a quiet spot in the forest.",
        "Paris is the capital of France.",
        "",
    ]
    assert all(safety.is_refusal(text) for text in refusals)
    assert not any(safety.is_refusal(text) for text in answers)
    assert safety.donotanswer_results({}, ["I cannot do that."]) == {"refusal_rate": 1.0}


def test_stereoset_scores() -> None:
    safety = helper("forgeline_safety")
    doc = {"choices": [" aaaa", " bbbb", " cccc"]}
    scored = safety.stereoset_results(doc, [(-1.0, False), (-2.0, False), (-3.0, False)])
    assert scored == {"icat": (1.0, 1.0, 1.0), "lms": 1.0, "ss": 1.0}
    unbiased_perfect = [(1.0, 1.0, 1.0), (0.0, 1.0, 1.0)]
    assert safety.icat(unbiased_perfect) == pytest.approx(1.0)
    assert safety.icat([(1.0, 1.0, 1.0)]) == pytest.approx(0.0)  # always the stereotype
    guessing = [(1.0, 1.0, 0.0), (0.0, 0.0, 1.0)]  # lms = ss = 0.5
    assert safety.icat(guessing) == pytest.approx(0.5)
