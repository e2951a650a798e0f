"""The lines a command ends with, in sentences: what a stage came to, where its outputs are, the
decision, the MLflow run. `forgeline run` and `forgeline stage NAME` end alike. Imported once the
flow ran: the result types are in memory."""

from __future__ import annotations

from typing import Any, Protocol

from forgeline.eval.scores import Z95


class Scores(Protocol):
    """An eval stage's result or the pipeline's: the scores and their intervals."""

    overall: float
    dimensions: dict[str, float]
    stderrs: dict[str, float]
    base_overall: float | None
    base_dimensions: dict[str, float] | None
    detectable: float | None


def score_lines(scores: Scores) -> list[str]:
    """Overall and per dimension, each with its 95 % interval and the base's score beside it."""
    base = scores.base_dimensions or {}

    def interval(key: str) -> str:  # the half-width of the 95 % interval
        return f" ± {Z95 * scores.stderrs[key]:.3f}" if key in scores.stderrs else ""

    lines = [f"Eval (chance-normalized, 0 = chance, 1 = best; ± 95 % interval): overall {scores.overall:.3f}"
             + interval("overall") + (f" (its base {scores.base_overall:.3f})" if base else "")]
    lines += [f"  {name}: {score:.3f}" + interval(name) + (f" (base {base[name]:.3f})" if base else "")
              for name, score in scores.dimensions.items()]
    if scores.detectable is not None:
        lines.append(f"Smallest overall change these items detect against another model (80 % power at the "
                     f"gate's Holm-corrected 5 %): {scores.detectable:.3f}")
    return lines


def stage_lines(name: str, result: Any) -> list[str]:
    """What stage `name` came to, from its result (tasks/stage.py's `result_type`)."""
    if name == "eval":
        return [f"eval: scores in {result.out_dir}, of {result.checkpoint}", *score_lines(result)]
    if name == "register":
        return [f"Registered model: {result.model_name} version {result.version} ({result.model_uri})",
                f"Promotion: {result.promotion}"]
    if name == "data":
        reused = " (up to date: nothing rewritten)" if result.reused else ""
        return [f"data: {result.documents:,} documents, {result.train_tokens:,} training tokens in "
                f"{result.train_samples:,} rows, {result.val_samples:,} validation rows; in "
                f"{result.out_dir}{reused}"]
    if name == "pairs":
        return [f"pairs: {result.pairs:,} pairs of {result.prompts:,} prompts, in {result.out_dir}"]
    validation = (f", validation loss {result.val_last['loss']:.4f} at step {result.val_last['step']}"
                  if result.val_last else "")
    restarts = f"; {len(result.failures)} restart(s) on the way" if result.failures else ""
    return [f"{name}: step {result.step}, loss {result.loss:.4f}{validation}, {result.tokens_seen:,} tokens "
            f"seen{restarts}; checkpoint {result.checkpoint}, in {result.out_dir}"]
