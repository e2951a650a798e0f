"""Register stage: export the trained model as a Hugging Face directory of its family, log it to MLflow
as a pyfunc text generator over that export (what `mlflow models serve` and
`mlflow.pyfunc.load_model` load; a row's input is a `prompt`, or `messages` that the export's
chat template renders) and register it as a new version of `registry.model_name`,
tagged with its lineage and eval scores.

Registration is all-or-nothing and idempotent. A version is created with its registration key
(`registration_key`: the model name, the checkpoint, the tokenizer and the eval scores) and
`forgeline.registration=incomplete` in one call; its tags and the `candidate` alias follow, and
`forgeline.registration=complete` last. Lookups never use an incomplete version (as base,
candidate or champion: tasks/pretrained.py `check_complete`). When a step fails and the registry
still answers, the incomplete version is deleted and the alias put back; when it does not answer,
the error says so and the version stays incomplete. A rerun with the same key finds the version
and completes it, or returns it when it is complete: one version per key.

Output (`registry.out_dir`): `registered.json` (run id, model name, version, model URI).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import requests
import torch
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models.signature import ModelSignature
from mlflow.types.schema import Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema
from mlflow.utils.logging_utils import MLFLOW_LOGGING_STREAM
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME
from transformers import AutoModelForCausalLM, AutoTokenizer

from forgeline.configs import Config
from forgeline.eval.chat import end_of_turn_id, render_chat
from forgeline.model.checkpoint.manager import MANIFEST_NAME
from forgeline.model.fileio import sha256_file
from forgeline.model.hf import export_hf
from forgeline.model.inference import export_checkpoint_adapter, load_from_checkpoint
from forgeline.model.spool import NotLanded
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.evaluate import EVAL_RUN_TAG, ITEMS_NAME, TRAIN_RUN_TAG, eval_run_name, read_eval_metrics
from forgeline.tasks.pretrained import COMPLETE, INCOMPLETE, REGISTRATION_TAG, is_complete
from forgeline.tasks.promote import BASE_TAG, PromotionLockError, aliased, promote, recorded_decision
from forgeline.tasks.tracking import DATA_VERSION_TAG, RunTracker, config_label, dvc_hash, tracker_for
from forgeline.tasks.train.job import TrainResult, read_train_summary

log = logging.getLogger(__name__)

REGISTERED_NAME = "registered.json"
CANDIDATE_ALIAS = "candidate"
REGISTRATION_KEY_TAG = "forgeline.registration.key"
HEALTH_TIMEOUT_S = 5  # asking a tracking server whether it answers at all


class RegistrationError(RuntimeError):
    """Registering failed; the message names the registry, the state the version is left in and
    what to do."""


class HFGenerator(mlflow.pyfunc.PythonModel):
    """Prompts or conversations in, generated continuations or replies out, by transformers'
    generate on the Hugging Face export (`mlflow models serve`, `pyfunc.load_model`). A row's
    `messages` ([{role, content}]) are rendered by the export's chat template, the assistant's
    turn opened; generation stops at the end-of-text token and at the template's end-of-turn
    token (eval/chat.py). A request that mixes the two kinds of row gives each row the other key
    as null: MLflow's schema check refuses a missing value (NaN) in `messages`."""

    def load_context(self, context: Any) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(context.artifacts["hf"]).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(context.artifacts["hf"])
        end_of_turn = end_of_turn_id(self.tokenizer)
        self.stop_ids = [self.tokenizer.eos_token_id] + ([end_of_turn] if end_of_turn is not None else [])

    def prompt_text(self, row: dict) -> str:
        """A row's prompt: its `messages` through the chat template where it has them, else its
        `prompt`."""
        messages = row.get("messages")
        if isinstance(messages, list | tuple | np.ndarray) and len(messages):  # absent: None or NaN
            conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
            return render_chat(self.tokenizer, conversation, where="this model's tokenizer")
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("each input row needs a `prompt` (a string) or `messages` (a list of "
                             "{role, content})")
        return prompt

    # No type hints on predict: MLflow would derive a schema from them; SIGNATURE below is the
    # contract (a DataFrame with a `prompt` or a `messages` column, or both, one of them set on
    # each row; params max_new_tokens and temperature).
    def predict(self, context, model_input, params=None):
        """All rows in one `generate` call, left-padded: a decoding step computes every row at
        once, where a loop over rows would pay a step's fixed cost once per row."""
        params = params or {}
        temperature = float(params.get("temperature", 0.0))
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else \
            {"do_sample": False}
        eos, max_new_tokens = self.tokenizer.eos_token_id, int(params.get("max_new_tokens", 64))
        ids, attention_mask = self.left_padded([self.prompt_text(row) for row in
                                                model_input.to_dict(orient="records")])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=attention_mask, pad_token_id=eos,
                                      eos_token_id=self.stop_ids, max_new_tokens=max_new_tokens, **sampling)
        # A row that stopped early goes on as pad tokens (end-of-text): special, dropped like its stop token
        return self.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)

    def left_padded(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' tokens (B, T) padded on the left, so that every row's next token is at T,
        and their attention mask; an empty prompt is the end-of-text token alone."""
        eos = self.tokenizer.eos_token_id
        rows = [self.tokenizer.encode(prompt, add_special_tokens=False) or [eos] for prompt in prompts]
        width = max(len(row) for row in rows)
        ids = torch.tensor([[eos] * (width - len(row)) + row for row in rows])
        attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
        return ids, attention_mask


MESSAGE = Object([Property("role", "string"), Property("content", "string")])
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "prompt", required=False),
                   ColSpec(Array(MESSAGE), "messages", required=False)]),
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
    """The register stage's function (tasks/stage.py): a version of the trained checkpoint,
    tagged with its lineage and overall score -- the one registered before for the same checkpoint
    and scores, if any --, then the promotion gate, unless it decided on that version before."""
    train = read_train_summary(cfg)
    scores = read_eval_metrics(cfg)
    tokenizer_dir = Path(cfg.data.out_dir) / "tokenizer"
    # The per-item results go with the version (the gate pairs them with the champion's): a version
    # registered before they land would be judged on no items, "inconclusive" for good.
    try:
        run.log_artifact(Path(cfg.eval.out_dir) / ITEMS_NAME, "eval", landed=True)
    except NotLanded as err:
        raise RegistrationError(f"the eval's per-item results did not reach the registry's store: {err}. "
                                "Nothing was registered; rerun the register stage once the store "
                                "answers") from err
    tags = version_tags(cfg, train, scores["overall"], parent)  # the store answered just now
    key = registration_key(cfg.registry.model_name, Path(train.checkpoint), tokenizer_dir, scores)
    registered = register_model(cfg, run, train.checkpoint, str(tokenizer_dir), tags, key)
    uri = run.client.tracking_uri
    registry = MlflowClient(uri, uri)
    try:
        decided = recorded_decision(registry.get_model_version(registered.model_name, registered.version))
        decided = decided or promote(cfg, registry, registered.version).describe()
    except (MlflowException, PromotionLockError, requests.RequestException, OSError) as err:
        # An outage is never a decision: none is recorded, and the rerun decides.
        raise RegistrationError(
            f"{registered.model_name} version {registered.version} is registered in the registry at {uri} "
            f"and complete (@{CANDIDATE_ALIAS}), but the promotion gate could not decide on it "
            f"({first_line(err)}): no decision was recorded. Rerun the register stage (it registers nothing "
            f"new) or `forgeline promote --version {registered.version}` once the registry answers") from err
    return replace(registered, promotion=decided)


def registration_key(model_name: str, checkpoint: Path, tokenizer_dir: Path, scores: dict[str, float]) -> str:
    """What identifies a registration, stored as the version's REGISTRATION_KEY_TAG: sha256 over the
    registered model's name, the checkpoint's manifest (the sha256 of every file, the step and the
    training attempt that wrote it: a retrained identical model is another registration), the
    tokenizer and the eval scores the version is tagged with. Not the run, the pipeline run, the
    code or the registry: a rerun of the stage on the same train and eval outputs has the same key."""
    record = {"model_name": model_name, "checkpoint_manifest": sha256_file(checkpoint / MANIFEST_NAME),
              "tokenizer": sha256_file(tokenizer_dir / "tokenizer.json"), "eval": scores}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def version_tags(cfg: Config, train: TrainResult, overall: float,
                 parent: RunTracker | None) -> dict[str, str]:
    """What identifies a version, as its tags: the data, the checkpoint's step, the overall score,
    the base it was trained from (its `model.init_from`: what the gate compares the line's first
    champion with, tasks/promote.py) and with a parent the runs that made it. Every other score is
    a metric of those runs (`eval/...`) and the gate's evidence has tags of its own: a tag each
    here filled MLflow's versions list with a column of them per row."""
    tags = {DATA_VERSION_TAG: dvc_hash(cfg.data.out_dir), "forgeline.checkpoint_step": str(train.step),
            "eval.overall": f"{overall:.6g}"}
    if train.base:
        tags[BASE_TAG] = train.base["uri"]
    if parent:
        made_by = parent.client.get_run(parent.run_id).data.tags
        tags["forgeline.pipeline_run_id"] = parent.run_id
        tags |= {tag: made_by[tag] for tag in (TRAIN_RUN_TAG, EVAL_RUN_TAG) if tag in made_by}
    return tags


def record_registration(cfg: Config, run: RunTracker, parent: RunTracker | None,
                        result: RegisterResult) -> None:
    """The version on the register run; with a parent, on the parent and on the runs it holds
    that made the version -- the eval run (`forgeline.model_version`, named `eval tiny step-300
    v3`), the train run -- and in their names, so that the runs table tells one pipeline run's
    from another's."""
    version = f"v{result.version}"
    own = run.client.get_run(run.run_id).data.tags.get(MLFLOW_RUN_NAME, "register")
    run.set_tags({MODEL_VERSION_TAG: result.version, MLFLOW_RUN_NAME: with_version(own, cfg, version)})
    if not parent:
        return
    tags = run.client.get_run(parent.run_id).data.tags
    parent.set_tags({"forgeline.model_name": result.model_name, MODEL_VERSION_TAG: result.version,
                     MLFLOW_RUN_NAME: with_version(tags.get(MLFLOW_RUN_NAME, "pipeline"), cfg, version)})
    if eval_run := tags.get(EVAL_RUN_TAG):
        scored = run.client.get_run(eval_run).data.params.get("checkpoint_step", "unknown")
        tracker_for(cfg, eval_run, run.client).set_tags(
            {MODEL_VERSION_TAG: result.version, MLFLOW_RUN_NAME: eval_run_name(cfg, scored, result.version)})
    if train_run := tags.get(TRAIN_RUN_TAG):
        name = run.client.get_run(train_run).data.tags.get(MLFLOW_RUN_NAME, "train")
        tracker_for(cfg, train_run, run.client).set_tags(
            {MODEL_VERSION_TAG: result.version, MLFLOW_RUN_NAME: with_version(name, cfg, version)})


MODEL_VERSION_TAG = "forgeline.model_version"


def with_version(name: str, cfg: Config, version: str) -> str:
    """`pipeline tiny dp1 @1a2b3c4` as `pipeline tiny v3 dp1 @1a2b3c4`: the version after the
    config's label (tracking.run_name), once."""
    words = name.split(" ")
    if version in words:
        return name
    at = words.index(config_label(cfg)) + 1 if config_label(cfg) in words else len(words)
    return " ".join([*words[:at], version, *words[at:]])


def register_model(cfg: Config, run: RunTracker, checkpoint: str, tokenizer_dir: str,
                   version_tags: dict[str, str], key: str) -> RegisterResult:
    """The model version registered under `key`, complete: the one registered before (completed
    if its registration was interrupted), else a new one -- the checkpoint exported as a Hugging
    Face model, logged under `run` and registered."""
    name, uri = cfg.registry.model_name, run.client.tracking_uri
    client = MlflowClient(uri, uri)
    try:
        version = version_with_key(client, name, key)
    except MlflowException as err:
        raise RegistrationError(f"the model registry at {uri} did not answer ({first_line(err)}): nothing "
                                "was registered; rerun the register stage once it answers") from err
    if version is not None and is_complete(version):
        log.info("%s version %s holds these outputs already (%s %s): nothing to register", name,
                 version.version, REGISTRATION_KEY_TAG, key[:12])
    else:
        if version is None:
            version = create_version(cfg, client, run, checkpoint, tokenizer_dir, key)
        else:
            log.info("completing %s version %s: its registration was interrupted", name, version.version)
        complete_registration(client, uri, version, version_tags)
        log.info("registered %s version %s (alias %s)", name, version.version, CANDIDATE_ALIAS)
    result = RegisterResult(run_id=version.run_id, model_name=name, version=str(version.version),
                            model_uri=f"models:/{name}/{version.version}")
    write_text_atomic(Path(cfg.registry.out_dir) / REGISTERED_NAME,
                      json.dumps(asdict(result), indent=2) + "\n")
    return result


def version_with_key(client: MlflowClient, name: str, key: str) -> ModelVersion | None:
    """The version of `name` registered under `key`: a complete one before an incomplete one
    (there is one unless registrations of the same outputs ran at once)."""
    found = client.search_model_versions(f"name = '{name}' AND tags.`{REGISTRATION_KEY_TAG}` = '{key}'")
    return min(found, key=lambda v: (not is_complete(v), int(v.version))) if found else None


def create_version(cfg: Config, client: MlflowClient, run: RunTracker, checkpoint: str, tokenizer_dir: str,
                   key: str) -> ModelVersion:
    """A new version of the exported checkpoint, created with its key and marked incomplete in
    one call (what a rerun finds)."""
    name, uri = cfg.registry.model_name, client.tracking_uri
    model = load_from_checkpoint(checkpoint)
    mlflow.set_tracking_uri(uri)
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = export_hf(model, tokenizer_dir, Path(scratch) / "hf")  # LoRA adapters merged
        artifacts = {"hf": str(hf_dir)}
        if adapter := export_checkpoint_adapter(checkpoint, Path(scratch) / "peft_adapter"):
            artifacts["peft_adapter"] = str(adapter)  # and alone, for peft on the base
        try:
            with mlflow.start_run(run_id=run.run_id, nested=True):
                info = mlflow.pyfunc.log_model(
                    name="model",
                    python_model=HFGenerator(),
                    artifacts=artifacts,
                    signature=SIGNATURE,
                    input_example=pd.DataFrame({"prompt": ["ROMEO:"]}),
                    pip_requirements=[f"{package}=={package_version(package)}" for package in
                                      ("torch", "transformers", "tokenizers", "safetensors", "pandas")],
                )
            with mlflow_prints_off():
                return mlflow.register_model(info.model_uri, name, tags={REGISTRATION_KEY_TAG: key,
                                                                         REGISTRATION_TAG: INCOMPLETE})
        except (MlflowException, requests.RequestException) as err:
            raise RegistrationError(
                f"registering {name} in the model registry at {uri} failed before the version was complete "
                f"({first_line(err)}): no version of these outputs is usable. Rerun the register stage once "
                "the registry answers: it registers them once (completing the version this attempt "
                "created, if it got that far)") from err


@contextmanager
def mlflow_prints_off() -> Iterator[None]:
    """Without MLflow's "Successfully registered model ..." and "Created version ..." lines: it
    prints them to stderr past every logging handler, so past the console's filter and the
    stage's log file. The stage logs the version it registered itself."""
    was_enabled = MLFLOW_LOGGING_STREAM.enabled
    MLFLOW_LOGGING_STREAM.enabled = False
    try:
        yield
    finally:
        MLFLOW_LOGGING_STREAM.enabled = was_enabled


def complete_registration(client: MlflowClient, uri: str, version: ModelVersion,
                          tags: dict[str, str]) -> None:
    """Tag `version`, alias it `candidate` and mark it complete, last. On a failure, a registry
    that answers has the version deleted and the alias put back where it was; one that does not
    keeps it incomplete, for a rerun to complete."""
    name, number = version.name, str(version.version)
    previous, step = None, f"reading alias @{CANDIDATE_ALIAS}"
    try:
        if aliased_before := aliased(client, name, CANDIDATE_ALIAS):
            previous = str(aliased_before.version)
        for tag, value in tags.items():
            step = f"setting its tag {tag}"
            client.set_model_version_tag(name, number, tag, value)
        step = f"setting alias @{CANDIDATE_ALIAS}"
        client.set_registered_model_alias(name, CANDIDATE_ALIAS, number)
        step = f"setting its tag {REGISTRATION_TAG}={COMPLETE}"
        client.set_model_version_tag(name, number, REGISTRATION_TAG, COMPLETE)
    except Exception as err:
        raise interrupted(client, uri, version, step, err, previous) from err


def interrupted(client: MlflowClient, uri: str, version: ModelVersion, step: str, err: Exception,
                previous: str | None) -> RegistrationError:
    """The error of a registration that failed while `step`, after undoing it if the registry
    answers."""
    name, number = version.name, str(version.version)
    what = f"{name} version {number} in the model registry at {uri}"
    unused = (f"It stays incomplete ({REGISTRATION_TAG}={INCOMPLETE}), so it is never used as champion, "
              "candidate or base")
    if not registry_answers(uri):
        return RegistrationError(
            f"the model registry at {uri} stopped answering while registering {name} version {number}, at "
            f"{step} ({first_line(err)}). {unused}. Rerun the register stage once the registry answers: it "
            f"completes version {number} instead of registering another")
    try:
        client.delete_model_version(name, number)
        if previous is not None and previous != number:
            client.set_registered_model_alias(name, CANDIDATE_ALIAS, previous)
    except Exception as cleanup:
        return RegistrationError(
            f"registering {what} failed at {step} ({first_line(err)}), and deleting the incomplete version "
            f"failed too ({first_line(cleanup)}). {unused}. Rerun the register stage: it completes it")
    back = f" and @{CANDIDATE_ALIAS} is on version {previous}" if previous not in (None, number) else ""
    return RegistrationError(
        f"registering {what} failed at {step} ({first_line(err)}); the incomplete version was deleted{back} "
        "as before: nothing was registered. Rerun the register stage once the cause is fixed")


def registry_answers(uri: str) -> bool:
    """Whether the registry at `uri` answers now. A tracking server is asked once, with a short
    timeout: MLflow's client retries a dead one for minutes. A database store: assumed to (the
    clean-up that follows finds out)."""
    if not uri.startswith(("http://", "https://")):
        return True
    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S)
    except requests.RequestException:
        return False
    return True


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:500]
