"""Prefect flows: the pipeline (flows/pipeline.py), one flow per stage (flows/stages.py) and
the `forgeline` command line (flows/cli.py)."""

from forgeline.tasks.runtime import apply_env_defaults

apply_env_defaults()  # before anything imports Prefect
