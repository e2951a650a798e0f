"""Stage logic: plain functions per stage (data, train, evaluate, register), callable without
Prefect, and their thin Prefect task wrappers (prefect_tasks.py)."""

from forgeline.tasks.runtime import apply_env_defaults

apply_env_defaults()

STAGES = ("data", "train", "eval", "register")  # in the order they run
