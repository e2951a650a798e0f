"""The Kubernetes work pool's base job template (deploy/kubernetes-job-template.json), rendered as
Prefect's kubernetes worker fills it (flows/kubernetes.py) and checked offline against the
Kubernetes API's schemas (kubernetes-validate bundles them); its pods' shell commands run here
under /bin/sh with stand-ins for the commands they start."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
from prefect.server.schemas.actions import validate_base_job_template

from forgeline.configs import Config, load_config
from forgeline.flows.kubernetes import (
    TERMINATION_MARGIN_S,
    flow_parameters,
    job_variables,
    load_template,
    main,
    multinode_overrides,
    render_job,
    render_service,
)

# The oldest Kubernetes the manifests rely on (the pod label batch.kubernetes.io/job-name, 1.27;
# Indexed Jobs, 1.24) and the newest whose schemas the pinned kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.27", "1.37")
VALUES = {"nnodes": 2, "job_name": "forgeline-train", "namespace": "ml",
          "image": "registry.example/forgeline:1"}


@pytest.fixture(scope="module")
def template() -> dict:
    return load_template()


@pytest.fixture(scope="module")
def cfg(template: dict) -> Config:
    """The flow run's config of a two-pod job: the deployment's config and overrides."""
    parameters = flow_parameters(template, VALUES)
    return load_config(parameters["config"], parameters["overrides"])


def pod_env(job: dict, index: int) -> dict[str, str]:
    """The container's environment as the kubelet sets it for pod `index` of the job."""
    env = {"PATH": os.environ["PATH"], "JOB_COMPLETION_INDEX": str(index)}  # set by the Job controller
    for item in job["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            label = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert label == "metadata.labels['batch.kubernetes.io/job-name']", label
            env[item["name"]] = job["metadata"]["name"]
    return env


def test_prefect_accepts_the_template_and_its_defaults(template: dict) -> None:
    """What the Prefect server checks when the pool is created: every placeholder is a variable."""
    validate_base_job_template(template)
    job = render_job(template, load_config("tiny.yaml"))
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1  # any flow of the pool
    assert "name" not in job["metadata"] and job["metadata"]["generateName"] == "prefect-job-"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_a_two_pod_job_and_its_service_are_valid_kubernetes(template: dict, cfg: Config,
                                                            version: str) -> None:
    job, service = render_job(template, cfg, VALUES), render_service(template, cfg, VALUES)
    for manifest in (job, service):
        kubernetes_validate.validate(manifest, version, strict=True)  # strict: unknown fields too
    single = render_job(template, load_config("tiny.yaml"))
    kubernetes_validate.validate(single, version, strict=True)


def test_a_two_pod_job_runs_the_config_on_both_pods_and_meets_at_pod_0(template: dict, cfg: Config) -> None:
    job, service = render_job(template, cfg, VALUES), render_service(template, cfg, VALUES)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == cfg.parallel.nnodes == 2
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] == 0  # a lost pod fails the job
    assert container["image"] == VALUES["image"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == cfg.parallel.nproc_per_node
    env = pod_env(job, 1)
    assert env["FORGELINE_CONFIG"] == flow_parameters(template, VALUES)["config"] == "tiny.yaml"
    assert env["JOB_NAME"] == job["metadata"]["name"] == VALUES["job_name"]

    # The rendezvous is pod 0 by its DNS name: the Job controller names pod i's host <job>-<i>,
    # and the Service named by the pods' subdomain, headless, selects the job's pods.
    host, port = cfg.parallel.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}.{VALUES['namespace']}.svc.cluster.local"
    assert service["metadata"]["name"] == pod["subdomain"]
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"] == VALUES["namespace"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]


@pytest.mark.parametrize("index", [0, 1])
def test_each_pods_command_is_its_pid_1_and_gets_the_sigterm(template: dict, cfg: Config, tmp_path: Path,
                                                             index: int) -> None:
    """A Kubernetes eviction sends SIGTERM to the container's PID 1 only: the shell must exec the
    flow run (pod 0) or `forgeline stage train` (the others), not wait for it. And the extra pods'
    config is the flow run's, so that their rendezvous ids -- hashes of the configs -- agree."""
    job = render_job(template, cfg, VALUES)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "forgeline"):  # stand-ins: report their pid and arguments, end on SIGTERM
        (bin_dir / name).write_text('#!/bin/sh\ntrap \'echo "got SIGTERM"; exit 0\' TERM\necho "$$ $*"\n'
                                    'while :; do sleep 0.05; done\n')
        (bin_dir / name).chmod(0o755)
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = pod_env(job, index) | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.Popen([*container["command"], *container["args"]], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pid, *argv = shlex.split(proc.stdout.readline())
        assert int(pid) == proc.pid, "the command is not the container's main process: no exec"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "got SIGTERM"
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
    if index == 0:
        assert argv == ["-m", "prefect.engine"]  # the flow run, its id in PREFECT__FLOW_RUN_ID
        return
    assert argv[:4] == ["stage", "train", "--config", env["FORGELINE_CONFIG"]]
    sets = argv[4:]
    assert sets[::2] == ["--set"] * (len(sets) // 2)
    extra = load_config(argv[3], sets[1::2])
    assert sets[1::2] == multinode_overrides(template, VALUES)
    assert extra.content_hash() == cfg.content_hash()


def test_an_extra_pod_of_a_job_without_a_fixed_name_stops_at_once(template: dict, cfg: Config) -> None:
    job = render_job(template, cfg, VALUES)
    job["metadata"]["name"] = "forgeline-train-x7k2p"  # as if generated: the flow run meets elsewhere
    container = job["spec"]["template"]["spec"]["containers"][0]
    done = subprocess.run([*container["command"], *container["args"]], env=pod_env(job, 1),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "needs the job_name job variable" in done.stderr


def test_the_grace_period_covers_the_ranks_save_and_the_report(template: dict) -> None:
    parameters = flow_parameters(template, VALUES)
    for grace in (120, 600):
        overrides = [*parameters["overrides"], f"train.preemption_grace_s={grace}"]
        cfg = load_config(parameters["config"], overrides)
        pod = render_job(template, cfg, VALUES)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace + TERMINATION_MARGIN_S
    assert TERMINATION_MARGIN_S >= 30  # the launcher's 15 s over the ranks' grace, then the flow's report
    assert template["variables"]["properties"]["termination_grace_period_seconds"]["default"] == 120 + 30
    longer = render_job(template, cfg, VALUES | {"termination_grace_period_seconds": 900})
    assert longer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 900
    with pytest.raises(ValueError, match="at least 630"):
        job_variables(template, cfg, VALUES | {"termination_grace_period_seconds": 300})


def test_values_that_contradict_the_config_are_refused(template: dict, cfg: Config) -> None:
    with pytest.raises(ValueError, match="parallel.nnodes=2"):
        job_variables(template, cfg, VALUES | {"nnodes": 3})
    with pytest.raises(ValueError, match="needs the job_name job variable"):
        job_variables(template, cfg, {k: v for k, v in VALUES.items() if k != "job_name"})
    with pytest.raises(ValueError, match="meet at 'other-0.forgeline-train.ml.svc.cluster.local:29400'"):
        job_variables(template, cfg, VALUES | {"job_name": "other"})
    with pytest.raises(ValueError, match="gpus_per_pod=4"):
        job_variables(template, cfg, VALUES | {"gpus_per_pod": 4})
    assert job_variables(template, cfg, VALUES | {"gpus_per_pod": 0})["gpus_per_pod"] == 0  # CPU ranks
    with pytest.raises(ValueError, match="no Service"):
        render_service(template, load_config("tiny.yaml"))
    with pytest.raises(ValueError, match="image_pull_policy"):  # the variables schema, as Prefect checks it
        job_variables(template, cfg, VALUES | {"image_pull_policy": "Sometimes"})


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_schema_check_can_fail(template: dict, cfg: Config, version: str) -> None:
    job = render_job(template, cfg, VALUES)
    job["spec"]["completions"] = "2"  # a quoted placeholder value: the string, not the number
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'") as err:
        kubernetes_validate.validate(job, version, strict=True)
    assert list(err.value.path) == ["spec", "completions"]
    misspelled = render_job(template, cfg, VALUES)
    pod = misspelled["spec"]["template"]["spec"]
    pod["subdomian"] = pod.pop("subdomain")
    with pytest.raises(kubernetes_validate.ValidationError, match="'subdomian' was unexpected"):
        kubernetes_validate.validate(misspelled, version, strict=True)


def test_the_command_line_prints_what_the_deployment_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--var", "nnodes=2", "--var", "job_name=forgeline-train", "parameters"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "config": "tiny.yaml",
        "overrides": ["parallel.nnodes=2",
                      "parallel.rdzv_endpoint=forgeline-train-0.forgeline-train.default.svc.cluster.local:29400"]}
    assert main(["--var", "nnodes=2", "--var", "job_name=forgeline-train", "variables"]) == 0
    variables = json.loads(capsys.readouterr().out)
    assert variables == {"nnodes": 2, "gpus_per_pod": 2, "job_name": "forgeline-train"}
    with pytest.raises(SystemExit) as stopped:
        main(["--var", "nnodes=2", "service"])
    assert stopped.value.code == 2 and "needs the job_name job variable" in capsys.readouterr().err
