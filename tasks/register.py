"""Register stage: log the trained model to MLflow as a pyfunc text generator and register
it as a new version of `registry.model_name`, tagged with its lineage and eval scores.

Output (`registry.out_dir`): `registered.json` (run id, model name, version, model URI).
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.models.signature import ModelSignature
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema
from transformers import PreTrainedTokenizerFast

from forgeline.configs import Config
from forgeline.model.inference import generate, load_bundle, load_from_checkpoint, save_bundle
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.tracking import RunTracker

log = logging.getLogger(__name__)

REGISTERED_NAME = "registered.json"
CANDIDATE_ALIAS = "candidate"


class ForgelineGenerator(mlflow.pyfunc.PythonModel):
    """Prompts in, generated continuations out (`mlflow models serve`, `pyfunc.load_model`)."""

    def load_context(self, context: Any) -> None:
        self.model = load_bundle(context.artifacts["bundle"])
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(context.artifacts["tokenizer"])

    # No type hints on predict: MLflow would derive a schema from them; SIGNATURE below is the
    # contract (a DataFrame with a `prompt` column, params max_new_tokens and temperature).
    def predict(self, context, model_input, params=None):
        params = params or {}
        outputs = []
        for prompt in model_input["prompt"]:
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) or [self.tokenizer.eos_token_id]
            new = generate(self.model, ids, max_new_tokens=int(params.get("max_new_tokens", 64)),
                           temperature=float(params.get("temperature", 0.0)),
                           stop_token=self.tokenizer.eos_token_id)
            outputs.append(self.tokenizer.decode(new))
        return outputs


SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "prompt")]),
    outputs=Schema([ColSpec("string")]),
    params=ParamSchema([ParamSpec("max_new_tokens", "long", 64),
                        ParamSpec("temperature", "double", 0.0)]),
)


@dataclass(frozen=True)
class RegisterResult:
    run_id: str
    model_name: str
    version: str
    model_uri: str
    promotion: str = ""  # the promotion gate's decision, in words


def register_model(cfg: Config, run: RunTracker, checkpoint: str, tokenizer_dir: str,
                   version_tags: dict[str, str]) -> RegisterResult:
    """Export the checkpoint's weights, log them under `run` and register a model version."""
    model = load_from_checkpoint(checkpoint)
    mlflow.set_tracking_uri(run.client.tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        bundle = Path(scratch) / "bundle"
        save_bundle(model, bundle)
        with mlflow.start_run(run_id=run.run_id, nested=True):
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=ForgelineGenerator(),
                artifacts={"bundle": str(bundle), "tokenizer": tokenizer_dir},
                signature=SIGNATURE,
                input_example=pd.DataFrame({"prompt": ["ROMEO:"]}),
                pip_requirements=[f"{name}=={package_version(name)}" for name in
                                  ("torch", "transformers", "tokenizers", "safetensors", "pandas")],
                registered_model_name=cfg.registry.model_name,
            )
    client = MlflowClient(run.client.tracking_uri)
    version = str(info.registered_model_version)
    for key, value in version_tags.items():
        client.set_model_version_tag(cfg.registry.model_name, version, key, value)
    client.set_registered_model_alias(cfg.registry.model_name, CANDIDATE_ALIAS, version)
    result = RegisterResult(run_id=run.run_id, model_name=cfg.registry.model_name,
                            version=version, model_uri=f"models:/{cfg.registry.model_name}/{version}")
    out_dir = Path(cfg.registry.out_dir)
    write_text_atomic(out_dir / REGISTERED_NAME, json.dumps(asdict(result), indent=2) + "\n")
    log.info("registered %s version %s (alias %s)", result.model_name, version, CANDIDATE_ALIAS)
    return result
