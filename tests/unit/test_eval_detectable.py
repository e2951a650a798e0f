"""The smallest change each dimension's items detect, as the eval prints it beside the overall's:
with the shipped SFT config's IFEval prompts a 0.1 change of instruction following is
detectable, with the 8 it had before it was not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forgeline.configs import load_config
from forgeline.configs.schema import DimensionConfig
from forgeline.eval.dimensions import task_score
from forgeline.eval.scores import TaskItems
from forgeline.tasks.evaluate import ModelScores, plan_tasks, result_of

IFEVAL, GSM8K = task_score("forgeline_ifeval"), task_score("forgeline_gsm8k")
FOLLOWED = 0.24  # about SmolLM2-135M-Instruct's prompt-level strict accuracy


def printed_changes(prompts: int, tmp_path: Path) -> dict[str, float]:
    """The per-dimension line of the eval's report, for IFEval on `prompts` prompts (a fraction
    FOLLOWED followed) beside GSM8K on 100 problems (30 right)."""
    plan = {"math": ([GSM8K], DimensionConfig(limit=100)),
            "instruction_following": ([IFEVAL], DimensionConfig(limit=prompts))}
    followed = round(FOLLOWED * prompts)
    items = {"forgeline_ifeval": TaskItems(ids=[str(i) for i in range(prompts)],
                                           values=[i < followed for i in range(prompts)]),
             "forgeline_gsm8k": TaskItems(ids=[str(i) for i in range(100)],
                                          values=[float(i < 30) for i in range(100)])}
    raw = {"forgeline_ifeval/prompt_level_strict_acc": followed / prompts,
           "forgeline_gsm8k/exact_match/flexible-extract": 0.3}
    result = result_of(ModelScores(raw=raw, items=items).report(plan), raw, tmp_path, tmp_path)
    [line] = [line for line in result.markdown().splitlines() if "smallest detectable" in line.lower()]
    changes = dict(re.findall(r"(\w+) (\d\.\d+)", line.partition(":")[2]))
    assert result.metrics["detectable/dimension/instruction_following"] == pytest.approx(
        float(changes["instruction_following"]), abs=5e-4)
    return {name: float(change) for name, change in changes.items()}


def test_the_shipped_sft_configs_ifeval_prompts_detect_a_change_of_a_tenth(tmp_path: Path) -> None:
    limit = plan_tasks(load_config("configs/smollm2-sft.yaml").eval)["instruction_following"][1].limit
    assert limit is None or limit >= 541  # all of IFEval's prompts
    changes = printed_changes(541, tmp_path)
    assert changes["instruction_following"] <= 0.1
    assert set(changes) == {"math", "instruction_following"}


def test_eight_prompts_detect_no_less_than_half_the_scale(tmp_path: Path) -> None:
    assert printed_changes(8, tmp_path)["instruction_following"] > 0.5
