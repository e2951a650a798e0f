"""Kubernetes: the Job that Prefect's kubernetes worker makes from the work pool's base job
template (deploy/kubernetes-job-template.json) for a forgeline config, the headless Service its
pods' rendezvous needs, and the job variables and flow-run parameters that go with them.

The placeholders are filled by Prefect's own templating (`apply_values`, over the template's
variable defaults and the given values), as the worker fills them; of what the worker then adds
per flow run (prefect-kubernetes' `prepare_for_flow_run`) the `env` and `labels` variables are
applied -- the env entries before the template's own, the labels onto the pods too -- and Prefect's
settings, the flow run's id and its own labels are left out.

    python -m forgeline.flows.kubernetes --var nnodes=2 --var job_name=forgeline-train variables
    python -m forgeline.flows.kubernetes --var nnodes=2 --var job_name=forgeline-train service \\
        | kubectl apply -f -

`variables` and `parameters` print what the deployment needs (`job_variables`; `parameters`:
config and overrides), `service` the headless Service, `job` the Job the worker would submit.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from prefect.utilities.schema_tools import ValidationError, validate
from prefect.utilities.templating import apply_values, find_placeholders
from prefect.workers.base import BaseJobConfiguration

from forgeline.configs import Config, load_config

TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes-job-template.json"

# terminationGracePeriodSeconds over train.preemption_grace_s. On SIGTERM the flow's launcher gives
# torchrun the ranks' grace plus 15 s before it kills what is left (tasks/train/job.py), and the
# flow run then reports its end to Prefect and MLflow (their clients' timeouts bound it): 15 s more.
TERMINATION_MARGIN_S = 30

# Where every pod's torchrun meets: pod 0, by the DNS name the headless Service gives it. The
# full name: pod 0 finds it in its own /etc/hosts, so torchrun there knows at once that it hosts
# the rendezvous, before the cluster's DNS has the record.
RENDEZVOUS = ("{{ job_name }}-0.{{ headless_service }}.{{ namespace }}.svc.{{ cluster_domain }}"
              ":{{ rdzv_port }}")

# The headless Service named by the pods' `subdomain`: DNS names for the pods of the job, so that
# every torchrun reaches pod 0's rendezvous and the ranks reach the master address the rendezvous
# hands out (the fully qualified name of whichever pod became node 0). Not-ready pods are
# published too: the names are needed as the pods start.
HEADLESS_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "{{ headless_service }}", "namespace": "{{ namespace }}",
                 "labels": {"app.kubernetes.io/part-of": "forgeline"}},
    "spec": {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": {"batch.kubernetes.io/job-name": "{{ job_name }}"},
        "ports": [{"name": "rendezvous", "port": "{{ rdzv_port }}", "targetPort": "{{ rdzv_port }}"}],
    },
}


def load_template(path: str | Path | None = None) -> dict[str, Any]:
    """The base job template (default: this checkout's deploy/kubernetes-job-template.json)."""
    return json.loads(Path(path or TEMPLATE_PATH).read_text())


def template_defaults(template: Mapping[str, Any]) -> dict[str, Any]:
    """The variables' defaults, as the worker takes them (a null default is no default)."""
    return BaseJobConfiguration._get_base_config_defaults(template["variables"].get("properties", {}))


def rendezvous_endpoint(template: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    """host:port of the c10d rendezvous of a job of several pods: pod 0's DNS name."""
    variables = template_defaults(template) | dict(values)
    if not variables.get("job_name"):
        raise ValueError("a job of several pods needs the job_name job variable: its pods' rendezvous "
                         "is <job_name>-0.<headless_service>, and the Service selects the job by it")
    return apply_values(RENDEZVOUS, variables)


def multinode_overrides(template: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    """The overrides of every pod's config, the flow run's and the extra pods': none on one pod."""
    nnodes = (template_defaults(template) | dict(values))["nnodes"]
    if nnodes == 1:
        return []
    return [f"parallel.nnodes={nnodes}", f"parallel.rdzv_endpoint={rendezvous_endpoint(template, values)}"]


def flow_parameters(template: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The flow run's `config` and `overrides`: those the extra pods train with, and nothing else
    (any other change goes into the config file), so that every pod's config -- and so its
    rendezvous id, a hash of it -- is the same."""
    variables = template_defaults(template) | dict(values)
    return {"config": variables["forgeline_config"], "overrides": multinode_overrides(template, values)}


def job_variables(template: Mapping[str, Any], cfg: Config, values: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """Every variable of a job for `cfg`: the template's defaults, `values` over them, and what the
    config decides -- the pods (parallel.nnodes), the GPUs of each (its ranks; 0 for CPU ranks) and
    the grace period (train.preemption_grace_s + TERMINATION_MARGIN_S, or more); a value given
    that contradicts the config is an error. Checked against the template's variables schema as
    Prefect checks a deployment's job variables."""
    values = dict(values or {})
    par = cfg.parallel
    if par.launcher != "torchrun":
        raise ValueError(f"parallel.launcher={par.launcher!r}: a Kubernetes job starts its ranks with "
                         "torchrun")
    if values.get("nnodes", par.nnodes) != par.nnodes:
        raise ValueError(f"nnodes={values['nnodes']} but the config has parallel.nnodes={par.nnodes}")
    gpus = values.get("gpus_per_pod", par.nproc_per_node)
    if gpus not in (0, par.nproc_per_node):
        raise ValueError(f"gpus_per_pod={gpus}: each pod runs {par.nproc_per_node} ranks, one per GPU "
                         "(or 0 for ranks on CPUs)")
    grace = cfg.train.preemption_grace_s + TERMINATION_MARGIN_S
    given = values.get("termination_grace_period_seconds", grace)
    if given < grace:
        raise ValueError(f"termination_grace_period_seconds={given} leaves the ranks less than "
                         f"train.preemption_grace_s={cfg.train.preemption_grace_s} "
                         f"(+{TERMINATION_MARGIN_S} s for the launcher and the flow run's report): at least "
                         f"{grace}")
    variables = template_defaults(template) | values | {
        "nnodes": par.nnodes, "gpus_per_pod": gpus, "termination_grace_period_seconds": given}
    if par.nnodes > 1:
        endpoint = rendezvous_endpoint(template, variables)
        if par.rdzv_endpoint != endpoint:
            raise ValueError(f"parallel.rdzv_endpoint={par.rdzv_endpoint!r}, but this job's pods meet at "
                             f"{endpoint!r}: run the flow with --set parallel.rdzv_endpoint={endpoint}")
    try:
        validate(variables, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)
    except ValidationError as err:
        raise ValueError(f"job variables: {err}") from None
    return variables


def render_job(template: Mapping[str, Any], cfg: Config, values: Mapping[str, Any] | None = None,
               flow_run_name: str = "prefect-job") -> dict[str, Any]:
    """The Job manifest the worker submits for `cfg` (see the module's docstring)."""
    variables = job_variables(template, cfg, values)
    manifest = _filled(template["job_configuration"], variables)["job_manifest"]
    pod = manifest["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {str(k): str(v) for k, v in variables.get("env", {}).items()}
    container["env"] = [{"name": k, "value": v} for k, v in env.items()] + [
        item for item in container.get("env", []) if item["name"] not in env]
    labels = manifest["metadata"].setdefault("labels", {})
    pod.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    if manifest["metadata"].get("generateName") in (None, "-"):
        manifest["metadata"]["generateName"] = f"{flow_run_name}-"
    return manifest


def render_service(template: Mapping[str, Any], cfg: Config, values: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The headless Service of a job of several pods; create it once, before the first such job."""
    variables = job_variables(template, cfg, values)
    if variables["nnodes"] == 1:
        raise ValueError("a job of one pod has no rendezvous to name: it needs no Service")
    return _filled(HEADLESS_SERVICE, variables)


def _filled(template: Any, variables: Mapping[str, Any]) -> Any:
    filled = apply_values(copy.deepcopy(template), dict(variables))
    if left := find_placeholders(filled):
        # {{ prefect.blocks... }} and {{ prefect.variables... }} are read from the Prefect API
        raise ValueError(f"placeholders left unfilled: {sorted(p.full_match for p in left)}")
    return filled


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forgeline.flows.kubernetes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("variables", "parameters", "service", "job"))
    parser.add_argument("--template", type=Path, default=TEMPLATE_PATH)
    parser.add_argument("--var", action="append", default=[], metavar="KEY=VALUE",
                        help="a job variable (the value is read as YAML), e.g. nnodes=2; repeatable")
    args = parser.parse_args(argv)
    template = load_template(args.template)
    values = {}
    for item in args.var:
        key, sep, text = item.partition("=")
        if not sep:
            parser.error(f"--var {item!r}: KEY=VALUE")
        values[key] = yaml.safe_load(text)
    try:
        parameters = flow_parameters(template, values)
        cfg = load_config(parameters["config"], parameters["overrides"])
        if args.what == "variables":
            defaults = template_defaults(template)
            out: Any = {k: v for k, v in job_variables(template, cfg, values).items() if defaults.get(k) != v}
        elif args.what == "parameters":
            out = parameters
        elif args.what == "service":
            out = render_service(template, cfg, values)
        else:
            out = render_job(template, cfg, values)
    except ValueError as err:  # ConfigError too
        parser.exit(2, f"error: {err}\n")
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
