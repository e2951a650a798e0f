"""The promotion gate as a pure function; the registry side is tests/integration/test_promotion.py."""

from __future__ import annotations

from forgeline.tasks.promote import Scores, gate


def scores(overall: float, **dimensions: float) -> Scores:
    return Scores(overall, dimensions)


def test_a_better_version_with_no_regression_passes() -> None:
    assert gate(scores(0.32, math=0.3, code=0.34), scores(0.30, math=0.3, code=0.3), 0.01, 0.05) == []


def test_the_margin_is_required_on_top_of_the_champion() -> None:
    [reason] = gate(scores(0.305, math=0.305), scores(0.30, math=0.30), 0.01, 0.05)
    assert reason.startswith("overall 0.3050 < champion 0.3000 + margin 0.01")


def test_a_dimension_regressing_past_the_threshold_fails_even_with_a_better_overall() -> None:
    [reason] = gate(scores(0.5, math=0.2, code=0.8), scores(0.3, math=0.3, code=0.3), 0.0, 0.05)
    assert reason.startswith("dimension math fell 0.1000")


def test_a_dimension_the_candidate_lacks_fails() -> None:
    [reason] = gate(scores(0.5, code=0.5), scores(0.3, math=0.3, code=0.3), 0.0, 0.05)
    assert "dimension math was not evaluated" in reason


def test_a_negative_margin_tolerates_a_small_loss() -> None:
    assert gate(scores(0.29, math=0.29), scores(0.30, math=0.30), -0.02, 0.05) == []
