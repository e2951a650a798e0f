"""`forgeline`: run the pipeline, one stage, or inspect a config.

    forgeline run [--config PATH] [--set section.key=value ...]
    forgeline stage {data,train,eval,register} [--config PATH] [--set ...]
    forgeline config show [--config PATH] [--set ...] [--docs]
"""

from __future__ import annotations

import argparse
import logging
import sys

import yaml

from forgeline.configs import ConfigError, load_config
from forgeline.configs.loader import config_docs

STAGE_NAMES = ("data", "train", "eval", "register")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH",
                        help="run config YAML, or the name of a shipped one (default: tiny.yaml)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                        default=[], help="override one config value (repeatable), e.g. "
                                         "--set train.steps=50 --set parallel.dp=2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forgeline",
        description="Corpus to a registered, evaluated model: data -> train -> eval -> register, "
                    "orchestrated by Prefect, tracked in MLflow, versioned with DVC.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    run = verbs.add_parser("run", help="run the whole pipeline as a Prefect flow",
                           description="Run data -> train -> eval -> register as the "
                                       "forgeline-pipeline Prefect flow under one MLflow parent "
                                       "run; prints the run id and the registered model version.")
    add_config_arguments(run)

    stage = verbs.add_parser("stage", help="run one stage as its own Prefect flow",
                             description="Run one stage; it reads its inputs from the upstream "
                                         "stages' output directories named in the config.")
    stage.add_argument("name", choices=STAGE_NAMES, help="the stage to run")
    add_config_arguments(stage)

    config = verbs.add_parser("config", help="inspect and validate run configs",
                              description="Inspect and validate run configs.")
    config_verbs = config.add_subparsers(dest="config_verb", required=True, metavar="ACTION")
    show = config_verbs.add_parser("show", help="print the resolved config (or --docs)",
                                   description="Validate a config with its overrides and print "
                                               "the resolved YAML.")
    add_config_arguments(show)
    show.add_argument("--docs", action="store_true",
                      help="print every section and field with its default and meaning instead")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call
    try:
        if args.verb == "config":
            return show_config(args)
        cfg_source = (args.config, args.overrides)
        cfg = load_config(*cfg_source)  # fail on bad input before Prefect starts
        if args.verb == "stage":
            from forgeline.tasks.stages import check_stage_inputs

            check_stage_inputs(args.name, cfg)
    except (ConfigError, FileNotFoundError) as err:
        print(f"forgeline: {err}", file=sys.stderr)
        return 2
    if args.verb == "run":
        return run_pipeline(*cfg_source)
    return run_stage(args.name, *cfg_source)


def show_config(args: argparse.Namespace) -> int:
    if args.docs:
        print(config_docs())
    else:
        cfg = load_config(args.config, args.overrides)
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def run_pipeline(config: str | None, overrides: list[str]) -> int:
    from forgeline.flows.pipeline import pipeline_flow

    result = pipeline_flow(config=config, overrides=overrides)
    print(f"MLflow run: {result.run_id}")
    print(f"Registered model: {result.model_name} version {result.model_version}")
    for name, value in sorted(result.metrics.items()):
        print(f"  {name}: {value:.4f}")
    return 0


def run_stage(name: str, config: str | None, overrides: list[str]) -> int:
    from forgeline.flows.stages import STAGE_FLOWS

    result = STAGE_FLOWS[name](config=config, overrides=overrides)
    print(f"{name}: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
