"""dvc.yaml and the README's stage table, rendered from the stage records (tasks/stage.py).

`forgeline stages --write` writes them; tests/unit/test_stage_records.py fails when the files
in the checkout differ from what the records render."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from forgeline.configs import Config, load_config
from forgeline.tasks.code_inputs import PACKAGE_ROOT, collapsed
from forgeline.tasks.stage import (
    BASE,
    STAGES,
    BaseStamp,
    Output,
    Snapshot,
    Stage,
    pipeline_stages,
    stage_named,
)

PARAMS_FILE = "configs/tiny.yaml"  # the config `dvc repro` runs, and its params file
DVC_HEADER = """\
# Generated from the stage records (tasks/stage.py) by `forgeline stages --write`; edit those.
# (`forgeline stages --dvc CONFIG` prints the same for another config: a fine-tuning one's has
# sft in place of train.)
# The stages for `dvc repro`: each runs `forgeline stage NAME` on {PARAMS_FILE}, its params are
# that config's, and its deps and outs are the directories that config names -- its run's,
# artifacts/{RUN}/, and its data's -- so the Prefect pipeline and DVC agree on where every
# artifact lives, and forgeline's stage cache decides as `dvc repro` does (docs/caching.md). A
# change to a key that names the run (the data, model, train or sft section's) moves them: a
# stage DVC runs then fails before any work, saying so, until `forgeline stages --write` has
# rewritten this file (`forgeline stages --check` tells). The data stage is two here:
# `sources` snapshots the raw inputs into data.raw_dir (`--snapshot-only`), `data` builds from
# that snapshot (`--from-snapshot`). `sources` always runs: the packaged corpora and datasets it reads live
# outside the repository, so only reading them tells whether they changed (`dvc status`
# therefore always lists it). Unchanged inputs give a byte-identical snapshot, which it leaves
# untouched (`persist`: DVC does not delete it first), so data and what follows rerun only when
# the raw inputs changed. `base` always runs too: it writes the identity of the pretrained base
# of model.init_from (the sha256 of its weights and tokenizer: a registry alias moves, a directory
# is rewritten in place) to <data.out_dir>.base.json (`forgeline stage train --base-only`),
# rewritten only when it changed; data, train and eval depend on it. Change only the eval section
# and `dvc repro` reruns eval (and register, if the scores changed), never data or train. The
# outputs of data and train persist too: rerun, the data stage rewrites nothing for unchanged
# inputs and training resumes from its checkpoints (of the same base), as under `forgeline run`.
# Each stage's code deps are derived from what it imports (tasks/code_inputs.py): a folder stands
# for all its files where the stage uses every one.
# `dvc push` / `dvc pull` move the raw snapshot, the data and train outputs (and eval's) to the
# default remote (.dvc/config: dvc-storage/ here; `dvc remote add -d s3 s3://bucket/prefix` for
# S3); `dvc exp run -S {PARAMS_FILE}:eval.dimensions.math.limit=20` runs an experiment on a key
# of the same run (eval, registry; `forgeline run --set` gives another run a directory of its
# own); `dvc metrics diff` and `dvc plots show|diff` compare the eval scores and the training loss
# curve across revisions.
"""


class Paths:
    """The directories of one config, as dvc.yaml names them (relative to the repository root)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def of(self, field: str, path: str = "") -> str:
        """A config field's directory, and a path inside it: artifacts/tiny-1a2b3c4d/eval/metrics.json."""
        value = self.cfg.value(field)
        return f"{value}/{path}" if path else value

    def base_stamp(self, base: BaseStamp) -> str:
        return str(base.path(self.cfg))

    def loss_curve(self) -> dict[str, Any]:
        """Top-level plots may name files inside an output: the loss curve the train stage writes."""
        return {self.of("train.out_dir", "loss.csv"): {"x": "step", "y": "loss", "title": "training loss"}}


def dvc_stages(params_file: str, paths: Paths) -> dict[str, dict[str, Any]]:
    """dvc.yaml's `stages` for the config `params_file`, whose pipeline they are, in order."""
    pipeline = pipeline_stages(paths.cfg)
    stages: dict[str, dict[str, Any]] = {}
    for stage in pipeline:
        if stage.reads_base and BASE.name not in stages:
            stages[BASE.name] = base_entry(BASE, params_file, pipeline, paths)
        if stage.snapshot is not None:
            stages[stage.snapshot.name] = snapshot_entry(stage, stage.snapshot, params_file, paths)
        stages[stage.name] = stage_entry(stage, params_file, paths)
    return stages


def snapshot_entry(stage: Stage, snapshot: Snapshot, params_file: str, paths: Paths) -> dict[str, Any]:
    reads = [paths.of(stage_named(read.stage).output, read.path) for read in snapshot.reads
             if stage_named(read.stage).runs_for(paths.cfg)]
    return {"cmd": f"forgeline stage {stage.name} --config {params_file} --snapshot-only",
            "always_changed": True,
            "deps": reads + list(snapshot.code),
            "params": [{params_file: list(snapshot.params)}],
            "outs": [{paths.of(snapshot.output): {"persist": True}}]}


def base_entry(base: BaseStamp, params_file: str, pipeline: tuple[Stage, ...],
               paths: Paths) -> dict[str, Any]:
    """Run by the stage that trains (train, or sft), with --base-only."""
    [owner] = [stage for stage in pipeline if stage.output == base.run_by]
    return {"cmd": f"forgeline stage {owner.name} --config {params_file} --base-only",
            "always_changed": True,
            "deps": list(base.code),
            "params": [{params_file: list(base.params)}],
            "outs": [{paths.base_stamp(base): {"cache": False, "persist": True}}]}


def stage_entry(stage: Stage, params_file: str, paths: Paths) -> dict[str, Any]:
    flag = " --from-snapshot" if stage.snapshot else ""
    deps = [paths.of(stage_named(read.stage).output, read.path) for read in stage.reads]
    if stage.snapshot is not None:
        deps.append(paths.of(stage.snapshot.output))
    if stage.reads_base:
        deps.append(paths.base_stamp(BASE))
    entry: dict[str, Any] = {"cmd": f"forgeline stage {stage.name} --config {params_file}{flag}",
                             "deps": deps + list(stage.code),
                             "params": [{params_file: [*stage.sections, *stage.params_of(paths.cfg)]}]}
    for kind, key in (("out", "outs"), ("metric", "metrics"), ("plot", "plots")):
        listed = [output_entry(stage, output, paths) for output in stage.outputs if output.kind == kind]
        if listed:
            entry[key] = listed
    return entry


def output_entry(stage: Stage, output: Output, paths: Paths) -> str | dict[str, Any]:
    path = paths.of(stage.output, output.path)
    options = {"cache": False} if not output.cache else {}
    if output.persist:
        options["persist"] = True
    return {path: options} if options else path


def render_dvc_yaml(params_file: str = PARAMS_FILE, root: Path = PACKAGE_ROOT) -> str:
    """dvc.yaml for the config `params_file`, a path relative to the repository root `root`
    (DVC's working directory): its pipeline's stages, pretraining or fine-tuning, with the
    directories that config names."""
    paths = Paths(load_config(str(root / params_file)))
    body = {"stages": dvc_stages(params_file, paths), "plots": [paths.loss_curve()]}
    header = DVC_HEADER.format(PARAMS_FILE=params_file, RUN=paths.cfg.run.name)
    return header + yaml.safe_dump(body, sort_keys=False, width=100)


def written_outputs(entry: dict[str, Any]) -> list[str]:
    """The paths a dvc.yaml stage entry lists among its outs, metrics and plots."""
    return [next(iter(out)) if isinstance(out, dict) else out
            for key in ("outs", "metrics", "plots") for out in entry.get(key, ())]


def check_dvc_outputs(cfg: Config, params_file: str) -> None:
    """Under `dvc repro` (DVC names the stage in $DVC_STAGE and the repository in $DVC_ROOT): fail
    before any work unless the stage's outputs in dvc.yaml are where `cfg` writes them. A change
    to a key that names the run moves its directory; DVC, still reading the old paths, would
    record outputs this run never wrote."""
    name, root = os.environ.get("DVC_STAGE"), os.environ.get("DVC_ROOT")
    if not name or not root or ":" in name or not (Path(root) / "dvc.yaml").is_file():
        return
    listed = yaml.safe_load((Path(root) / "dvc.yaml").read_text()).get("stages", {}).get(name)
    now = dvc_stages(params_file, Paths(cfg)).get(name)
    if listed is None or now is None or written_outputs(listed) == written_outputs(now):
        return
    raise ValueError(f"dvc.yaml's stage {name} writes {', '.join(written_outputs(listed))}, but "
                     f"{params_file} now writes to {', '.join(written_outputs(now))} (run {cfg.run.name}: a "
                     "key that names the run changed). Run `forgeline stages --write` so that dvc.yaml "
                     "follows the config, then `dvc repro`; nothing was run")


TABLE_BEGIN = "<!-- stage table: `forgeline stages --write` renders it from tasks/stage.py -->"
TABLE_END = "<!-- end of stage table -->"


def replace_stage_table(readme: str, table: str) -> str:
    """`readme` with the text between its stage table markers replaced by `table`."""
    before, begin, rest = readme.partition(TABLE_BEGIN)
    _, end, after = rest.partition(TABLE_END)
    if not (begin and end):
        raise ValueError(f"README.md lacks the stage table markers {TABLE_BEGIN!r} ... {TABLE_END!r}")
    return f"{before}{TABLE_BEGIN}\n{table}{TABLE_END}{after}"


def render_stage_table() -> str:
    """The README's table of stages: what each reads, computes from, runs and writes. Its code
    column names what a stage runs beyond the code every stage runs, listed below it."""
    shared = collapsed(set.intersection(*(set(stage.code_files) for stage in STAGES)))
    rows = ["| stage | what it does | reads | config sections | code | writes |", "|---|---|---|---|---|---|"]
    for stage in STAGES:
        reads = [f"`{stage_named(r.stage).output}`" + (f"/{r.path}" if r.path else "") for r in stage.reads]
        if stage.snapshot is not None:
            reads.append(f"`{stage.snapshot.output}` (its snapshot of the sources, taken first"
                         + "".join(f", with `{stage_named(r.stage).output}`/{r.path} where {r.stage} runs"
                                   for r in stage.snapshot.reads) + ")")
        if stage.reads_base:
            reads.append("the base of `model.init_from`, by content")
        files = [output.path for output in stage.outputs if output.path]
        writes = f"`{stage.output}`" + (f": {', '.join(f'`{f}`' for f in files)}" if files else "")
        own = [entry for entry in stage.code if entry not in shared]
        rows.append(f"| {stage.name} | {stage.summary} | {', '.join(reads) or 'its sources'} | "
                    f"{', '.join(f'`{s}`' for s in (*stage.sections, *stage.params))} | "
                    f"{', '.join(f'`{c}`' for c in own)} | {writes} |")
    every = ", ".join(f"`{entry}`" for entry in shared)
    return "\n".join(rows) + f"\n\nEvery stage also runs {every}.\n"
