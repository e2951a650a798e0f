"""The registered pyfunc model (tasks/register.py HFGenerator) as an assistant: a row's `messages`
go through the export's chat template and plain prompts still work -- logged to a real MLflow
store (sqlite) and loaded by mlflow.pyfunc.load_model; its reply stops at the template's
end-of-turn token; and `mlflow models serve` answers a conversation, and 16 rows in one request
(slow)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import mlflow
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from forgeline.eval.chat import end_of_turn_id
from forgeline.model.hf import export_hf
from forgeline.tasks.register import SIGNATURE, HFGenerator
from tests.chat import greedy_reply, random_model, save_chat_export, save_chat_tokenizer
from tests.integration.helpers import VENV_BIN, free_port, serving, user_env

pytestmark = pytest.mark.integration

TALK = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write a poem about the sea."}]
NEW_TOKENS = 6
LINE = "ROMEO: O, she doth teach the torches to burn bright! It seems she hangs upon the cheek".split()
SIXTEEN = [" ".join(LINE[:n]) for n in range(1, 17)]  # prompts of 1 to 16 words


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face export of a tiny random model with a ChatML tokenizer."""
    return save_chat_export(tmp_path_factory.mktemp("assistant"))


@pytest.fixture(scope="module")
def model_uri(export: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The export logged as register.py logs it, to a sqlite tracking store."""
    root = tmp_path_factory.mktemp("mlflow")
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    experiment = mlflow.create_experiment("pyfunc-messages", artifact_location=str(root / "mlartifacts"))
    with mlflow.start_run(experiment_id=experiment):
        info = mlflow.pyfunc.log_model(name="model", python_model=HFGenerator(),
                                       artifacts={"hf": str(export)}, signature=SIGNATURE,
                                       input_example=pd.DataFrame({"prompt": ["ROMEO:"]}),
                                       pip_requirements=["torch", "transformers"])
    return info.model_uri


def reference(export: Path, text: str) -> str:
    return greedy_reply(export, text, NEW_TOKENS)


def test_the_pyfunc_renders_messages_with_the_chat_template(export: Path, model_uri: str) -> None:
    """Loaded from the store, it answers a conversation as transformers does the rendered
    conversation, and a plain prompt as before, in one frame or alone."""
    generator = mlflow.pyfunc.load_model(model_uri)
    frame = pd.DataFrame({"messages": [TALK, None], "prompt": [None, "ROMEO:"]})
    talk, plain = generator.predict(frame, params={"max_new_tokens": NEW_TOKENS})
    rendered = AutoTokenizer.from_pretrained(export).apply_chat_template(TALK, tokenize=False,
                                                                         add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert talk == reference(export, rendered) and talk
    assert plain == reference(export, "ROMEO:") and plain
    [only] = generator.predict(pd.DataFrame({"messages": [TALK]}), params={"max_new_tokens": NEW_TOKENS})
    assert only == talk


def test_a_reply_stops_at_the_templates_end_of_turn_token(tmp_path: Path) -> None:
    """A model made to close its turn at once (<|im_end|> after the prompt's last token, a
    newline) and then to go on (a word after <|im_end|>) replies with nothing."""
    tokenizer = save_chat_tokenizer(tmp_path / "tokenizer")
    newline, end_of_turn = tokenizer.convert_tokens_to_ids("Ċ"), end_of_turn_id(tokenizer)
    word = tokenizer.encode(" poem", add_special_tokens=False)[0]  # " po"
    model = random_model(len(tokenizer), max_seq_len=128)
    a, b = torch.eye(model.shape.dim)[:2]  # orthogonal directions the residual stream carries on
    with torch.no_grad():  # an input's embedding dominates its position's state
        model.tok_embeddings.weight[newline], model.output.weight[end_of_turn] = 30 * a, 100 * a
        model.tok_embeddings.weight[end_of_turn], model.output.weight[word] = 30 * b, 100 * b
    export = export_hf(model, tmp_path / "tokenizer", tmp_path / "hf")
    generator = HFGenerator()
    generator.load_context(SimpleNamespace(artifacts={"hf": str(export)}))
    assert generator.predict(None, pd.DataFrame({"messages": [TALK]}), {"max_new_tokens": NEW_TOKENS}) == [""]
    generator.stop_ids = [tokenizer.eos_token_id]  # stopping at the end-of-text token alone
    [went_on] = generator.predict(None, pd.DataFrame({"messages": [TALK]}), {"max_new_tokens": NEW_TOKENS})
    assert went_on.startswith(tokenizer.decode([word]))


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_conversation(export: Path, model_uri: str, tmp_path: Path) -> None:
    port = free_port()
    env = user_env(tmp_path) | {"MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}
    cmd = [str(VENV_BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local",
           "--host", "127.0.0.1", "--port", str(port)]
    with serving(cmd, env, tmp_path / "serve.log", f"http://127.0.0.1:{port}/ping"):
        answers = [httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=120, json={
            "dataframe_records": records, "params": {"max_new_tokens": NEW_TOKENS}})
            for records in ([{"messages": TALK}], [{"prompt": "ROMEO:"}],
                            [{"messages": TALK, "prompt": None}, {"messages": None, "prompt": "ROMEO:"}],
                            [{"prompt": prompt} for prompt in SIXTEEN])]
    assert [answer.status_code for answer in answers] == [200] * 4, [answer.text for answer in answers]
    tokenizer = AutoTokenizer.from_pretrained(export)
    talk = reference(export, tokenizer.apply_chat_template(TALK, tokenize=False, add_generation_prompt=True))
    plain = reference(export, "ROMEO:")
    assert [answer.json()["predictions"] for answer in answers[:3]] == [[talk], [plain], [talk, plain]]
    # Generated in one padded batch, each row as it alone would be.
    assert answers[3].json()["predictions"] == [reference(export, prompt) for prompt in SIXTEEN]
