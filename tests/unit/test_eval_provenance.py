"""The eval stage's results keep lm-eval's provenance (git commit, environment) while probing it
once an evaluation instead of once a dimension."""

from __future__ import annotations

import lm_eval.evaluator
import pytest

from forgeline.tasks.evaluate import provenance_probed_once


def test_each_call_records_the_environment_probed_once_and_the_probes_come_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[int] = []

    def probe(storage: dict) -> None:
        probes.append(1)
        storage["pretty_env_info"] = {"pip": ["torch"]}

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", probe)
    real_commit = lm_eval.evaluator.get_git_commit_hash
    with provenance_probed_once():
        first, second = {}, {}
        lm_eval.evaluator.add_env_info(first)
        lm_eval.evaluator.add_env_info(second)
        commits = {lm_eval.evaluator.get_git_commit_hash() for _ in range(3)}
    assert first == second == {"pretty_env_info": {"pip": ["torch"]}}
    assert first["pretty_env_info"] is not second["pretty_env_info"]  # a result edited alone
    assert len(probes) == 1 and len(commits) == 1
    assert lm_eval.evaluator.add_env_info is probe
    assert lm_eval.evaluator.get_git_commit_hash is real_commit
