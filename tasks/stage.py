"""The pipeline's stages, each defined once, here, by a `Stage` record.

A record says what a stage reads (config sections, upstream outputs, a snapshot of inputs from
outside the repository, the pretrained base by content), where it writes, what it computes and
how it is tracked. Its code is not listed but derived from the record's references: the modules
they import or start, transitively, and the package files those read (tasks/code_inputs.py).
Every other view of a stage derives from it:

- the stage cache's key and the outputs it verifies (tasks/cache.py);
- the tracked run of a stage -- preflight checks, the MLflow params of its sections, the plain
  function, what it records in MLflow -- and `--upstream-run` resolution (tasks/runner.py);
- the Prefect tasks and flows, one flow per stage, with their retries (flows/stage_flows.py);
- the CLI's stage choices and its snapshot flags (flows/cli.py);
- dvc.yaml and the README's stage table (tasks/dvc_yaml.py), the stage deployments of
  prefect.yaml (flows/deploy.py): `forgeline stages --write` regenerates the files, and
  tests/unit/test_stage_records.py fails on any difference.

This module is light (no torch, MLflow, lm-eval): the CLI reads it to parse its arguments.
Functions are named by reference, `module:attribute`, and imported only when a stage runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from forgeline.configs import Config
from forgeline.tasks.code_inputs import (
    PACKAGE_ROOT,
    code_files,
    collapsed,
    imported_source,
    installed_files,
    installed_versions,
    reached,
)


def resolve(reference: str) -> Any:
    """The object a `package.module:attribute[.attribute]` reference names."""
    module, _, attributes = reference.partition(":")
    found: Any = importlib.import_module(module)
    for name in attributes.split("."):
        found = getattr(found, name)
    return found


@dataclass(frozen=True)
class Upstream:
    """An upstream stage's output that a stage reads: all of it, or one path inside it."""

    stage: str
    path: str = ""


@dataclass(frozen=True)
class Output:
    """One output of a stage, a path inside its output directory ("": all of it), as DVC lists
    it: among the stage's outs, metrics or plots, kept in DVC's cache or (cache=False) in git.
    The stage cache verifies them all."""

    path: str = ""
    kind: Literal["out", "metric", "plot"] = "out"
    cache: bool = True
    persist: bool = False
    """Kept when the stage runs again (DVC deletes other outputs first): the stage itself decides
    what of it to reuse."""


@dataclass(frozen=True)
class Snapshot:
    """A step before a stage that copies its inputs from outside the repository (packaged corpora,
    datasets, local files) into a directory of the stage's, every time it runs: only reading them
    tells whether they changed. Unchanged inputs leave the directory untouched, so the stage
    after it reruns only when they changed. `forgeline stage NAME --snapshot-only` runs only this
    step, `--from-snapshot` only the stage."""

    name: str
    """Its DVC stage."""
    output: str
    """Config field of the directory it writes."""
    params: tuple[str, ...]
    """Dotted config keys it reads (its DVC params)."""
    preflight: str
    """(cfg) -> None: fails before any work if an input cannot be read."""
    take: str
    """(cfg) -> summary: takes the snapshot."""
    check: str
    """(cfg) -> None: fails unless the snapshot there is intact and was taken for this config."""
    reads: tuple[Upstream, ...] = ()
    """Upstream outputs among what it copies, where their stage is of the config's pipeline (the
    pairs stage's pairs, which a `kind: pairs` source reads): the DVC deps that run it after them.
    The stage's cache key has them through the snapshot's hash."""

    @property
    def code(self) -> tuple[str, ...]:
        """Its DVC deps: the code its functions import (tasks/code_inputs.py)."""
        return collapsed(code_files((self.preflight, self.take, self.check)))


@dataclass(frozen=True)
class BaseStamp:
    """The pretrained base of `model.init_from` by content: what the reference resolves to now (a
    registry alias moved to another version, a Hugging Face directory rewritten in place, another
    GGUF file at the path). Its identity is part of the cache key of each stage that reads the
    base (`Stage.reads_base`). DVC cannot see it: dvc.yaml has an always-changed stage write it to
    a small stamp file -- byte-identical while the base is the same, so nothing after it reruns --
    which those stages depend on. `forgeline stage train --base-only` runs only this step."""

    name: str
    """Its DVC stage."""
    beside: str
    """Config field of the directory the stamp is written beside: `<directory><suffix>`. The
    data's, which is named by model.init_from among the rest: a change that moves the run's
    directory (train.lr) moves no dep of the data stage."""
    run_by: str
    """Config field of the output of the stage that writes it (`forgeline stage NAME --base-only`):
    train's, or sft's in its place."""
    suffix: str
    params: tuple[str, ...]
    """Dotted config keys it reads (its DVC params)."""
    identity: str
    """(cfg) -> dict: the base's identity, the same bytes for the same base."""

    def path(self, cfg: Config) -> Path:
        return Path(f"{cfg.value(self.beside)}{self.suffix}")

    @property
    def code(self) -> tuple[str, ...]:
        """Its DVC deps: the code its function imports (tasks/code_inputs.py)."""
        return collapsed(code_files((self.identity,)))


BASE = BaseStamp(name="base", beside="data.out_dir", run_by="train.out_dir", suffix=".base.json",
                 params=("model.init_from",), identity="forgeline.tasks.pretrained:base_identity")


@dataclass(frozen=True)
class Stage:
    name: str
    summary: str
    """One line: the README's stage table, the flow's and the deployment's description."""
    sections: tuple[str, ...]
    """Config sections it computes from: its DVC params and the config part of its cache key."""
    reads: tuple[Upstream, ...]
    """Upstream outputs it reads: DVC deps, the upstream part of its cache key, what
    `--upstream-run` takes from an earlier run, and what must exist before it starts."""
    output: str
    """Config field of its output directory."""
    outputs: tuple[Output, ...]
    """What it writes there, as DVC tracks it and its cache verifies."""
    done: str
    """The file it writes last, inside its output directory: its presence means a complete output."""
    result_type: str
    """The dataclass `function` returns; its fields are what the cache replays."""
    function: str
    """(cfg, run, parent) -> result: the plain stage function, run on a cache miss."""
    record: str
    """(cfg, run, parent, result) -> None: its metrics, tags and artifacts in MLflow, on every run."""
    params: tuple[str, ...] = ()
    """Dotted config keys of other sections it also computes from: DVC params (the key must be
    in the params file) and part of its cache key, like its sections; a key under a section the
    config leaves unset (`sft` of a pretraining run) is none of its inputs (`params_of`)."""
    preflight: str | None = None
    """(cfg) -> None: checks that need no upstream output, before any work."""
    retries: str | None = None
    """Config field with the Prefect retries of the whole stage; each retry resumes into the same
    MLflow run. None: no retries."""
    gives_up_on: str | None = None
    """An exception after which a retry would fail the same way: none is made."""
    snapshot: Snapshot | None = None
    external: str | None = None
    """(cfg) -> dict: inputs outside the files DVC sees, part of the cache key."""
    still_valid: str | None = None
    """(cfg, result fields) -> reason | None: why a cached result no longer holds although its
    files verify."""
    report: str | None = None
    """(result) -> Markdown: a Prefect artifact of each run."""
    reads_base: bool = False
    """It computes from the pretrained base (`model.init_from`): the base's identity, by content,
    is part of its cache key, and under DVC the base stamp is its dep (BaseStamp)."""
    continues: str | None = None
    """(cfg) -> run id | None: the MLflow run of its stopped work that this run goes on with (a
    training resumed from a checkpoint): reopened, not a new run (tasks/tracking.py tracked_run)."""
    pipeline: Literal["every", "pretraining", "sft", "preference"] = "every"
    """The pipelines it is part of, by the config's objective (Config.objective): a config with
    an `sft` section fine-tunes (data -> sft -> eval -> register), one with a `preference` section
    tunes preferences (data -> preference -> eval -> register), any other pretrains (data -> train
    -> eval -> register)."""

    only_with: str | None = None
    """A config section it computes from that a config may leave unset: with it unset, it is no
    stage of the config's pipeline (pairs: the pipeline makes its preference pairs only for a
    config with a `pairs` section)."""

    def runs_for(self, cfg: Config) -> bool:
        """Whether it is a stage of `cfg`'s pipeline."""
        return self.pipeline in ("every", cfg.objective) and (
            self.only_with is None or getattr(cfg, self.only_with) is not None)

    def out_dir(self, cfg: Config) -> Path:
        return Path(cfg.value(self.output))

    @property
    def entry_points(self) -> tuple[str, ...]:
        """The references of the record, its snapshot's too (taken or checked in its run): what a
        run of the stage imports first."""
        snapshot = (self.snapshot.preflight, self.snapshot.take, self.snapshot.check) if self.snapshot else ()
        return tuple(reference for reference in (
            self.function, self.record, self.preflight, self.result_type, self.still_valid, self.external,
            self.report, self.gives_up_on, self.continues, *snapshot) if reference is not None)

    @property
    def code_files(self) -> tuple[str, ...]:
        """Every file it runs or reads from the package: the modules its entry points import or
        start, transitively, and the package files they read (tasks/code_inputs.py)."""
        return code_files(self.entry_points)

    @property
    def code(self) -> tuple[str, ...]:
        """`code_files` with folders whose every file is among them named instead (its DVC deps,
        the README's code column): the same files."""
        return collapsed(self.code_files)

    def code_hash(self) -> str:
        """sha256 over its code files (relative path and bytes, in sorted order; a module this
        process imported as it was imported): the code part of its cache key."""
        digest = hashlib.sha256()
        for name in self.code_files:
            digest.update(name.encode() + b"\0" + imported_source(PACKAGE_ROOT / name))
        return digest.hexdigest()

    def package_versions(self) -> dict[str, str | None]:
        """The installed version of each third-party distribution its code imports: the
        third-party part of its cache key (tasks/code_inputs.py)."""
        return installed_versions(reached(self.entry_points).third_party)

    def installed_files(self) -> dict[str, str]:
        """The sha256 of each installed package's file its code reads (lm-eval's task YAMLs)."""
        return installed_files(reached(self.entry_points).modules)

    def params_of(self, cfg: Config) -> tuple[str, ...]:
        """`params` that `cfg` has: less those under a section it leaves unset."""
        return tuple(key for key in self.params if getattr(cfg, key.split(".")[0]) is not None)

    def done_marker(self, cfg: Config) -> Path:
        return self.out_dir(cfg) / self.done

    @property
    def upstream(self) -> tuple[str, ...]:
        """The stages it reads from, in pipeline order."""
        return tuple(dict.fromkeys(read.stage for read in self.reads))


TRAIN = Stage(
    name="train",
    summary="torchrun on the named DeviceMesh (PP x FSDP2/HSDP x TP) to a committed DCP checkpoint",
    sections=("model", "parallel", "train", "checkpoint"),
    reads=(Upstream("data"),),
    output="train.out_dir",
    outputs=(Output(persist=True),),  # a rerun resumes from its checkpoints
    done="train.json",
    result_type="forgeline.tasks.train.job:TrainResult",
    function="forgeline.tasks.train.job:train_stage",
    record="forgeline.tasks.train.job:record_training",
    preflight="forgeline.tasks.train.job:preflight_train",
    retries="train.job_retries",
    gives_up_on="forgeline.model.training.callbacks:TrainingUnstable",
    reads_base=True,  # starts from its weights; a new base is trained from, not resumed
    continues="forgeline.tasks.train.curves:stopped_run",
    pipeline="pretraining",
)
# The same trainer and outputs, on the data stage's rendered conversations: it takes train's place.
SFT = dataclasses.replace(
    TRAIN,
    name="sft",
    summary="supervised fine-tuning: the train stage's trainer on the data stage's rendered "
            "conversations, the loss on assistant tokens only (LoRA adapters or every weight)",
    sections=(*TRAIN.sections, "sft"),
    pipeline="sft",
)
# The same trainer on the data stage's rendered preference pairs, against the model it starts from.
PREFERENCE = dataclasses.replace(
    TRAIN,
    name="preference",
    summary="preference tuning (DPO or SimPO): the train stage's trainer on the data stage's rendered pairs "
            "of replies, the loss on each completion's tokens only, against the reference log-probabilities "
            "of the model it starts from",
    sections=(*TRAIN.sections, "preference"),
    pipeline="preference",
)

STAGES = (
    Stage(
        name="pairs",
        summary="preference pairs made offline: prompts with constraints of the trained IFEval instruction "
                "types (none of IFEval's prompts), replies sampled from the base, checked by lm-eval's "
                "registry; one that follows every constraint and one that does not make a pair",
        sections=("pairs",),
        reads=(),
        output="pairs.out_dir",
        outputs=(Output(),),
        done="manifest.json",
        result_type="forgeline.tasks.pairs.build:PairsResult",
        function="forgeline.tasks.pairs.build:pairs_stage",
        record="forgeline.tasks.pairs.build:record_pairs",
        preflight="forgeline.tasks.pairs.build:preflight_pairs",
        reads_base=True,  # the policy that replies
        pipeline="preference",
        only_with="pairs",
    ),
    Stage(
        name="data",
        summary="sources -> raw snapshot -> cleaning and dedup -> tokenizer -> packed, checksummed shards",
        sections=("data",),
        # A run from a base tokenizes with the base's tokenizer; fine-tuning's masks cover the
        # assistant turns sft.train_on names.
        params=("model.init_from", "sft.train_on"),
        reads=(),
        output="data.out_dir",
        outputs=(Output(persist=True),),  # a rebuild of the same inputs rewrites nothing
        done="manifest.json",
        result_type="forgeline.tasks.data.build:DataResult",
        function="forgeline.tasks.data.build:build_stage",
        record="forgeline.tasks.data.build:record_data",
        preflight="forgeline.tasks.data.build:preflight_tokenizer",
        external="forgeline.tasks.data.build:files_named_by_path",  # a tokenizer, a chat template
        reads_base=True,  # its tokenizer, by content
        snapshot=Snapshot(
            name="sources",
            output="data.raw_dir",
            params=("data.sources",),
            preflight="forgeline.tasks.data.sources:preflight_sources",
            take="forgeline.tasks.data.snapshot:take_snapshot",
            check="forgeline.tasks.data.snapshot:check_snapshot",
            reads=(Upstream("pairs", "pairs.jsonl"),),
        ),
    ),
    TRAIN,
    SFT,
    PREFERENCE,
    Stage(
        name="eval",
        summary="lm-eval with the `forgeline` model class on the offline suite, scored per capability "
                "dimension",
        sections=("eval",),
        params=("pairs.instruction_types",),  # reports IFEval's prompts of trained and held-out types apart
        reads=(Upstream("data"), Upstream("train")),
        output="eval.out_dir",
        outputs=(Output("lm_eval_results.json"), Output("report.json"), Output("items.json"), Output("tasks"),
                 Output("metrics.json", "metric", cache=False),
                 Output("dimensions.png", "plot", cache=False)),
        done="metrics.json",
        result_type="forgeline.tasks.evaluate:EvalResult",
        function="forgeline.tasks.evaluate:eval_stage",
        record="forgeline.tasks.evaluate:record_eval",
        preflight="forgeline.tasks.evaluate:preflight_eval",
        report="forgeline.tasks.evaluate:EvalResult.markdown",
        reads_base=True,  # scores the base beside the run
    ),
    Stage(
        name="register",
        summary="a pyfunc MLflow model version over the Hugging Face export, aliased `candidate`; "
                "the promotion gate moves `champion`",
        sections=("registry",),
        # Not items.json: it changes with the suite's fingerprint (any eval code change) while the
        # scores stay; registering again then would add a version of identical scores. The gate
        # reads it all the same, and re-evaluates a champion whose fingerprint differs.
        reads=(Upstream("data", "tokenizer"), Upstream("train"), Upstream("eval", "metrics.json")),
        output="registry.out_dir",
        outputs=(Output("registered.json", cache=False),),
        done="registered.json",
        result_type="forgeline.tasks.register:RegisterResult",
        function="forgeline.tasks.register:register_stage",
        record="forgeline.tasks.register:record_registration",
        external="forgeline.tasks.tracking:registry_input",
        still_valid="forgeline.tasks.tracking:version_still_registered",
    ),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def pipeline_stages(cfg: Config) -> tuple[Stage, ...]:
    """The stages of `cfg`'s pipeline, in order."""
    return tuple(stage for stage in STAGES if stage.runs_for(cfg))


def chain() -> str:
    """The pipelines in one line, stages that take each other's place joined by `|`, a stage
    only some configs run in brackets: [pairs] -> data -> train | sft | preference -> eval -> register."""
    steps: list[list[Stage]] = []
    for stage in STAGES:
        if steps and stage.pipeline != "every" and stage.output == steps[-1][-1].output:
            steps[-1].append(stage)
        else:
            steps.append([stage])
    return " -> ".join(" | ".join(f"[{s.name}]" if s.only_with else s.name for s in step) for step in steps)


def producer(name: str, cfg: Config) -> Stage:
    """The stage of `cfg`'s pipeline that writes what stage `name` writes: `name` itself, or the
    stage that takes its place there (sft writes the model that train would)."""
    stage = stage_named(name)
    if stage.runs_for(cfg):
        return stage
    [instead] = [other for other in pipeline_stages(cfg) if other.output == stage.output]
    return instead


def check_in_pipeline(stage: Stage, cfg: Config) -> None:
    """Fail unless `stage` is one of `cfg`'s pipeline (train of a fine-tuning config, sft of a
    pretraining one)."""
    if stage.only_with is not None and getattr(cfg, stage.only_with) is None:
        raise ValueError(f"the config has no `{stage.only_with}` section, which stage {stage.name} computes "
                         f"from: set it to run {stage.name}")
    if not stage.runs_for(cfg):
        instead = producer(stage.name, cfg)
        why = {"sft": "fine-tunes (it has an `sft` section)",
               "preference": "tunes preferences (it has a `preference` section)",
               "pretraining": "has no `sft` section (nor `preference`)"}[cfg.objective]
        pipeline = " -> ".join(s.name for s in pipeline_stages(cfg))
        raise ValueError(f"the config {why}: its pipeline is {pipeline}; run "
                         f"`forgeline stage {instead.name}` instead of {stage.name}")


def stage_named(name: str) -> Stage:
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise KeyError(f"no stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
