"""Model families: the Hugging Face architectures forgeline imports, trains in every layout and
exports back as themselves.

A family is one module here (family.py says what it holds): its config mapping both ways and its
weight names. The differences in the network itself are keys of `ModelConfig` that the one
Transformer (model/transformer.py) reads, so the tensor-parallel plan and the pipeline split
(model/parallel/) follow from the modules a shape has, and the trainer, checkpoints, eval and
registry never name a family. Adding one: a module with a `Family`, listed below and in
`configs.schema.ModelFamily`.
"""

from __future__ import annotations

from forgeline.model.families import gemma, llama, mistral, phi3, qwen2, qwen3
from forgeline.model.families.family import Family, UnsupportedArchitecture

FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma.GEMMA2, gemma.GEMMA3, phi3.FAMILY)}


def family_named(model_type: str) -> Family:
    """The family of a Hugging Face `model_type`; refused naming the supported ones."""
    if model_type not in FAMILIES:
        raise UnsupportedArchitecture(f"model_type {model_type!r} is not a family forgeline has (supported: "
                                      f"{', '.join(FAMILIES)})")
    return FAMILIES[model_type]
