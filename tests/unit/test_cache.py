"""Stage caching decides like `dvc repro`: on the same code and config sections per stage."""

from pathlib import Path

import yaml

from forgeline.tasks.cache import STAGE_CODE, STAGE_SECTIONS

REPO = Path(__file__).parents[2]


def test_each_stage_hashes_the_code_and_sections_dvc_yaml_lists() -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    # The snapshot of the raw inputs is taken on every run, by DVC and by forgeline's data stage
    # alike, so it is never cached; the data stage's cache then hashes it like DVC does.
    sources = stages.pop("sources")
    assert sources["always_changed"] and sources["outs"][0] == {"${data.raw_dir}": {"persist": True}}
    assert "${data.raw_dir}" in stages["data"]["deps"]
    assert set(stages) == set(STAGE_CODE)
    for name, stage in stages.items():
        code = {dep for dep in stage["deps"] if not dep.startswith("${")}
        assert code == set(STAGE_CODE[name]), name
        (sections,) = (entry for param in stage["params"] for entry in param.values())
        assert set(sections) == set(STAGE_SECTIONS[name]), name
