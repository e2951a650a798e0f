"""Prefect: the pipeline flow and the reproduction flow (`pipeline.py`), the stage tasks and one
flow per stage made from the stage records (`stage_flows.py`), what every flow shares
(`hooks.py`), the deployments (`deploy.py`), the Kubernetes job template's rendering
(`kubernetes.py`) and the `forgeline` command line (`cli.py`).

The top layer: imports configs, model, eval and tasks; nothing imports it.
"""
