"""Evaluation: the `forgeline` model class for lm-evaluation-harness (`lm.py`), conversations
through a chat template (`chat.py`), the capability dimensions and the score each task
contributes (`dimensions.py`, `scores.py`), the offline task suite (`suite.py` and the templates
in `tasks/`), the sandbox generated code runs in (`sandbox.py`) and the in-training evaluation
process (`periodic.py`).

Imports configs and model; nothing above (the eval stage in tasks/ builds on it).
"""
