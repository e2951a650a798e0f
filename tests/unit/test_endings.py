"""The sentences `forgeline stage NAME` ends with (flows/endings.py): each stage's result said in
words -- what it made, where, the decision -- never its dataclass's repr, which the terminal cut."""

from __future__ import annotations

from forgeline.flows.endings import stage_lines
from forgeline.tasks.evaluate import EvalResult
from forgeline.tasks.pairs.build import PairsResult
from forgeline.tasks.register import RegisterResult
from forgeline.tasks.train.job import TrainResult


def test_each_stage_ends_in_sentences() -> None:
    train = TrainResult(out_dir="artifacts/train-x", checkpoint="artifacts/train-x/checkpoints/step-20",
                        step=20, loss=3.2101, tokens_seen=40960, layout={"dp_shard": 2},
                        failures=["rank 1 killed"], val_last={"step": 20, "loss": 3.3, "bpb": 1.2})
    assert stage_lines("sft", train) == [
        "sft: step 20, loss 3.2101, validation loss 3.3000 at step 20, 40,960 tokens seen; 1 restart(s) on "
        "the way; checkpoint artifacts/train-x/checkpoints/step-20, in artifacts/train-x"]
    scores = EvalResult(out_dir="artifacts/eval-x", checkpoint="step-00000020", overall=0.1,
                        dimensions={"math": 0.1}, metrics={}, stderrs={"overall": 0.01, "math": 0.01},
                        base_overall=0.2, base_dimensions={"math": 0.2})
    assert stage_lines("eval", scores) == [
        "eval: scores in artifacts/eval-x, of step-00000020",
        "Eval (chance-normalized, 0 = chance, 1 = best; ± 95 % interval): overall 0.100 ± 0.020 "
        "(its base 0.200)",
        "  math: 0.100 ± 0.020 (base 0.200)"]
    registered = RegisterResult(run_id="abc", model_name="forgeline-tiny", version="3",
                                model_uri="models:/forgeline-tiny/3", promotion="promoted: better on math")
    assert stage_lines("register", registered) == [
        "Registered model: forgeline-tiny version 3 (models:/forgeline-tiny/3)",
        "Promotion: promoted: better on math"]
    pairs = PairsResult(out_dir="artifacts/pairs-x", prompts=192, pairs=104, metrics={})
    assert stage_lines("pairs", pairs) == ["pairs: 104 pairs of 192 prompts, in artifacts/pairs-x"]
