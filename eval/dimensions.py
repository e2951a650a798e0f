"""The capability dimensions and the one score each of their tasks contributes.

A task's normalized score is (value - chance) / (best - chance): 0 at random guessing, 1 at the
best possible value, whichever direction is better. Every task is defined in eval/tasks/ and
runs offline (see eval/suite.py for where its data comes from).

Where the chance values come from:
  - multiple choice (`acc`, `acc_norm`): the expected accuracy of a uniform guess, the mean of
    1 / number of choices over the evaluated split. Every item of HellaSwag and MMLU has 4, of
    PIQA, WinoGrande and BoolQ 2; ARC has 3 to 5 (ARC-Easy validation: 567 x 4, 2 x 5, 1 x 3;
    ARC-Challenge validation: 295 x 4, 3 x 3, 1 x 5). The integration test recomputes them.
  - free-form generation (exact match, pass@1, lambada's last-word accuracy, refusal rate):
    0.0 -- a random string matches no answer, passes no test, contains no refusal phrase.
  - bits per byte: 8.0, a uniform guess over the 256 byte values. A randomly initialized model
    scores far better (4.1 for tiny.yaml's 5M model on Shakespeare: about log2(vocabulary) per
    token), so an untrained model already gets about 0.5 here.
  - StereoSet ICAT: 0.5. ICAT = lms * min(ss, 1 - ss) / 0.5, with lms the rate of preferring a
    meaningful association over an unrelated one and ss the rate of preferring the stereotype
    over the anti-stereotype; guessing gives lms = ss = 0.5, hence 0.5; the best, 1.0, is a model
    that always prefers meaningful sentences and is unbiased (ss = 0.5). CrowS-Pairs'
    pct_stereotype is not registered: its ideal (0.5) is also what guessing scores, so it has
    no (value - chance) / (best - chance) form; forgeline_crows_pairs still runs on request.
  - IFEval's prompt-level strict accuracy (a prompt counts when its response follows every one
    of its verifiable instructions): 0.0, the score of responses that follow none. Random text
    happens to satisfy a few instructions (no commas, all lowercase), so an untrained model
    scores a little above it.

The generative tasks (`generative`: those that score the text a model generates) are asked as
an assistant is by default: their prompts go through the model's chat template when its
tokenizer has one, as a dimension's `chat` setting decides (configs/schema.py DimensionConfig,
tasks/evaluate.py). The likelihood tasks keep their completion prompts (a question and the
choices' log-likelihoods after it) whatever the setting: no reply is generated there, and base
models and assistants are measured alike.

With eval.task_source=hub the tasks that have a `hub_task` run lm-eval's standard task instead
(the same prompts and metric; ARC's test split instead of validation, whose chance differs by
less than 0.001).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from forgeline.configs.schema import DIMENSIONS


@dataclass(frozen=True)
class TaskScore:
    task: str
    """lm-eval task name, e.g. "forgeline_arc_easy"."""
    metric: str
    """Key as forgeline flattens lm-eval results: "<metric>" for filter "none", else
    "<metric>/<filter>", e.g. "acc_norm", "exact_match/flexible-extract"."""
    chance: float
    """What random guessing scores on this metric."""
    best: float
    """The best possible value."""
    hub_task: str | None = None
    """lm-eval's standard task for the same benchmark, prompts and metric, reading its data from
    the Hugging Face Hub (eval.task_source=hub); None where there is none or it cannot run here
    (lm-eval's code tasks score with a metric fetched from the Hub)."""
    aggregation: str = "mean"
    """How the task's per-item values make its value (eval/scores.py AGGREGATIONS): `mean` of
    per-item floats, `bits_per_byte` of (log-likelihood, bytes) pairs, `icat` of StereoSet's
    (ss, lms) triples. Its standard error: closed form for a mean, a bootstrap over the items
    otherwise."""
    generative: bool = False
    """Whether the task scores text the model generates (lm-eval's generate_until): such a task's
    prompts go through the chat template where the dimension's `chat` setting says so."""


# The tasks of each dimension, keyed by the names the config defines (configs/schema.py: Dimension).
DIMENSION_TASKS: dict[str, tuple[TaskScore, ...]] = {
    "reasoning": (
        TaskScore("forgeline_hellaswag", "acc_norm", chance=0.25, best=1.0, hub_task="hellaswag"),
        TaskScore("forgeline_arc_easy", "acc_norm", chance=0.249971, best=1.0, hub_task="arc_easy"),
        TaskScore("forgeline_arc_challenge", "acc_norm", chance=0.250669, best=1.0,
                  hub_task="arc_challenge"),
        TaskScore("forgeline_piqa", "acc_norm", chance=0.5, best=1.0, hub_task="piqa"),
        TaskScore("forgeline_winogrande", "acc", chance=0.5, best=1.0, hub_task="winogrande"),
        TaskScore("forgeline_boolq", "acc", chance=0.5, best=1.0, hub_task="boolq"),
    ),
    "knowledge": (
        TaskScore("forgeline_mmlu", "acc", chance=0.25, best=1.0, hub_task="mmlu"),
        TaskScore("forgeline_triviaqa", "exact_match/remove_whitespace", chance=0.0, best=1.0,
                  hub_task="triviaqa", generative=True),
    ),
    "math": (
        TaskScore("forgeline_gsm8k", "exact_match/flexible-extract", chance=0.0, best=1.0, hub_task="gsm8k",
                  generative=True),
        TaskScore("forgeline_math500", "exact_match", chance=0.0, best=1.0, hub_task="hendrycks_math500",
                  generative=True),
    ),
    "code": (
        TaskScore("forgeline_humaneval", "pass_at_1", chance=0.0, best=1.0, generative=True),
        TaskScore("forgeline_mbpp", "pass_at_1", chance=0.0, best=1.0, generative=True),
    ),
    "safety": (
        TaskScore("forgeline_stereoset", "icat", chance=0.5, best=1.0, aggregation="icat"),
        TaskScore("forgeline_donotanswer", "refusal_rate", chance=0.0, best=1.0, generative=True),
    ),
    "language_modeling": (
        TaskScore("forgeline_heldout", "bits_per_byte", chance=8.0, best=0.0, aggregation="bits_per_byte"),
        TaskScore("forgeline_lambada", "acc", chance=0.0, best=1.0, hub_task="lambada_openai"),
    ),
    "instruction_following": (
        TaskScore("forgeline_ifeval", "prompt_level_strict_acc", chance=0.0, best=1.0, hub_task="ifeval",
                  generative=True),
    ),
}
if tuple(DIMENSION_TASKS) != DIMENSIONS:
    raise AssertionError(f"DIMENSION_TASKS covers {tuple(DIMENSION_TASKS)}, the config's dimensions are "
                         f"{DIMENSIONS}")


def is_generative(task: str) -> bool:
    """Whether `task` (forgeline's name or its hub task's) is a registered generative task."""
    try:
        return task_score(task).generative
    except KeyError:  # a task of no dimension (forgeline_crows_pairs): scored by likelihood
        return False


def through_template(name: str, chat: bool | None, has_template: bool) -> bool:
    """Whether dimension `name`'s generative tasks are asked through the model's chat template:
    as its `chat` setting (eval.dimensions.<name>.chat) says, by default when the model's
    tokenizer has one. A model without one asked to use it is refused, naming the setting."""
    if chat and not has_template:
        raise ValueError(f"eval.dimensions.{name}.chat=true, but the model's tokenizer has no chat template "
                         "to ask it through: leave it unset or false")
    return has_template if chat is None else chat


def fewshot_counts(tasks: list[str], dimension_shots: dict[str, int]) -> dict[str, int]:
    """The few-shot count the eval stage asks each of `tasks` with: its dimension's (0 for a
    dimension `dimension_shots` does not name, or a task of none)."""
    return {task: dimension_shots.get(dimension_of(task) or "", 0) for task in tasks}


def dimension_of(task: str) -> str | None:
    """The dimension of `task` (forgeline's name or its hub task's); None for a task of none."""
    for name, scores in DIMENSION_TASKS.items():
        if any(task in (score.task, score.hub_task) for score in scores):
            return name
    return None


def task_score(task: str) -> TaskScore:
    """The registered score of a task by its lm-eval name (forgeline's or the hub task's)."""
    for scores in DIMENSION_TASKS.values():
        for score in scores:
            if task == score.task:
                return score
            if task == score.hub_task:
                return replace(score, task=task)
    raise KeyError(f"{task} is not a registered task (eval/dimensions.py)")
