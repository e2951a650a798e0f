"""The pairs stage: preference pairs made offline from verifiable instructions.

prompts.py makes the prompts -- writing tasks from the packaged conversations with constraints
from lm-eval's IFEval instruction registry, less those whose task overlaps an IFEval prompt;
checks.py scores replies with the registry's own checkers and pairs them; build.py samples the
replies from the policy and is the stage (its function, record and manifest).

Imports configs, eval (chat rendering, precision, lm-eval's IFEval registry and rows), model
(the policy and its sampling) and the rest of tasks/ (atomic files, the base, the data stage's
conversations and sources, tracking).
"""
