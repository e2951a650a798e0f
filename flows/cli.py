"""`forgeline`: run the pipeline, one stage, or inspect a config.

    forgeline run [--config PATH] [--set section.key=value ...] [--force]
    forgeline stage {data,train,eval,register} [--config PATH] [--set ...] [--upstream-run RUN_ID] [--force]
    forgeline stage data [--snapshot-only | --from-snapshot] [...]
    forgeline stage train --base-only [...]   (the identity of the base, for dvc.yaml)
    forgeline status [--config PATH] [--set ...] [--json]   (which stages would run, and why)
    forgeline stages [--write | --check | --dvc CONFIG] [--root DIR]   (stage records; dvc.yaml, prefect.yaml)
    forgeline config show [--config PATH] [--set ...] [--docs]
    forgeline plan --nodes N --accelerators-per-node K --memory-gib G [...] [--write-config OUT]
    forgeline checkpoints {list,verify,rollback,export} [...]
    forgeline clean PATH... [--outside-artifacts]   (remove checkpoint or run directories the user names)
    forgeline promote [--version V] [--force]   (move alias `champion` if the eval gate passes)
    forgeline compare RUN_ID RUN_ID... [--diff-only]
    forgeline deploy [--prefect-file prefect.yaml] [--workdir DIR] [--pool NAME]
    forgeline reproduce RUN_ID [--out DIR] [--tolerance T]
    forgeline sync [--config PATH] [--set ...]   (what servers missed: tracking writes, flow states)
    forgeline lm-eval ARGS...   (lm-eval's own command line, with the `forgeline` model class)
    forgeline generate MODEL [PROMPT | --prompts-file FILE] [--temperature T] [--top-p P] [...]
    forgeline chat MODEL [--system TEXT] [--temperature T] [--top-p P] [...]   (stdin: /reset, /exit)

Every verb takes -v/--verbose: every library's log lines and progress bars on the console
(flows/console.py). Each verb is one function; `main` is the one place that turns an error into
an exit status: 2 for input that cannot be used or a server that does not answer (reported
before any work), 1 for work that failed. Work that
finished while the Prefect API was gone ends 0 with a warning (`StateNotReported`). SIGTERM or
SIGHUP -- and Ctrl-C, for the verbs that run stages -- stops the work in order and ends 128 + the
signal's number (`Terminated`).
"""

from __future__ import annotations

import _thread
import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from forgeline.configs import Config, ConfigError, load_config
from forgeline.configs.environment import apply_environment_defaults
from forgeline.configs.loader import config_docs
from forgeline.configs.redaction import install_log_scrubber, scrub
from forgeline.configs.schema import ACTIVATION_CHECKPOINT_MODES
from forgeline.flows.console import configure_console
from forgeline.tasks.stage import BASE, STAGE_NAMES, STAGES, Stage, pipeline_stages, resolve, stage_named
from forgeline.tasks.stage import chain as pipeline_chain

if TYPE_CHECKING:  # imports Prefect: the CLI imports it only for the verbs that run flows
    from forgeline.flows.orchestrator import PendingStates

SNAPSHOT_STAGES = tuple(stage.name for stage in STAGES if stage.snapshot is not None)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH",
                        help="run config YAML, or the name of a shipped one (default: tiny.yaml)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                        default=[], help="override one config value (repeatable), e.g. "
                                         "--set train.steps=50 --set parallel.dp_shard=2")


def add_force_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="run even a stage whose inputs (config section, upstream outputs, code) are "
                             "unchanged and whose outputs verify; by default such a stage is skipped")


def build_parser() -> argparse.ArgumentParser:
    chain = pipeline_chain()
    parser = argparse.ArgumentParser(
        prog="forgeline",
        description=f"Corpus to a registered, evaluated model: {chain}, orchestrated by Prefect, "
                    "tracked in MLflow, versioned with DVC.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    run = verbs.add_parser("run", help="run the whole pipeline as a Prefect flow",
                           description=f"Run {chain} as the forgeline-pipeline Prefect flow under one "
                                       "MLflow parent run; prints the run id and the registered model "
                                       "version.")
    add_config_arguments(run)
    add_force_argument(run)

    stage = verbs.add_parser("stage", help="run one stage as its own Prefect flow",
                             description="Run one stage; it reads its inputs from the upstream "
                                         "stages' output directories named in the config.")
    stage.add_argument("name", choices=STAGE_NAMES, help="the stage to run")
    add_config_arguments(stage)
    add_force_argument(stage)
    stage.add_argument("--upstream-run", metavar="RUN_ID",
                       help="read the upstream stages' outputs recorded by this earlier MLflow run (a "
                            "pipeline or stage run) instead of the config's output directories")
    steps = stage.add_mutually_exclusive_group()
    where = ", ".join(f"{name}: {stage_named(name).snapshot.output}" for name in SNAPSHOT_STAGES)
    steps.add_argument("--snapshot-only", action="store_true",
                       help=f"only take the snapshot of the stage's inputs ({where}), rewritten only if they "
                            "changed; no Prefect flow or MLflow run (dvc.yaml's snapshot stage)")
    steps.add_argument("--from-snapshot", action="store_true",
                       help="build from the snapshot already there, reading no source. Fails if it is "
                            "missing, damaged or taken for another config")
    steps.add_argument("--base-only", action="store_true",
                       help="only write the identity of the pretrained base of model.init_from (the "
                            f"sha256 of its weights and tokenizer) to <{BASE.beside}>{BASE.suffix}, "
                            "rewritten only if it changed; no Prefect flow or MLflow run (dvc.yaml's "
                            "base stage)")
    status = verbs.add_parser(
        "status", help="which stages would run now, and why",
        description="For each stage, in order: whether it would be skipped (its inputs and outputs are "
                    "those its last run recorded) or what changed -- the stage cache's decision, as `dvc "
                    "status` reports DVC's. A stage after one that would run is judged on the outputs "
                    "there now.")
    add_config_arguments(status)
    status.add_argument("--json", action="store_true", help="a JSON object: stage -> reason, null if skipped")
    stages = verbs.add_parser(
        "stages", help="the stage records, and the files made from them",
        description="Print the stages as the README's table, or write (--write) or compare (--check) the "
                    "files made from the stage records (tasks/stage.py): dvc.yaml, prefect.yaml and the "
                    "README's stage table.")
    files = stages.add_mutually_exclusive_group()
    files.add_argument("--write", action="store_true", help="rewrite the files under --root")
    files.add_argument("--check", action="store_true", help="exit 1 if a file under --root differs")
    files.add_argument("--dvc", metavar="CONFIG",
                       help="print the dvc.yaml of this config's pipeline (a path from the repository root), "
                            "e.g. configs/smollm2-sft.yaml: sft in place of train")
    stages.add_argument("--root", default=".", help="the checkout holding them (default: .)")

    config = verbs.add_parser("config", help="inspect and validate run configs",
                              description="Inspect and validate run configs.")
    config_verbs = config.add_subparsers(dest="config_verb", required=True, metavar="ACTION")
    show = config_verbs.add_parser("show", help="print the resolved config (or --docs)",
                                   description="Validate a config with its overrides and print "
                                               "the resolved YAML.")
    add_config_arguments(show)
    show.add_argument("--docs", action="store_true",
                      help="print every section and field with its default and meaning instead")
    add_plan_parser(verbs)
    add_checkpoints_parser(verbs)
    add_clean_parser(verbs)
    add_registry_parsers(verbs)
    add_talk_parsers(verbs)
    deploy = verbs.add_parser(
        "deploy", help="register the Prefect deployments of prefect.yaml",
        description="Register the deployments of prefect.yaml (the scheduled pipeline and one manual "
                    "deployment per stage) with the Prefect API in PREFECT_API_URL, creating the work "
                    "pool as a process pool if it does not exist. Run them with "
                    "`prefect worker start --pool NAME`.")
    deploy.add_argument("--prefect-file", default="prefect.yaml", help="default: ./prefect.yaml")
    deploy.add_argument("--workdir", default=".",
                        help="directory the flow runs start in: relative output paths and the default "
                             "MLflow store resolve there (default: the current directory)")
    deploy.add_argument("--pool", default="forgeline", help="work pool (default: forgeline)")
    sync = verbs.add_parser(
        "sync", help="send what a server missed while it was unreachable",
        description="Send what this directory holds for a server that was unreachable when it happened: "
                    "the writes to MLflow runs that wait in the tracking spool (ops.tracking_spool), in "
                    "order, to the store each run is in; and the final states of flow runs and their task "
                    "runs that the Prefect API missed (.forgeline/pending/), set with force in the API each "
                    "run used. Idempotent; a record goes once its server took it. Exit 1 while some remain "
                    "pending.")
    add_config_arguments(sync)
    verbs.add_parser(
        "lm-eval", add_help=False,
        help="lm-evaluation-harness's command line with the `forgeline` model class registered "
             "(every argument is lm-eval's; `forgeline lm-eval --help` shows them)")
    add_verbose_argument(parser)
    return parser


def add_verbose_argument(parser: argparse.ArgumentParser, default: object = False) -> None:
    """-v/--verbose before the verb or after it (`forgeline run -v`): each verb's parser has it,
    with no default of its own, which would overwrite the one given before the verb."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="show every library's log lines and progress bars, each line with its "
                             "logger's name (by default: forgeline's events; the rest is in each stage's "
                             "log file under ops.log_dir)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, verb in action.choices.items():
                if name != "lm-eval":  # its arguments are lm-eval's
                    add_verbose_argument(verb, default=argparse.SUPPRESS)


def add_registry_parsers(verbs: argparse._SubParsersAction) -> None:
    promote = verbs.add_parser(
        "promote", help="move alias `champion` to a model version if the promotion gate passes",
        description="Apply the promotion gate (registry.promotion_margin, "
                    "registry.max_dimension_regression) to a version of registry.model_name and move "
                    "alias `champion` to it if it passes; while there is no champion, a version trained "
                    "from a base (model.init_from) faces its base the same way. The register stage does "
                    "this for every new version; use this after changing the gate, or --force to roll back.")
    add_config_arguments(promote)
    promote.add_argument("--version", help="model version (default: the one aliased `candidate`)")
    promote.add_argument("--force", action="store_true",
                         help="move `champion` without the gate, e.g. back to an earlier version")
    compare = verbs.add_parser(
        "compare", help="params and metrics of MLflow runs side by side",
        description="Print the params and latest metrics of MLflow runs side by side, as the MLflow "
                    "UI's compare view shows them; `*` marks rows that differ.")
    add_config_arguments(compare)
    compare.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    compare.add_argument("--diff-only", action="store_true", help="only the rows that differ")
    reproduce = verbs.add_parser(
        "reproduce", help="rerun a recorded pipeline run and check its data and scores match",
        description="Rerun data -> train -> eval of pipeline run RUN_ID from its recorded config "
                    "(artifact config.yaml), on its code version (this checkout must be at its git "
                    "commit, with the same uncommitted diff if it had one) into fresh output "
                    "directories, then compare the data version (DVC "
                    "md5) and every eval score with the recorded ones. Registers nothing. Exit 0 if all "
                    "match, 1 if not. --config/--set only say where the MLflow store is.")
    add_config_arguments(reproduce)
    reproduce.add_argument("run_id", metavar="RUN_ID")
    reproduce.add_argument("--out", help="output root (default: reproduce/RUN_ID)")
    reproduce.add_argument("--tolerance", type=float, default=1e-6,
                           help="largest absolute score difference that still matches (default 1e-6)")


def add_talk_parsers(verbs: argparse._SubParsersAction) -> None:
    model_help = ("a registered version or alias (models:/NAME@ALIAS, models:/NAME/VERSION, in the "
                  "config's registry), a checkpoint step directory, a Hugging Face directory: what "
                  "model.init_from takes")
    generate = verbs.add_parser(
        "generate", help="continue a prompt, or every prompt of a file, with a model",
        description="Stream PROMPT's continuation to stdout as its tokens are made, or with --prompts-file "
                    "write one JSON line per prompt with its `output`, rows decoded in batches.")
    chat = verbs.add_parser(
        "chat", help="talk to a model: one turn per line of stdin, replies streamed",
        description="A conversation through the model's chat template, one user turn per line of stdin "
                    "(a terminal or a pipe); each reply is streamed to stdout and ends at the template's "
                    "end-of-turn token. /reset forgets the conversation; /exit or end of input ends it.")
    for parser in (generate, chat):
        parser.add_argument("model", metavar="MODEL", help=model_help)
        add_config_arguments(parser)
        parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default: 0.7)")
        parser.add_argument("--top-p", type=float, default=0.9,
                            help="sample from the likeliest tokens holding this much probability "
                                 "(default: 0.9)")
        parser.add_argument("--max-new-tokens", type=int,
                            help="most tokens a reply has (default: 256, at most half the model's context)")
        parser.add_argument("--seed", type=int, help="the sampling seed (default: a random one)")
    prompts = generate.add_mutually_exclusive_group(required=True)
    prompts.add_argument("prompt", nargs="?", metavar="PROMPT", help="the text to continue")
    prompts.add_argument("--prompts-file", type=Path, metavar="FILE",
                         help="one prompt per line, or JSON lines ({\"prompt\": ...} or "
                              "{\"messages\": [...]}) for a .jsonl file")
    generate.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default: 16)")
    chat.add_argument("--system", help="a system message opening the conversation")


def add_checkpoints_parser(verbs: argparse._SubParsersAction) -> None:
    checkpoints = verbs.add_parser(
        "checkpoints", help="list, verify, roll back or export checkpoint versions",
        description="Operate on the committed checkpoints under <train.out_dir>/checkpoints (or --dir).")
    actions = checkpoints.add_subparsers(dest="checkpoints_verb", required=True, metavar="ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text, description=help_text)
        add_config_arguments(sub)
        sub.add_argument("--dir", help="checkpoint directory (default: <train.out_dir>/checkpoints)")
        return sub

    action("list", "committed checkpoints, newest first")
    action("verify", "check every file against its manifest's sha256; exit 1 if any fails").add_argument(
        "step", nargs="?", type=int, help="one step (default: all)")
    action("rollback", "make STEP the latest: newer versions move, intact, into rolled-back-<time>/ "
                       "and the next train run resumes from STEP").add_argument("step", type=int)
    export = action("export", "write STEP as a forgeline inference bundle or a Hugging Face directory of its "
                              "family")
    export.add_argument("step", type=int)
    export.add_argument("--out", required=True, help="new directory to write")
    export.add_argument("--format", choices=("bundle", "hf"), default="bundle",
                        help="bundle: safetensors + architecture + tokenizer for forgeline; hf: a "
                             "directory transformers' AutoModelForCausalLM.from_pretrained loads")


def add_clean_parser(verbs: argparse._SubParsersAction) -> None:
    clean = verbs.add_parser(
        "clean", help="remove checkpoint, stage output or run directories you name",
        description="Remove each PATH (a checkpoint directory, a stage's output directory, a run's "
                    "directory), all checked first: nothing is removed if one is missing or lies outside "
                    "artifacts/.")
    clean.add_argument("paths", nargs="+", metavar="PATH", type=Path)
    clean.add_argument("--outside-artifacts", action="store_true",
                       help="also remove paths outside artifacts/ (outputs a config placed elsewhere)")


def add_plan_parser(verbs: argparse._SubParsersAction) -> None:
    plan = verbs.add_parser(
        "plan", help="recommend TP/PP/DP for a model on a cluster and estimate its costs",
        description="Recommend tensor/pipeline/data-parallel degrees (TP within a node, PP <= max-pp, "
                    "DP fills the rest) for the config's model -- or a model of --params parameters -- "
                    "and print per-device memory, pipeline bubble, communication per step, checkpoint "
                    "size, the storage bandwidth a save window needs and the Young/Daly checkpoint "
                    "interval. --write-config saves the config with that layout for `forgeline run`.")
    add_config_arguments(plan)
    plan.add_argument("--params", type=float, help="plan for a model of this many parameters (e.g. 10e9)")
    plan.add_argument("--nodes", type=int, required=True, help="number of nodes")
    plan.add_argument("--accelerators-per-node", type=int, required=True)
    plan.add_argument("--memory-gib", type=float, required=True, help="memory per accelerator, GiB")
    plan.add_argument("--intra-node-gbps", type=float, default=300.0,
                      help="per-accelerator bandwidth inside a node, GB/s (default: 300, NVLink)")
    plan.add_argument("--inter-node-gbps", type=float, default=25.0,
                      help="per-accelerator bandwidth between nodes, GB/s (default: 25, 200 Gbit/s)")
    plan.add_argument("--seq-len", type=int, help="default: the config's data.seq_len")
    plan.add_argument("--global-batch", type=int, help="default: the config's train.global_batch_size")
    plan.add_argument("--microbatches", type=int, help="default: the config's parallel.pp_microbatches")
    plan.add_argument("--activation-checkpoint", choices=ACTIVATION_CHECKPOINT_MODES,
                      help="default: the config's parallel.activation_checkpoint")
    plan.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3),
                      help="how much of the model state data parallelism shards (default: 3, FSDP2)")
    plan.add_argument("--max-pp", type=int, default=4, help="deepest pipeline allowed (default: 4)")
    plan.add_argument("--save-window-s", type=float, default=300.0, help="time a checkpoint save may take")
    plan.add_argument("--mtbf-hours", type=float, default=24.0, help="mean time between job failures")
    plan.add_argument("--write-config", metavar="OUT", help="write the config with the planned layout here")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    apply_environment_defaults()  # before anything imports Prefect, MLflow, datasets or transformers
    verb = next((arg for arg in argv if not arg.startswith("-")), None)  # -v may come first
    with termination_signals_stop_the_work(ctrl_c=verb in CTRL_C_STOPS):
        try:
            return run_command(argv)
        except Terminated as stopped:
            print(f"forgeline: {stopped}", file=sys.stderr)
            return stopped.code


def run_command(argv: list[str]) -> int:
    if argv[:1] == ["lm-eval"]:
        return run_lm_eval(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    snapshot_flag = args.verb == "stage" and (args.snapshot_only or args.from_snapshot)
    if snapshot_flag and args.name not in SNAPSHOT_STAGES:
        parser.error(f"--snapshot-only and --from-snapshot are for `forgeline stage "
                     f"{'|'.join(SNAPSHOT_STAGES)}`")
    configure_console(args.verbose)  # before the verbs import the libraries: it sets their environment
    install_log_scrubber()  # the console handler; Prefect's own are covered by flow_config
    try:
        return VERBS[args.verb](args)
    except StateNotReported as unreported:
        print(scrub(f"forgeline: {'warning: ' if unreported.completed else ''}{unreported}"), file=sys.stderr)
        return 0 if unreported.completed else 1
    except WorkFailed as failed:
        print(scrub(f"forgeline: {failed}"), file=sys.stderr)
        return 1
    except unusable_input_errors() as err:
        print(scrub(f"forgeline: {getattr(err, 'message', None) or err}"), file=sys.stderr)
        return 2


TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# The verbs whose work Ctrl-C (SIGINT) stops as SIGTERM does, in order and in one sentence.
CTRL_C_STOPS = ("run", "stage", "reproduce")


class Terminated(SystemExit):
    """A termination signal (SIGTERM: a Kubernetes eviction, `timeout`, systemd; SIGHUP: the
    terminal went away; SIGINT: Ctrl-C, for CTRL_C_STOPS), raised in the main thread, so that
    the work stops through its `finally` blocks and context managers -- torchrun's ranks get
    SIGTERM and train.preemption_grace_s to save their step (tasks/train/launch.py) -- and the
    interpreter exits normally: what Prefect and Dask started in this process, the temporary
    Prefect API server and a local cluster, they stop at interpreter exit only, which the
    signal's default action skips. A SystemExit: no `except Exception` on the way takes it for a
    failure of the work, and it ends the process with 128 + the signal's number, as the signal
    would have, wherever it is raised."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal = signal.Signals(signum)

    def __str__(self) -> str:
        return (f"stopped by {self.signal.name}: the work was stopped in order, its finished stages kept "
                "(a rerun skips them, and training resumes from its last saved step)")


@contextmanager
def termination_signals_stop_the_work(ctrl_c: bool = False) -> Iterator[None]:
    """Within the block, the first SIGTERM or SIGHUP (with `ctrl_c`, SIGINT too:
    `ctrl_c_reaches_this_process_alone`) raises `Terminated` in the main thread; later
    ones are only logged, so that a second signal does not cut short the stopping it started
    (the ranks' grace period, the servers' shutdown). The previous handlers come back after the
    block, unless a signal came: the process is then on its way out, and its exit (where Prefect
    and Dask stop what they started) must not be cut short either. Inside a flow run Prefect's
    engine holds SIGTERM (prefect.utilities.engine.capture_sigterm): it raises its own
    TerminationSignal, to the same effect, and sends the signal again as the flow run ends, to
    this handler then. Only the main thread can install handlers: elsewhere (a caller's thread)
    the block runs with the process's own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[signal.Signals] = []

    def terminate(signum: int, frame: object) -> None:
        if received:
            logging.getLogger(__name__).warning("%s received while stopping after %s: the stopping goes on",
                                                signal.Signals(signum).name, received[0].name)
            return
        received.append(signal.Signals(signum))
        raise Terminated(signum)

    signals = TERMINATION_SIGNALS + ((signal.SIGINT,) if ctrl_c else ())
    previous = {signum: signal.signal(signum, terminate) for signum in signals}
    if ctrl_c:
        ctrl_c_reaches_this_process_alone()
    try:
        yield
    finally:
        if not received:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if ctrl_c:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def ctrl_c_reaches_this_process_alone() -> None:
    """Ctrl-C sends SIGINT to the terminal's whole foreground process group, so also to Prefect's
    temporary API server and a local Dask cluster, which would stop at once, before the work had
    told them how it ended. SIGINT is blocked in this thread, and so in every thread and process
    started from it from now on (a blocked signal stays blocked across fork and exec; uvicorn
    installs a handler, but never unblocks it); one thread takes it and raises it in the main
    thread, where the handler turns it into `Terminated`."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    threading.Thread(target=relay_sigint_to_the_main_thread, name="forgeline-ctrl-c", daemon=True).start()


def relay_sigint_to_the_main_thread() -> None:
    while True:
        signal.sigwait({signal.SIGINT})
        _thread.interrupt_main(signal.SIGINT)


class WorkFailed(Exception):
    """A flow started and failed; Prefect's log above has its traceback."""


class StateNotReported(Exception):
    """A flow run's work ended but the Prefect API could not be told: its final state waits for
    `forgeline sync` (flows/orchestrator.py). `completed`: all its work finished, which is the
    command's to report (exit 0), the state being Prefect's bookkeeping."""

    def __init__(self, message: str, completed: bool) -> None:
        super().__init__(message)
        self.completed = completed


def unusable_input_errors() -> tuple[type[BaseException], ...]:
    """What a verb raises for input it cannot use: a config, a path, a run id, a version."""
    from mlflow.exceptions import MlflowException

    from forgeline.model.checkpoint.manager import CheckpointError

    return ConfigError, ValueError, FileNotFoundError, FileExistsError, CheckpointError, MlflowException


def run_pipeline(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # checked before a flow run starts
    from forgeline.tasks.runner import preflight

    stages = pipeline_stages(cfg)
    preflight(cfg, stages)
    from forgeline.flows.pipeline import pipeline_flow

    parameters = dict(config=args.config, overrides=args.overrides, force=args.force)  # as typed
    result, _ = run_flow(pipeline_flow, parameters, stages, cfg)
    print(f"MLflow run: {result.run_id}")
    from forgeline.tasks.tracking import run_link, runs_link  # imported already: the flow ran here

    print(f"MLflow UI: {run_link(cfg, result.run_id)}")
    print(f"MLflow runs table, with the scores: {runs_link(cfg)}")
    print(f"Registered model: {result.model_name} version {result.model_version}")
    print(f"Promotion: {result.promotion}")
    from forgeline.flows.endings import score_lines

    print("\n".join(score_lines(result)))
    return 0


def rerun_stage(args: argparse.Namespace) -> int:
    stage = stage_named(args.name)
    cfg = load_config(args.config, args.overrides)  # checked before a flow run starts
    from forgeline.tasks.dvc_yaml import check_dvc_outputs

    check_dvc_outputs(cfg, str(args.config))  # under `dvc repro`: dvc.yaml names these directories
    if args.snapshot_only:
        return take_snapshot_only(stage, cfg)
    if args.base_only:
        return write_base_only(stage, cfg)
    from forgeline.tasks.runner import preflight, upstream_outputs

    if args.upstream_run:
        cfg = cfg.with_values(upstream_outputs(cfg, stage, args.upstream_run))
    preflight(cfg, (stage,), args.from_snapshot)
    from forgeline.flows.stage_flows import STAGE_FLOWS

    options = {"from_snapshot": True} if args.from_snapshot else {}
    # What the user typed (the flow applies the upstream run's outputs again, as a deployment's does).
    parameters = dict(config=args.config, overrides=args.overrides, upstream_run=args.upstream_run,
                      force=args.force, **options)
    result, ended = run_flow(STAGE_FLOWS[stage.name], parameters, (stage,), cfg)
    from forgeline.flows.endings import stage_lines

    # What it made, then its flow run's message: whether it ran or was cached, and its MLflow run.
    print("\n".join([*stage_lines(stage.name, result), *([ended] if ended else [])]))
    return 0


def run_flow(flow: Callable, parameters: dict[str, object], stages: tuple[Stage, ...] = (),
             cfg: Config | None = None) -> tuple[Any, str]:
    """`flow(**parameters)`'s result, and its final state's message. `stages`, those it runs on
    `cfg`: which of them finished, should the Prefect API go away before the flow run's end is
    reported."""
    from prefect.settings import PREFECT_API_URL

    from forgeline.flows import orchestrator

    orchestrator.quiet_api_errors()
    api_url = PREFECT_API_URL.value()
    orchestrator.check_api(api_url)
    if api_url and any(record.api_url == api_url for record in orchestrator.pending_records()):
        # This API missed how earlier runs ended: a rerun reports that first, as `forgeline sync` does.
        for line in orchestrator.replay_flow_states(api_url).lines:
            logging.getLogger(__name__).info("%s", line)
    started = time.time()
    try:
        state = flow(**parameters, return_state=True)
        return state.result(), state.message  # result() raises what the flow raised
    except Exception as err:
        record = orchestrator.unreported_record(started)
        if record is not None:
            raise StateNotReported(unreported_message(record, err, stages, cfg), record.completed) from err
        if isinstance(err, orchestrator.API_ERRORS):  # the flow run could not even start
            where = api_url or "Prefect's temporary local API"
            raise WorkFailed(f"{flow.name} did not run: the Prefect API at {where} is unreachable "
                             f"({type(err).__name__}: {err})") from err
        raise WorkFailed(f"{flow.name} failed: {type(err).__name__}: {err}") from err


def unreported_message(record: PendingStates, err: Exception, stages: tuple[Stage, ...],
                       cfg: Config | None) -> str:
    """What the work came to (the stage cache says which stages finished), and what becomes of
    the final state the API never got."""
    from forgeline.tasks.cache import decide

    def up_to_date(stage: Stage) -> bool:
        try:
            return decide(stage, cfg) is None
        except OSError:  # something it reads is gone (the data stage's snapshot): it would run
            return False

    finished = [stage.name for stage in stages if up_to_date(stage)]
    if record.completed and len(stages) == 1:
        outcome = f"{stages[0].name} finished: its outputs and stage record are written"
    elif record.completed:
        outcome = f"every stage finished ({', '.join(finished)})"
    else:
        left = [stage.name for stage in stages if stage.name not in finished]
        outcome = f"{record.flow_name} failed ({record.message})"
        if stages:
            outcome += (f"; finished: {', '.join(finished) or 'none'}, not finished: {', '.join(left)} (a "
                        "rerun skips the finished ones: the stage cache)")
    summary = f"; {record.message}" if record.completed and record.message else ""
    where = record.api_url or "Prefect's temporary local API"
    return (f"{outcome}{summary}. The Prefect API at {where} could not be told ({type(err).__name__}: "
            f"{err}): flow run {record.flow_run_id} ({record.flow_name}) stays Running there until "
            f"`forgeline sync`, or the next flow run from this directory, reports it "
            f"{record.state.capitalize()} once the API is back.")


def write_base_only(stage: Stage, cfg: Config) -> int:
    """The base stamp alone (dvc.yaml's always-changed base stage): resolves the base, hashes it."""
    if not stage.reads_base:
        raise ValueError(f"stage {stage.name} does not read the base; --base-only is for "
                         f"{', '.join(s.name for s in pipeline_stages(cfg) if s.reads_base)}")
    from forgeline.tasks.dvc_lock import write_base_stamp

    written = write_base_stamp(cfg)
    print(f"{BASE.name}: {BASE.path(cfg)} ({'written' if written else 'unchanged, not rewritten'})")
    return 0


def take_snapshot_only(stage: Stage, cfg: Config) -> int:
    """A stage's snapshot step alone: plain Python, quick enough to run on every `dvc repro`."""
    resolve(stage.snapshot.preflight)(cfg)
    snapshot = resolve(stage.snapshot.take)(cfg)
    print(f"{stage.snapshot.name}: {snapshot.documents} documents of {snapshot.sources} sources in "
          f"{snapshot.raw_dir} ({'written' if snapshot.written else 'unchanged, not rewritten'})")
    return 0


def show_status(args: argparse.Namespace) -> int:
    from forgeline.tasks.cache import decide

    cfg = load_config(args.config, args.overrides)
    decisions = {stage.name: decide(stage, cfg) for stage in pipeline_stages(cfg)}
    if args.json:
        print(json.dumps(decisions))
        return 0
    for name, reason in decisions.items():
        print(f"{name:<10} {'skipped: up to date' if reason is None else 'runs: ' + reason}")
    return 0


def show_stages(args: argparse.Namespace) -> int:
    from forgeline.flows.deploy import render_prefect_yaml
    from forgeline.tasks.dvc_yaml import render_dvc_yaml, render_stage_table, replace_stage_table

    if args.dvc:
        print(render_dvc_yaml(args.dvc), end="")
        return 0
    if not (args.write or args.check):
        print(render_stage_table(), end="")
        return 0
    root = Path(args.root)
    readme = (root / "README.md").read_text()
    wanted = {"dvc.yaml": render_dvc_yaml(), "prefect.yaml": render_prefect_yaml(),
              "README.md": replace_stage_table(readme, render_stage_table())}
    differing = [name for name, text in wanted.items()
                 if not (root / name).is_file() or (root / name).read_text() != text]
    if args.check:
        for name in differing:
            print(f"{root / name} differs from the stage records: run `forgeline stages --write`")
        return 1 if differing else 0
    for name in differing:
        (root / name).write_text(wanted[name])
        print(f"wrote {root / name}")
    return 0


def show_config(args: argparse.Namespace) -> int:
    if args.docs:
        print(config_docs())
    else:
        cfg = load_config(args.config, args.overrides)
        print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
    return 0


def plan_layout(args: argparse.Namespace) -> int:
    from forgeline.model.parallel.planner import Cluster, Workload, apply_plan, format_report, plan_run_config

    cfg = load_config(args.config, args.overrides)
    cluster = Cluster(args.accelerators_per_node, args.nodes, args.memory_gib, args.intra_node_gbps,
                      args.inter_node_gbps)
    workload = Workload(
        seq_len=args.seq_len or cfg.data.seq_len,
        global_batch_size=args.global_batch or cfg.train.global_batch_size,
        num_microbatches=args.microbatches or cfg.parallel.pp_microbatches,
        activation_checkpointing=args.activation_checkpoint or cfg.parallel.activation_checkpoint,
        zero_stage=args.zero_stage, max_pp=args.max_pp, checkpoint_window_s=args.save_window_s,
        mtbf_hours=args.mtbf_hours,
    )
    result = plan_run_config(cfg, cluster, workload, args.params)
    print(format_report(result))
    if args.write_config:
        planned, left_open = apply_plan(cfg, result)
        with open(args.write_config, "w") as f:
            if left_open:  # said in the file too: it outlives this console
                f.write(f"# {left_open}\n")
            yaml.safe_dump(planned, f, sort_keys=False)
        then = f"{left_open}, then run" if left_open else "run"
        print(f"wrote {args.write_config}: {then} it with `forgeline run --config {args.write_config}`")
    return 0


def clean_outputs(args: argparse.Namespace) -> int:
    from forgeline.tasks.clean import clean

    for path in clean(args.paths, args.outside_artifacts):
        print(f"removed {path}")
    return 0


def manage_checkpoints(args: argparse.Namespace) -> int:
    from forgeline.model.training.outputs import TrainOutputs
    from forgeline.tasks.train import versions

    cfg = load_config(args.config, args.overrides)
    root = Path(args.dir) if args.dir else TrainOutputs(Path(cfg.train.out_dir)).checkpoints
    if args.checkpoints_verb == "list":
        rows = versions.list_checkpoints(root)
        if not rows:
            print(f"no committed checkpoints in {root}")
        for row in rows:
            print(f"step {row.step:>8}  loss {row.loss:7.4f}  tokens {row.tokens_seen:>12,}  "
                  f"{row.layout:<28} {row.created}  {row.size_mb:8.1f} MB  {row.path}")
        return 0
    if args.checkpoints_verb == "verify":
        results = versions.verify(root, args.step)
        for step, problems in results.items():
            print(f"step {step:>8}  {'ok' if not problems else 'CORRUPT: ' + '; '.join(problems)}")
        return 1 if any(results.values()) else 0
    if args.checkpoints_verb == "rollback":
        archive = versions.rollback(root, args.step, cfg.checkpoint.persistent_url)
        print(f"step {args.step} is the latest checkpoint; newer versions, if any, are kept in {archive}. "
              "The next `forgeline stage train` (or run) resumes from it.")
        return 0
    tokenizer = Path(cfg.data.out_dir) / "tokenizer"
    out = versions.export(root, args.step, tokenizer, Path(args.out), args.format)
    print(f"exported step {args.step} to {out}")
    return 0


def registry_client(args: argparse.Namespace):
    from mlflow import MlflowClient

    from forgeline.tasks.tracking import resolve_tracking_uri

    cfg = load_config(args.config, args.overrides)
    return cfg, MlflowClient(resolve_tracking_uri(cfg), resolve_tracking_uri(cfg))


def promote_version(args: argparse.Namespace) -> int:
    from forgeline.tasks.promote import promote
    from forgeline.tasks.register import CANDIDATE_ALIAS

    cfg, client = registry_client(args)
    version = args.version or client.get_model_version_by_alias(cfg.registry.model_name,
                                                                 CANDIDATE_ALIAS).version
    decision = promote(cfg, client, str(version), force=args.force)
    print(decision.describe())
    return 0 if decision.promoted else 1


def compare_runs(args: argparse.Namespace) -> int:
    from forgeline.tasks.compare import compare_runs, format_comparison, paired_against_first

    _, client = registry_client(args)
    print(format_comparison(compare_runs(client, args.run_ids), args.diff_only))
    if len(args.run_ids) > 1:
        print()
        print(paired_against_first(client, args.run_ids))
    return 0


def reproduce_run(args: argparse.Namespace) -> int:
    from forgeline.tasks.reproduce import check_code_version, compare, output_overrides, recorded_run
    from forgeline.tasks.tracking import dvc_hash

    cfg, client = registry_client(args)
    recorded = recorded_run(client, args.run_id)
    check_code_version(recorded)
    root = Path(args.out or Path("reproduce") / args.run_id).resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(recorded.config_yaml)
    overrides = output_overrides(root, load_config(root / "config.yaml"))
    # The store the user named: a config's URI (configs refuse credentials) as an override; one
    # from $MLFLOW_TRACKING_URI, which may hold a password, stays in the environment the flow
    # reads, never in a flow parameter that Prefect stores and shows.
    tracking = [f"registry.tracking_uri={cfg.registry.tracking_uri or 'null'}"]
    from forgeline.flows.pipeline import reproduce_flow

    parameters = dict(config=str(root / "config.yaml"), overrides=[*overrides, *tracking],
                      reproduces=args.run_id)
    (run_id, scores), _ = run_flow(reproduce_flow, parameters)
    checks = compare(recorded, dvc_hash(root / "data"), scores, args.tolerance)
    print(f"reproduced run {args.run_id} as {run_id} (outputs in {root}):")
    for check in checks:
        print(f"  {'same' if check.matches else 'DIFFERS':<7} {check.name}: recorded {check.recorded}, "
              f"reproduced {check.reproduced}")
    return 0 if all(check.matches for check in checks) else 1


def deploy_flows(args: argparse.Namespace) -> int:
    from forgeline.flows.deploy import deploy

    print(deploy(Path(args.prefect_file), Path(args.workdir), args.pool), end="")
    return 0


def sync_pending(args: argparse.Namespace) -> int:
    """The tracking spool, then the flow states: each says what it sent and what is left."""
    from forgeline.flows.orchestrator import replay_flow_states
    from forgeline.tasks.tracking import sync_tracking

    cfg = load_config(args.config, args.overrides)
    left = 0
    for lines, pending in (sync_tracking(cfg), replay_flow_states()):
        print("\n".join(lines))
        left += pending
    return 1 if left else 0


def generate_text(args: argparse.Namespace) -> int:
    from forgeline.flows.chat import generate, generate_file, load_talker, read_prompts, sampling

    talker = load_talker(load_config(args.config, args.overrides), args.model)
    settings = sampling(talker, args.temperature, args.top_p, args.max_new_tokens, args.seed)
    if args.prompts_file:
        generate_file(talker, settings, read_prompts(args.prompts_file), sys.stdout, args.batch_size)
    else:
        generate(talker, settings, args.prompt, sys.stdout)
    return 0


def chat_with_model(args: argparse.Namespace) -> int:
    from forgeline.flows.chat import chat, load_talker, sampling, user_lines

    talker = load_talker(load_config(args.config, args.overrides), args.model)
    chat(talker, sampling(talker, args.temperature, args.top_p, args.max_new_tokens, args.seed),
         user_lines(), sys.stdout, args.system)
    return 0


def run_lm_eval(lm_eval_args: list[str]) -> int:
    """lm-eval 0.4 has no plugin entry point for model classes: register ours, then hand its
    command line every argument. Offline by default like the rest of forgeline; the eval stage's
    rendered suite is at <eval.out_dir>/tasks (pass it with --include_path)."""
    from lm_eval.__main__ import cli_evaluate

    import forgeline.eval.lm  # noqa: F401  (registers the `forgeline` model class)

    sys.argv = ["lm-eval", *lm_eval_args]
    cli_evaluate()
    return 0


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run_pipeline, "stage": rerun_stage, "status": show_status, "stages": show_stages,
    "config": show_config,
    "plan": plan_layout, "checkpoints": manage_checkpoints, "clean": clean_outputs,
    "promote": promote_version,
    "compare": compare_runs, "reproduce": reproduce_run, "deploy": deploy_flows, "sync": sync_pending,
    "generate": generate_text, "chat": chat_with_model,
}


if __name__ == "__main__":
    sys.exit(main())
