"""Load a run config from YAML plus dotted `section.key=value` overrides, validated up front."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from forgeline.configs.redaction import scrub
from forgeline.configs.schema import Config, ConfigError

DEFAULT_CONFIG = "tiny.yaml"


def shipped_configs() -> list[Path]:
    """The YAML configs that ship with forgeline (configs/*.yaml)."""
    return sorted(Path(str(p)) for p in resources.files("forgeline.configs").iterdir()
                  if p.name.endswith(".yaml"))


def resolve_config_path(path: str | Path | None) -> Path:
    """`None` -> the embedded default; a bare shipped name (`tiny.yaml`) also resolves."""
    if path is None:
        path = DEFAULT_CONFIG
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    shipped = {p.name: p for p in shipped_configs()}
    if candidate.name == str(path) and candidate.name in shipped:
        return shipped[candidate.name]
    raise ConfigError(
        f"config file {str(path)!r} not found; shipped configs: {', '.join(sorted(shipped))}"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML, apply overrides, validate. Raises ConfigError with an actionable message, in which
    a URL's password is masked: it quotes overrides, YAML and values, and Prefect logs it."""
    try:
        config_path = resolve_config_path(path)
        raw = read_raw(config_path)
        for override in overrides:
            apply_override(raw, override)
        leave_the_shape_to_the_base(raw, config_path, overrides)
        try:
            return Config.model_validate(raw, context={"config_name": config_path.stem})
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, config_path)) from None
    except ConfigError as err:
        message = scrub(str(err))
    raise ConfigError(message)  # outside the handler: no unmasked exception rides along as its context


def read_raw(config_path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML mapping, with `inherit: OTHER.yaml` resolved: the named config (a path relative
    to this file, or a shipped name) is read first and this file's keys replace its keys,
    section by section; a key (or a section) set to null here removes the inherited one, which
    then takes its default. An inheriting file registers under its own name
    (`forgeline-<file stem>`) unless it sets `registry.model_name`: its model is another one,
    never a candidate against the parent's champion."""
    raw = read_own(config_path)
    parent = raw.pop("inherit", None)
    if parent is None:
        return raw
    registry = raw.setdefault("registry", {})
    if isinstance(registry, dict) and "model_name" not in registry:
        registry["model_name"] = f"forgeline-{config_path.stem}"
    if config_path.resolve() in seen:
        raise ConfigError(f"{config_path}: `inherit` loops back to itself")
    sibling = config_path.parent / parent
    base = read_raw(sibling if sibling.is_file() else resolve_config_path(parent),
                    seen + (config_path.resolve(),))
    for section, values in raw.items():
        if values is None:
            base.pop(section, None)
        elif isinstance(values, dict) and isinstance(base.get(section, {}), dict):
            removed = {key for key, value in values.items() if value is None}
            merged = base.get(section, {}) | values
            base[section] = {key: value for key, value in merged.items() if key not in removed}
        else:
            base[section] = values
    return base


def read_own(config_path: Path) -> dict[str, Any]:
    """The YAML mapping of this file alone, `inherit` unresolved."""
    try:
        raw = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{config_path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path}: top level must be a mapping of sections")
    return raw


def leave_the_shape_to_the_base(raw: dict[str, Any], config_path: Path, overrides: Sequence[str]) -> None:
    """With `model.init_from` set, the model keys this file inherits (tiny.yaml's `dim`,
    `n_layers`...) are dropped, so that the base's shape replaces them: only the keys the user
    sets -- in this file or by an override -- ask the base for a shape, and a base of another
    shape refuses those (`ModelConfig.with_base_shape`)."""
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("init_from") is None:
        return
    own = read_own(config_path).get("model") or {}
    overridden = {override.partition("=")[0].strip().split(".")[1] for override in overrides
                  if override.strip().startswith("model.")}
    for key in set(model) - set(own) - overridden - {"init_from"}:
        del model[key]


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `section.key[.subkey...]=value` in the raw mapping; the value is parsed as YAML."""
    dotted, sep, text = override.partition("=")
    keys = dotted.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError(
            f"override {override!r} must look like section.key=value (e.g. train.lr=3e-4)"
        )
    section, *path, key = keys
    if section not in Config.model_fields:
        raise ConfigError(
            f"override {override!r}: unknown section {section!r}; "
            f"allowed: {', '.join(Config.model_fields)}"
        )
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: value is not valid YAML: {err}") from err
    target = raw
    for name in (section, *path):
        target = target.setdefault(name, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{name!r} in {dotted!r} must be a mapping, not {type(target).__name__}")
    target[key] = value


def format_validation_error(err: ValidationError, source: Path) -> str:
    lines = [f"invalid config {source}:"]
    for problem in err.errors():
        loc = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "extra_forbidden":
            parent = _model_at(problem["loc"][:-1])
            allowed = ", ".join(parent.model_fields) if parent else "?"
            lines.append(f"  {loc}: unknown key; allowed here: {allowed}")
            continue
        message = problem["msg"].removeprefix("Value error, ")
        got = f" (got {problem['input']!r})" if not isinstance(problem["input"], dict) else ""
        lines.append(f"  {loc or '<config>'}: {message}{got}")
    return "\n".join(lines)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config class found by following `loc` (field names, list indexes, dict keys) from
    Config."""
    model: type[BaseModel] = Config
    dict_key_next = False
    for part in loc:
        if isinstance(part, int) or dict_key_next:
            dict_key_next = False
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        dict_key_next = get_origin(field.annotation) is dict
        nested = _first_model(field.annotation)
        if nested is None:
            return None
        model = nested
    return model


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def config_docs() -> str:
    """Every section and field with its type, default and docstring; the fields of nested
    models (data.cleaning, each entry of data.sources, ...) indented under theirs."""
    lines = []
    for section, field in Config.model_fields.items():
        model = _first_model(field.annotation)
        lines.append(f"{section}:  # {' '.join((model.__doc__ or '').split())}")
        lines += _field_docs(model, indent="  ")
    return "\n".join(lines)


def _field_docs(model: type[BaseModel], indent: str) -> list[str]:
    lines = []
    for name, sub in model.model_fields.items():
        default = "(required)" if sub.is_required() else sub.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        elif isinstance(default, list):
            default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d
                       for d in default]
        doc = " ".join((sub.description or "").split())
        lines.append(f"{indent}{name}: {default!r}\n{indent}    {doc}")
        nested = _first_model(sub.annotation)
        if nested is not None and nested is not model:
            lines += _field_docs(nested, indent + "    ")
    return lines
