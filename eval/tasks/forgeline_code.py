"""lm-eval hooks of forgeline's code tasks: the completion and its tests are assembled into one
program that runs only in forgeline's sandbox (eval/sandbox.py); pass@1 of a greedy completion
is whether that program exits 0 within the limits."""

from __future__ import annotations

from forgeline.eval.sandbox import Limits, run_python

# Per program. The reference solutions of both benchmarks pass well within them.
LIMITS = Limits(timeout_s=10.0, cpu_s=5, memory_mb=1024)


def humaneval_program(doc: dict, completion: str) -> str:
    """lm-eval's assembly: prompt + completion, the test module, then check(entry_point)."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def mbpp_program(doc: dict, completion: str) -> str:
    """The completion, the item's setup code, then its three asserts."""
    return "\n".join([completion, doc["test_setup_code"], *doc["test_list"]]) + "\n"


def humaneval_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"pass_at_1": float(run_python(humaneval_program(doc, results[0]), LIMITS).passed)}


def mbpp_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"pass_at_1": float(run_python(mbpp_program(doc, results[0]), LIMITS).passed)}
