"""The stages: each defined once by a record (`stage.py`), run as a tracked MLflow run
(`runner.py`), skipped when nothing changed (`cache.py`), rendered into dvc.yaml (`dvc_yaml.py`).
Their plain functions, callable without Prefect: the data stage (`data/`), the train stage's
torchrun job and the operations on its checkpoints (`train/`), evaluation (`evaluate.py`),
registration and promotion (`register.py`, `promote.py`). Beside them: MLflow runs and lineage
(`tracking.py`), all-or-nothing files (`atomic.py`), run comparison (`compare.py`) and
reproduction (`reproduce.py`).

Imports configs, model and eval; never Prefect or flows (configs <- model <- eval <- tasks <-
flows).
"""
