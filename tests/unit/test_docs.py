"""The README, docs/ and bench/README.md stay real: every `forgeline` command of their shell blocks
parses with the CLI's own parser (lm-eval's for `forgeline lm-eval`), every `make` target and
variable is the Makefile's, every `section.key` they name in backticks or in `--set` exists in the
config schema, every YAML config block loads, and every relative link finds its file and
heading. The commands of the verbs that finish in seconds and need no earlier run, server or
cluster (RUN_HERE) are run, in a temporary directory, and must exit 0; the other verbs are listed
with the reason they are not (NOT_RUN_HERE)."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from forgeline.configs import Config, ConfigError, load_config
from forgeline.flows.cli import build_parser, main
from tests.conftest import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
        REPO_ROOT / "bench" / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_FENCES = {"bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", "|", ";", "&"}
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
INLINE_CODE = re.compile(r"`([^`]+)`")
SECTIONS = "|".join(Config.model_fields)
# A dotted name that starts with a config section, not inside a path or a longer dotted name
# (`bench/train.py`, `forgeline.data.dvc_md5`); `<name>` stands for any key of a mapping.
CONFIG_KEY = re.compile(rf"(?<![\w./-])(?:{SECTIONS})(?:\.(?:<\w+>|\w+))+")
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "csv", "png", "txt", "lock", "db", "gz",
                 "tar", "npy", "safetensors", "gguf"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def fenced(text: str, languages: set[str]) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language in languages]


def shell_lines(text: str) -> list[str]:
    """The lines of the shell blocks, a trailing backslash joining a line to the next."""
    joined = "\n".join(fenced(text, SHELL_FENCES)).replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip()]


def commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at `&&`, `|`, ...), environment assignments
    in front of a command left out; comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found: list[list[str]] = [[]]
    for token in lexer:
        if token in OPERATORS:
            found.append([])
        elif found[-1] or not ENV_ASSIGNMENT.match(token):
            found[-1].append(token)
    return [command for command in found if command]


def prose(text: str) -> str:
    return FENCE.sub("", text)


def schema_type(dotted: str) -> Any:
    """The type `section.key[.key...]` names in the config schema, None where it names nothing."""
    annotation: Any = Config
    for part in dotted.split("."):
        annotation = step_into(without_none(annotation), part)
        if annotation is None:
            return None
    return annotation


def without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def step_into(annotation: Any, part: str) -> Any:
    if get_origin(annotation) is dict:
        key_type, value_type = get_args(annotation)
        allowed = get_args(key_type) if get_origin(key_type) is typing.Literal else None
        return value_type if part.startswith("<") or allowed is None or part in allowed else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(part)
        return None if field is None else field.annotation
    return None


def unknown_keys(keys: list[str]) -> list[str]:
    return [key for key in keys if schema_type(key) is None]


def override_keys(overrides: list[str]) -> list[str]:
    return [override.partition("=")[0] for override in overrides]


def forgeline_problem(args: list[str]) -> str | None:
    """Why the CLI would refuse these arguments, or None; lm-eval's own parser for `lm-eval`."""
    if args[:1] == ["lm-eval"]:
        from lm_eval._cli import HarnessCLI  # the parser `forgeline lm-eval` hands its arguments to

        parser = HarnessCLI()._parser
        args = args[1:]
    else:
        parser = build_parser()
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        return "the CLI refuses it"
    unknown = unknown_keys(override_keys(getattr(parsed, "overrides", [])))
    return f"unknown config keys {unknown}" if unknown else None


def makefile() -> tuple[set[str], set[str]]:
    """The Makefile's targets and variables."""
    text = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, re.MULTILINE))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.MULTILINE))
    return targets, variables


def make_problem(args: list[str]) -> str | None:
    targets, variables = makefile()
    for arg in args:
        name, assigned, value = arg.partition("=")
        if assigned and name not in variables:
            return f"the Makefile has no variable {name}"
        if assigned and name == "SET" and (unknown := unknown_keys(override_keys(value.split()))):
            return f"unknown config keys {unknown}"
        if not assigned and name not in targets:
            return f"the Makefile has no target {name}"
    return None


def command_problems(text: str) -> list[str]:
    problems = []
    for line in shell_lines(text):
        for command in commands(line):
            program, *args = command
            if program.endswith("forgeline"):
                problem = forgeline_problem(args)
            elif program == "make":
                problem = make_problem(args)
            else:
                continue
            if problem:
                problems.append(f"{' '.join(command)}: {problem}")
    return problems


def key_problems(text: str) -> list[str]:
    keys = [key for code in INLINE_CODE.findall(prose(text)) for key in CONFIG_KEY.findall(code)
            if key.rpartition(".")[2] not in FILE_SUFFIXES]
    return [f"`{key}` is not a config key (forgeline config show --docs)" for key in unknown_keys(keys)]


def config_problems(text: str, tmp_path: Path) -> list[str]:
    """YAML blocks that are run configs (their top-level keys are sections, or `inherit`) load."""
    problems = []
    for number, block in enumerate(fenced(text, {"yaml", "yml"})):
        raw = yaml.safe_load(block)
        if not isinstance(raw, dict) or not set(raw) <= set(Config.model_fields) | {"inherit"}:
            continue
        path = tmp_path / f"block-{number}.yaml"
        path.write_text(block)
        try:
            load_config(path)
        except ConfigError as err:
            problems.append(f"YAML block {number}: {err}")
    return problems


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(doc: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"^[a-z]+:", target):  # a URL
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", prose(linked.read_text()), re.MULTILINE)
            if anchor not in {heading_anchor(heading) for heading in headings}:
                problems.append(f"{target}: {linked.name} has no heading #{anchor}")
    return problems


def doc_id(doc: Path) -> str:
    return str(doc.relative_to(REPO_ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_forgeline_and_make_command_of_a_shell_block_parses(doc: Path) -> None:
    assert command_problems(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_config_key_named_in_backticks_exists(doc: Path) -> None:
    assert key_problems(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_config_block_loads(doc: Path, tmp_path: Path) -> None:
    assert config_problems(doc.read_text(), tmp_path) == []


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_relative_link_finds_its_file_and_heading(doc: Path) -> None:
    assert link_problems(doc) == []


# The verbs whose documented commands are run: seconds each on the shipped configs, in a directory
# of their own, with no earlier run, server or cluster.
RUN_HERE = {"plan", "config", "stages", "status", "sync"}
NOT_RUN_HERE = {
    "run": "trains a model, minutes (tests/integration runs the pipeline)",
    "stage": "runs a stage, minutes (tests/integration)",
    "checkpoints": "needs an earlier run's checkpoints",
    "clean": "needs an earlier run's outputs to remove (tests/unit/test_clean.py)",
    "promote": "needs registered versions",
    "compare": "needs MLflow runs (RUN_A RUN_B)",
    "reproduce": "needs an MLflow run, and reruns it",
    "deploy": "needs a Prefect server",
    "lm-eval": "evaluates a model, minutes",
    "chat": "needs a trained model",
    "generate": "needs a trained model",
}


def verbs() -> set[str]:
    [subparsers] = [action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction)]
    return set(subparsers.choices) | {"lm-eval"}  # lm-eval: handed to lm-eval's own parser


def runnable_commands(text: str) -> list[list[str]]:
    return [args for line in shell_lines(text) for program, *args in commands(line)
            if program.endswith("forgeline") and args[:1] and args[0] in RUN_HERE]


def test_every_verb_is_run_or_says_why_not() -> None:
    assert verbs() - RUN_HERE - set(NOT_RUN_HERE) == set()


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_quick_documented_command_runs(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    """In order (a command may read what one before it wrote), in a directory holding a copy of
    configs/ (commands name `configs/debug.yaml`), so nothing is written into the checkout."""
    shutil.copytree(REPO_ROOT / "configs", tmp_path / "configs", ignore=shutil.ignore_patterns("*.py", "__*"))
    monkeypatch.chdir(tmp_path)
    failed = []
    for args in runnable_commands(doc.read_text()):
        capsys.readouterr()  # what an error below quotes is this command's own
        status = main(args)
        if status != 0:
            failed.append(f"forgeline {shlex.join(args)}: exit {status}: {capsys.readouterr().err.strip()}")
    assert failed == []


def test_the_checks_find_a_wrong_flag_target_variable_key_and_config(tmp_path: Path) -> None:
    """Each check catches what it is for, so a passing run above means something."""
    doc = "\n".join([
        "Set `train.lr`, `eval.dimensions.math.limit`, `eval.dimensions.<name>.limit`; `bench/train.py`",
        "and `train.json` are files. Not `train.lrr`, `eval.dimensions.poetry.limit`, `train.lr.x`.",
        "```bash",
        "forgeline run --set train.steps=30    # fine",
        "forgeline run --sett train.steps=30",
        "forgeline stage trian",
        "forgeline run --set train.stepz=30",
        "FOO=1 forgeline checkpoints verify 200 && make corpus && make corpse",
        'make run SET="train.steps=5 train.nope=1" CONFIGG=x',
        "forgeline lm-eval run --model forgeline --taskz x",
        "forgeline stage eval \\",
        "    --upstream-run RUN_ID --bogus",
        "```",
        "```yaml",
        "inherit: tiny.yaml",
        "train: {stepz: 3}",
        "```",
    ])
    assert runnable_commands(doc) == []  # run, stage, checkpoints, lm-eval: none that runs here
    assert runnable_commands("```bash\nforgeline status && forgeline plan --nodes 1\n```") == [
        ["status"], ["plan", "--nodes", "1"]]
    assert command_problems(doc) == [
        "forgeline run --sett train.steps=30: the CLI refuses it",
        "forgeline stage trian: the CLI refuses it",
        "forgeline run --set train.stepz=30: unknown config keys ['train.stepz']",
        "make corpse: the Makefile has no target corpse",
        "make run SET=train.steps=5 train.nope=1 CONFIGG=x: unknown config keys ['train.nope']",
        "forgeline lm-eval run --model forgeline --taskz x: the CLI refuses it",
        "forgeline stage eval --upstream-run RUN_ID --bogus: the CLI refuses it",
    ]
    assert key_problems(doc) == [f"`{key}` is not a config key (forgeline config show --docs)"
                                 for key in ("train.lrr", "eval.dimensions.poetry.limit", "train.lr.x")]
    [problem] = config_problems(doc, tmp_path)
    assert "train.stepz: unknown key" in problem
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Its `own` part\n\n[ok](page.md#its-own-part), [ok](#a-page), "
                    "[gone](missing.md), [no heading](page.md#elsewhere), [web](https://example.org/x.md)\n")
    assert link_problems(page) == ["missing.md: no such file",
                                   "page.md#elsewhere: page.md has no heading #elsewhere"]
