"""Document cleaning: per-document filters, the keys deduplication compares (work.py finds the
duplicates across partitions).

Per document, in order: binary check, UTF-8 validation (drop or repair), normalization,
boilerplate lines removed, optional PII scrubbing, length bounds, a repetition filter; then the
exact-dedup key and a MinHash signature. A conversation (`clean_conversation`) is checked for
what makes it unusable -- invalid UTF-8, a role none of system, user, assistant and tool
(`unknown_role`), no content, an empty turn (an assistant turn with tool calls may have no text),
no assistant turn or one that opens it, no user turn -- its whitespace kept, an empty system turn
left out, an assistant's tool calls kept (chat.py renders them, or refuses a template that drops them),
optionally scrubbed of PII,
and keyed on its roles and words; the line filters (boilerplate, repetition) and min_chars are
for documents, not for the short turns of a chat. A preference pair (`clean_pair`) is cleaned as
a conversation on each side -- prompt, chosen and rejected -- and also dropped when a reply has no
assistant turn (`no_completion`) or opens with another turn (`completion_not_reply`: the two
conversations part before the reply, so they answer different prompts), or when its replies are
the same (`identical_replies`); max_chars bounds the three sides together, and it is keyed on all
three, each side by name (the same replies the other way round are another pair). Across
documents: exact dedup by the normalized text's hash, then near-dedup on the signatures' LSH
bands, with the bands datasketch's MinHashLSH chooses.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
from datasketch import MinHash, MinHashLSH

from forgeline.configs.schema import CleaningConfig
from forgeline.tasks.data.chat import PAIR_SIDES, conversation_text, pair_text

# Fixed so that signatures, and so the dedup decisions, are the same on every run.
MINHASH_SEED = 1
MINHASH_SCHEME = "affine32"
MINHASH_BATCH = 8192  # shingles hashed at a time
WORD = re.compile(r"\w+")
# The roles of a conversation (sources.py maps a source's names to them): chat templates know these.
ROLES = frozenset({"system", "user", "assistant", "tool"})
PII_PATTERNS = (
    ("<EMAIL>", re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}")),
    ("<IP>", re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")),
    # An optional +country code, then (area) or 3 digits, then 3 and 4 digits.
    ("<PHONE>", re.compile(r"(?<![\w.])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{3}[ .-])"
                           r"\d{3}[ .-]\d{4}(?![\w.])")),
)


@dataclass(frozen=True)
class Cleaned:
    """What the per-document filters made of one document."""

    removed_by: str | None  # the filter that dropped it, None if kept
    text: str = ""
    sha256: str = ""  # of the cleaned text: its identity for the split and mixing
    dedup_key: str = ""  # of the normalized text: equal keys are exact duplicates
    signature: np.ndarray | None = None  # MinHash hash values, for near-dedup
    repaired: bool = False  # invalid UTF-8 replaced by U+FFFD
    boilerplate_lines: int = 0
    pii_replaced: int = 0


def clean_document(data: bytes | None, cfg: CleaningConfig, with_signature: bool) -> Cleaned:
    if data is None:
        return Cleaned("too_long")
    if b"\x00" in data:
        return Cleaned("binary")
    decoded = decode(data, cfg)
    if decoded is None:
        return Cleaned("invalid_utf8")
    text, repaired = decoded
    if not text.strip():
        return Cleaned("empty")
    if len(text) > cfg.max_chars:
        return Cleaned("too_long")
    lines = [line.rstrip() for line in text.splitlines()]
    patterns = [re.compile(p) for p in cfg.boilerplate_patterns]
    kept = [line for line in lines if not any(p.search(line) for p in patterns)]
    text = "\n".join(kept).strip()
    text, pii = replace_pii(text) if cfg.scrub_pii else (text, 0)
    if len(text) < cfg.min_chars:
        return Cleaned("too_short")
    if repeated_line_fraction(kept) > cfg.max_repeated_line_fraction:
        return Cleaned("repetitive")
    return kept_text(text, WORD.findall(text.lower()), cfg, with_signature, repaired=repaired,
                     boilerplate_lines=len(lines) - len(kept), pii_replaced=pii)


def clean_conversation(data: bytes | None, cfg: CleaningConfig, with_signature: bool) -> Cleaned:
    """A conversation (chat.py `conversation_text`) cleaned, or the reason it was dropped; its text
    is the cleaned conversation's."""
    if data is None:
        return Cleaned("too_long")
    decoded = decode(data, cfg)
    if decoded is None:
        return Cleaned("invalid_utf8")
    text, repaired = decoded
    turns = json.loads(text)
    if any(m["role"] not in ROLES for m in turns):
        return Cleaned("unknown_role")  # rendered, it would be a role the model never sees in use
    messages = kept_turns(turns)
    if not any(said(m) for m in messages):
        return Cleaned("empty")
    if not all(said(m) for m in messages):
        return Cleaned("empty_turn")
    if all(m["role"] != "assistant" for m in messages):
        return Cleaned("no_assistant_turn")
    if reason := unprompted(messages):
        return Cleaned(reason)
    pii = scrub_turns(messages) if cfg.scrub_pii else 0
    if sum(len(m["content"]) for m in messages) > cfg.max_chars:
        return Cleaned("too_long")
    text = conversation_text(messages)
    words = WORD.findall(turns_text(messages).lower())
    return kept_text(text, words, cfg, with_signature, repaired=repaired, pii_replaced=pii)


def clean_pair(data: bytes | None, cfg: CleaningConfig, with_signature: bool) -> Cleaned:
    """A preference pair (chat.py `pair_text`) cleaned, or the reason it was dropped; its text is
    the cleaned pair's."""
    if data is None:
        return Cleaned("too_long")
    decoded = decode(data, cfg)
    if decoded is None:
        return Cleaned("invalid_utf8")
    text, repaired = decoded
    pair = {side: kept_turns(turns) for side, turns in json.loads(text).items()}
    messages = [m for side in PAIR_SIDES for m in pair[side]]
    if any(m["role"] not in ROLES for m in messages):
        return Cleaned("unknown_role")
    if not any(said(m) for m in messages):
        return Cleaned("empty")
    if not all(said(m) for m in messages):
        return Cleaned("empty_turn")
    replies = (pair["chosen"], pair["rejected"])
    if any(all(m["role"] != "assistant" for m in reply) for reply in replies):
        return Cleaned("no_completion")
    if any(reply[0]["role"] != "assistant" for reply in replies):
        return Cleaned("completion_not_reply")
    if reason := unprompted(pair["prompt"]):
        return Cleaned(reason)
    pii = scrub_turns(messages) if cfg.scrub_pii else 0
    if pair["chosen"] == pair["rejected"]:
        return Cleaned("identical_replies")  # no preference to learn: the loss of such a pair has no gradient
    if sum(len(m["content"]) for m in messages) > cfg.max_chars:
        return Cleaned("too_long")
    words = WORD.findall("\n".join(f"{side}\n{turns_text(pair[side])}" for side in PAIR_SIDES).lower())
    return kept_text(pair_text(pair), words, cfg, with_signature, repaired=repaired, pii_replaced=pii)


def kept_turns(turns: list[dict]) -> list[dict]:
    """The turns a conversation keeps: whitespace inside a turn is kept (a code answer's
    indentation); an empty system turn says nothing and is left out, not its conversation. A
    message's `train` (chat.py) and an assistant's tool calls go with it."""
    return [{key: m[key] for key in ("role", "content", "tool_calls", "train") if key in m} for m in turns
            if m["role"] != "system" or m["content"].strip()]


def unprompted(messages: list[dict]) -> str | None:
    """Why a conversation (or a pair's prompt) prompts no reply, if it does not: it has no user
    turn (`[system, assistant]`: a reply to nothing), or an assistant turn opens it (nothing
    prompts that turn: a model cannot learn when to say it)."""
    if all(m["role"] != "user" for m in messages):
        return "no_user_turn"
    if next(m["role"] for m in messages if m["role"] != "system") == "assistant":
        return "assistant_first"
    return None


def scrub_turns(messages: list[dict]) -> int:
    """Replaces PII in the messages' contents, in place; returns how many matches were replaced."""
    pii = 0
    for message in messages:
        message["content"], count = replace_pii(message["content"])
        pii += count
    return pii


def turns_text(messages: list[dict]) -> str:
    """What dedup compares of a conversation: its roles, contents and tool calls."""
    return "\n".join(f"{m['role']}\n{m['content']}\n{json.dumps(m.get('tool_calls', ''))}" for m in messages)


def said(message: dict) -> bool:
    """Whether a turn says something: text, or (an assistant's) tool calls."""
    return bool(message["content"].strip() or message.get("tool_calls"))


def decode(data: bytes, cfg: CleaningConfig) -> tuple[str, bool] | None:
    """The text and whether invalid UTF-8 was replaced by U+FFFD; None if it is to be dropped."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        if cfg.invalid_utf8 == "drop":
            return None
        return data.decode("utf-8", errors="replace"), True


def replace_pii(text: str) -> tuple[str, int]:
    """`text` with each PII match replaced by its placeholder, and how many were."""
    replaced = 0
    for placeholder, pattern in PII_PATTERNS:
        text, count = pattern.subn(placeholder, text)
        replaced += count
    return text, replaced


def kept_text(text: str, words: list[str], cfg: CleaningConfig, with_signature: bool,
              **counts: int | bool) -> Cleaned:
    """A kept record: its text, content hash, exact-dedup key and MinHash signature of `words`."""
    return Cleaned(
        removed_by=None,
        text=text,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        dedup_key=hashlib.sha256(" ".join(words).encode()).hexdigest(),
        signature=minhash_signature(words, cfg) if with_signature else None,
        **counts,
    )


def repeated_line_fraction(lines: list[str]) -> float:
    """Share of the characters of worded lines in lines that occur more than once. Lines without
    a letter or digit (reST underlines, closing braces) are structure, not repetition."""
    stripped = [line.strip() for line in lines if WORD.search(line)]
    total = sum(map(len, stripped))
    if not total:
        return 0.0
    counts = Counter(stripped)
    return sum(len(line) for line in stripped if counts[line] > 1) / total


def minhash_signature(words: list[str], cfg: CleaningConfig) -> np.ndarray:
    n = cfg.shingle_words
    shingles = {" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}
    minhash = MinHash(num_perm=cfg.minhash_perms, seed=MINHASH_SEED, scheme=MINHASH_SCHEME)
    ordered = sorted(shingles)
    # update_batch holds a (perms x shingles) array: in slices, a large document's signature
    # costs tens of megabytes, not gigabytes (the minimum does not depend on the slicing).
    for start in range(0, len(ordered), MINHASH_BATCH):
        minhash.update_batch([s.encode() for s in ordered[start:start + MINHASH_BATCH]])
    return minhash.hashvalues


def lsh_bands(cfg: CleaningConfig) -> list[tuple[int, int]]:
    """The bands of a signature that near-dedup compares: datasketch's MinHashLSH choice of
    bands and rows for the threshold (minimizing false positives and negatives)."""
    return list(MinHashLSH(threshold=cfg.near_dedup_threshold, num_perm=cfg.minhash_perms).hashranges)
