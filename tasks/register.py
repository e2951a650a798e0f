"""Register stage: export the trained model as a Hugging Face Llama directory, log it to MLflow
as a pyfunc text generator over that export (what `mlflow models serve` and
`mlflow.pyfunc.load_model` load) and register it as a new version of `registry.model_name`,
tagged with its lineage and eval scores.

Output (`registry.out_dir`): `registered.json` (run id, model name, version, model URI).
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import torch
from mlflow import MlflowClient
from mlflow.models.signature import ModelSignature
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema
from transformers import AutoModelForCausalLM, AutoTokenizer

from forgeline.configs import Config
from forgeline.model.hf import export_hf
from forgeline.model.inference import load_from_checkpoint
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.evaluate import ITEMS_NAME, read_eval_metrics
from forgeline.tasks.promote import promote
from forgeline.tasks.tracking import DATA_VERSION_TAG, RunTracker, dvc_hash
from forgeline.tasks.train.job import read_train_summary

log = logging.getLogger(__name__)

REGISTERED_NAME = "registered.json"
CANDIDATE_ALIAS = "candidate"


class HFGenerator(mlflow.pyfunc.PythonModel):
    """Prompts in, generated continuations out, by transformers' generate on the Hugging Face
    export (`mlflow models serve`, `pyfunc.load_model`)."""

    def load_context(self, context: Any) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(context.artifacts["hf"]).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["hf"])

    # No type hints on predict: MLflow would derive a schema from them; SIGNATURE below is the
    # contract (a DataFrame with a `prompt` column, params max_new_tokens and temperature).
    def predict(self, context, model_input, params=None):
        params = params or {}
        temperature = float(params.get("temperature", 0.0))
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else \
            {"do_sample": False}
        eos, max_new_tokens = self.tokenizer.eos_token_id, int(params.get("max_new_tokens", 64))
        outputs = []
        for prompt in model_input["prompt"]:
            ids = torch.tensor([self.tokenizer.encode(prompt, add_special_tokens=False) or [eos]])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=eos,
                                          pad_token_id=eos, max_new_tokens=max_new_tokens, **sampling)
            outputs.append(self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
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


def register_stage(cfg: Config, run: RunTracker, parent: RunTracker | None) -> RegisterResult:
    """The register stage's function (tasks/stage.py): a new version of the trained checkpoint,
    tagged with its lineage and eval scores, then the promotion gate."""
    train = read_train_summary(cfg)
    scores = read_eval_metrics(cfg)
    version_tags = {DATA_VERSION_TAG: dvc_hash(cfg.data.out_dir),
                    "forgeline.checkpoint_step": str(train.step),
                    **{f"eval.{k}": f"{v:.6g}" for k, v in scores.items() if is_version_score(k)}}
    if parent:
        version_tags["forgeline.pipeline_run_id"] = parent.run_id
    # The per-item results go with the version (the gate pairs them with the champion's).
    run.log_artifact(Path(cfg.eval.out_dir) / ITEMS_NAME, "eval")
    registered = register_model(cfg, run, train.checkpoint, str(Path(cfg.data.out_dir) / "tokenizer"),
                                version_tags)
    registry = MlflowClient(run.client.tracking_uri, run.client.tracking_uri)
    decision = promote(cfg, registry, registered.version)
    return replace(registered, promotion=decision.describe())


def is_version_score(metric: str) -> bool:
    """The eval metrics a version is tagged with: the overall and dimension scores, their standard
    errors and the detectable difference (not every task's, nor the base's)."""
    return metric.removeprefix("stderr/").removeprefix("detectable/") == "overall" or \
        metric.removeprefix("stderr/").startswith("dimension/")


def record_registration(cfg: Config, run: RunTracker, parent: RunTracker | None,
                        result: RegisterResult) -> None:
    run.set_tags({"forgeline.model_version": result.version})
    if parent:
        parent.set_tags({"forgeline.model_name": result.model_name,
                         "forgeline.model_version": result.version})


def register_model(cfg: Config, run: RunTracker, checkpoint: str, tokenizer_dir: str,
                   version_tags: dict[str, str]) -> RegisterResult:
    """Export the checkpoint as a Hugging Face model, log it under `run` and register a model
    version."""
    model = load_from_checkpoint(checkpoint)
    mlflow.set_tracking_uri(run.client.tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = export_hf(model, tokenizer_dir, Path(scratch) / "hf")
        with mlflow.start_run(run_id=run.run_id, nested=True):
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=HFGenerator(),
                artifacts={"hf": str(hf_dir)},
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
