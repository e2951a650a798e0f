"""Run names from a config's run.name: where a config or an override sets one, the MLflow runs
(and the Prefect runs named like them) say it in place of the config's label."""

from __future__ import annotations

from forgeline.configs import load_config
from forgeline.tasks.register import with_version
from forgeline.tasks.tracking import run_name

CLEAN = {"git.commit": "1a2b3c4d5e6f", "git.dirty": "false"}


def test_a_run_name_says_the_run_name_a_config_sets() -> None:
    named = load_config("tiny.yaml", ["run.name=ablation-lr"])
    assert run_name("pipeline", named, with_layout=True, code=CLEAN) == \
        "pipeline ablation-lr pp2xdp2 @1a2b3c4"
    # The registered version goes after the name, as after a config's label.
    assert with_version("pipeline ablation-lr pp2xdp2 @1a2b3c4", named, "v3") == \
        "pipeline ablation-lr v3 pp2xdp2 @1a2b3c4"


def test_the_run_name_filled_in_on_loading_leaves_the_config_label() -> None:
    filled = load_config("tiny.yaml", ["train.steps=300"])
    assert filled.run.name.startswith("tiny-")  # `tiny-<fingerprint>`: says less than `tiny`
    assert run_name("train", filled, with_layout=True, code=CLEAN) == "train tiny pp2xdp2 @1a2b3c4"
