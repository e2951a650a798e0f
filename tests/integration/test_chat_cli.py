"""`forgeline generate` and `forgeline chat` as a user runs them, as processes: on a Hugging Face
directory and on a registered version (models:/NAME@ALIAS in a sqlite registry), greedy replies
are transformers' own; a prompts file comes back as JSON lines; a chat over piped stdin answers
through the chat template, resets and exits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from transformers import AutoTokenizer

from forgeline.tasks.register import SIGNATURE, HFGenerator
from tests.chat import greedy_reply, save_chat_export
from tests.integration.helpers import VENV_BIN, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real processes, about 3 min

NEW_TOKENS = 8
GREEDY = ["--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]
TALK = [{"role": "user", "content": "Write a poem about the sea."}]


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_export(tmp_path_factory.mktemp("talk"))


def reference(export: Path, text: str) -> str:
    return greedy_reply(export, text, NEW_TOKENS)


def rendered(export: Path, messages: list[dict[str, str]]) -> str:
    return AutoTokenizer.from_pretrained(export).apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=True)


def forgeline(args: list[str], workdir: Path, stdin: str = "") -> str:
    """The command's stdout: what the user reads, replies only (the log lines go to stderr)."""
    env = user_env(workdir) | {"FORGELINE_CACHE": str(workdir / "cache")}  # a registered export lands there
    done = subprocess.run([str(VENV_BIN / "forgeline"), *args], cwd=workdir, env=env,
                          input=stdin, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_generate_streams_a_continuation_and_answers_a_prompts_file(export: Path, tmp_path: Path) -> None:
    out = forgeline(["generate", str(export), "ROMEO:", *GREEDY], tmp_path)
    assert out == reference(export, "ROMEO:") + "\n"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ROMEO:"}) + "\n" + json.dumps({"messages": TALK}) + "\n"
                       + json.dumps({"prompt": "Write"}) + "\n")
    out = forgeline(["generate", str(export), "--prompts-file", str(prompts), "--batch-size", "2", *GREEDY],
                    tmp_path)
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == [{"prompt": "ROMEO:", "output": reference(export, "ROMEO:")},
                    {"messages": TALK, "output": reference(export, rendered(export, TALK))},
                    {"prompt": "Write", "output": reference(export, "Write")}]


def test_chat_over_piped_stdin_answers_resets_and_exits(export: Path, tmp_path: Path) -> None:
    line = TALK[0]["content"]
    stdin = f"{line}\n{line}\n/reset\n{line}\n/exit\n{line}\n"
    out = forgeline(["chat", str(export), *GREEDY], tmp_path, stdin)
    first = reference(export, rendered(export, TALK))
    second = reference(export, rendered(export, [*TALK, {"role": "assistant", "content": first}, *TALK]))
    assert out == f"{first}\n{second}\n{first}\n"


def test_generate_on_a_registered_alias(export: Path, tmp_path: Path) -> None:
    """models:/NAME@ALIAS resolves as model.init_from does: the version's export, downloaded."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    experiment = mlflow.create_experiment("talk", artifact_location=str(tmp_path / "mlartifacts"))
    with mlflow.start_run(experiment_id=experiment):
        info = mlflow.pyfunc.log_model(name="model", python_model=HFGenerator(),
                                       artifacts={"hf": str(export)}, signature=SIGNATURE,
                                       pip_requirements=["torch", "transformers"])
    version = mlflow.register_model(info.model_uri, "talker")
    MlflowClient(store).set_registered_model_alias("talker", "champion", version.version)
    out = forgeline(["generate", "models:/talker@champion", "ROMEO:", *GREEDY,
                     "--set", f"registry.tracking_uri={store}"], tmp_path)
    assert out == reference(export, "ROMEO:") + "\n"
