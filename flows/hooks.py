"""What every forgeline flow shares: its config parameter, the Prefect lineage it records in
MLflow and the hook that reports a failed flow run to the notification block named in its
config."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import httpx
from prefect import Flow
from prefect.artifacts import create_link_artifact
from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State
from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from forgeline.configs import Config, ConfigError, load_config
from forgeline.configs.redaction import install_log_scrubber, scrub
from forgeline.tasks.tracking import config_label, git_info, layout_label, run_link

log = logging.getLogger(__name__)


def flow_config(config: str | None, overrides: list[str] | None) -> Config:
    """A flow's `config` parameter, a path or a shipped name, read with `overrides`: what the user
    typed, as Prefect shows it (the CLI's flow runs too: the config they resolve to is each MLflow
    run's `config.yaml`)."""
    forgeline_logs_to_prefect()
    install_log_scrubber()  # Prefect's handlers exist now; our code logs nothing in this run before it
    return load_config(config, overrides or [])


FORGELINE_LOGGER = "forgeline"


def forgeline_logs_to_prefect() -> None:
    """forgeline's records, INFO and above, to the flow run's logs in Prefect (its API handler),
    whoever started the process: the CLI, or a worker (`python -m prefect.engine`). Called as a
    flow run starts, not left to PREFECT_LOGGING_EXTRA_LOGGERS, which misses a worker's flow run
    twice: Prefect reads the variable once, when its first import configures logging -- in a
    worker's process that is before any forgeline code runs -- and a logger it lists keeps the
    root's level, which Prefect's logging.yml sets to WARNING (only the CLI sets INFO). A level
    set on the `forgeline` logger already (a logging config of the user's) is kept. Idempotent."""
    logger = logging.getLogger(FORGELINE_LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    for handler in logging.getLogger("prefect.extra").handlers:  # Prefect's API handler, as its config has it
        if handler not in logger.handlers:
            logger.addHandler(handler)


def prefect_tags() -> dict[str, str]:
    """MLflow tags that lead from a run back to the Prefect flow run that made it."""
    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": flow_run.name}
    if PREFECT_UI_URL.value():  # none for a temporary API
        tags["prefect.flow_run_url"] = flow_run.ui_url
    if flow_run.parent_deployment_id:
        tags["prefect.deployment_id"] = str(flow_run.parent_deployment_id)
    return tags


def run_labels(cfg: Config, stages: Iterable[str], with_layout: bool) -> list[str]:
    """Prefect tags that tell runs apart in its lists and filters: `stage:train`, `config:tiny`
    (the config's label, as in the MLflow run names), `model:forgeline-tiny`, `layout:pp2xdp2`
    (with_layout: for runs that train), `commit:1a2b3c4` (`-dirty` with uncommitted changes)."""
    code = git_info()
    commit = code["git.commit"][:7] + ("-dirty" if code["git.dirty"] == "true" else "")
    tags = [*(f"stage:{stage}" for stage in stages), f"config:{config_label(cfg)}",
            f"model:{cfg.registry.model_name}"]
    if with_layout:
        tags.append(f"layout:{layout_label(cfg)}")
    return [*tags, f"commit:{commit}"]


def mlflow_link(cfg: Config, run_id: str) -> str:
    """`MLflow run <id>: <its page in MLflow's UI>`, for a flow run's final message: a state's
    message is no log record, which the scrubbing filter would mask, so the store's URI is masked
    here."""
    return scrub(f"MLflow run {run_id}: {run_link(cfg, run_id)}")


def label_flow_run(name: str, tags: list[str], cfg: Config, mlflow_run_id: str) -> None:
    """The running flow run renamed `name` (its MLflow run's name, `pipeline tiny dp1 @1a2b3c4`, in
    place of Prefect's random one), given `tags` and `mlflow:<run id>`, beside the tags it has
    (a deployment's), and linked to its MLflow run's page (link_mlflow_run). An API that does not
    take it costs a warning, not the run."""
    from forgeline.flows.orchestrator import API_ERRORS

    wanted = [*tags, f"mlflow:{mlflow_run_id}"]
    try:
        with get_client(sync_client=True) as client:
            added = [tag for tag in wanted if tag not in flow_run.tags]
            client.update_flow_run(flow_run.id, name=name, tags=[*flow_run.tags, *added])
    except API_ERRORS as err:
        log.warning("flow run %s keeps its name and tags: the Prefect API did not take %r (%s: %s)",
                    flow_run.name, name, type(err).__name__, err)
    try:
        link_mlflow_run(cfg, mlflow_run_id)
    except API_ERRORS as err:
        log.warning("flow run %s has no link to MLflow run %s: the Prefect API did not take it (%s: %s)",
                    flow_run.name, mlflow_run_id, type(err).__name__, err)


def link_mlflow_run(cfg: Config, mlflow_run_id: str) -> None:
    """A link artifact of the flow run to its MLflow run's page in the training view, made as the
    run starts: a running or failed flow run has it too, a click away in the Artifacts tab. A store
    that is no server is read through `mlflow ui`, which the description says; a store that does
    not answer now gets no link (the final message says so)."""
    page, _, note = scrub(run_link(cfg, mlflow_run_id)).partition(" ")
    if not page.startswith(("http://", "https://")):
        return
    create_link_artifact(link=page, link_text=f"MLflow run {mlflow_run_id}",
                         key=f"{flow_run.flow_name}-mlflow-{mlflow_run_id}",
                         description=" ".join(["The flow run's MLflow run", *([note] if note else [])]))


def notify_failure(flow: Flow, run: FlowRun, state: State) -> None:
    """on_failure hook: post the failure to `ops.notify_block` of the run's config, if set."""
    try:
        cfg = flow_config(run.parameters.get("config"), run.parameters.get("overrides"))
    except ConfigError:
        return  # the run failed on its config; there is no block name to read
    if not cfg.ops.notify_block:
        return
    # Bounded by the Prefect client's timeouts and retries (configs/environment.py) and the block's
    # own HTTP timeout; an API that went away since the failure was reported costs one warning.
    try:
        block = Block.load(cfg.ops.notify_block)
        block.notify(subject=f"forgeline: {flow.name} run {run.name} failed",
                     body=f"Flow run {run.name} ({run.id}) of {flow.name} ended {state.type.value}: "
                          f"{scrub(state.message or 'no message')}")
    except httpx.HTTPError as err:
        log.warning("could not report the failure of %s to %s: %s: %s", run.name, cfg.ops.notify_block,
                    type(err).__name__, err)
        return
    log.info("reported the failure of %s to %s", run.name, cfg.ops.notify_block)
