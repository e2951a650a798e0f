"""What every forgeline flow shares: its config parameter, the Prefect lineage it records in
MLflow and the hook that reports a failed flow run to the notification block named in its
config."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from prefect import Flow
from prefect.blocks.core import Block
from prefect.client.schemas.objects import FlowRun, State
from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from forgeline.configs import Config, ConfigError, load_config
from forgeline.configs.redaction import install_log_scrubber, scrub

log = logging.getLogger(__name__)


def flow_config(config: Config | dict[str, Any] | str | None, overrides: list[str] | None) -> Config:
    """A flow's `config` parameter as a Config: a path or shipped name read with `overrides`
    (deployments, the default), or a config resolved by the caller (the CLI, which has read and
    checked it before starting Prefect; Prefect stores it as a dict)."""
    install_log_scrubber()  # Prefect's handlers exist now; our code logs nothing in this run before it
    if isinstance(config, Config | dict):
        if overrides:
            raise ConfigError("overrides go with a config path; apply them to a resolved config before")
        return Config.model_validate(config)
    return load_config(config, overrides or [])


def prefect_tags() -> dict[str, str]:
    """MLflow tags that lead from a run back to the Prefect flow run that made it."""
    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": flow_run.name}
    if PREFECT_UI_URL.value():  # none for a temporary API
        tags["prefect.flow_run_url"] = flow_run.ui_url
    if flow_run.parent_deployment_id:
        tags["prefect.deployment_id"] = str(flow_run.parent_deployment_id)
    return tags


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
