"""lm-eval hook of forgeline's IFEval task: lm-eval's own scoring (`process_results`), with NLTK
finding its punkt sentence tokenizer (punkt_tab) in the llama-index-core package, which ships a
copy, instead of downloading it.

lm-eval's ifeval utils look for punkt_tab when imported and call `nltk.download` if it is not
found. Building the task imports this module first -- lm-eval resolves the `!function`s of a
task file before those of the file it includes -- so by then NLTK's search path ends with the
packaged copy (a punkt_tab of the user's, in NLTK_DATA or ~/nltk_data, still comes first).

IFEval counts a reply whose language langdetect cannot tell as following its language
instruction, and logs that at ERROR with the whole reply -- often a page of a small model's
repetition. It is an outcome of scoring, not an error of the run: kept as a warning with the
reply's start (UndetectedLanguage), in the stage's log file and off the console.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

import nltk

PUNKT_PACKAGE = "llama-index-core"
PUNKT_ROOT = "llama_index/core/_static/nltk_cache"  # an NLTK data directory: tokenizers/punkt_tab/
INSTRUCTIONS_LOGGER = "lm_eval.tasks.ifeval.instructions"
REPLY_SHOWN = 80  # characters of a reply kept in the warning


def packaged_nltk_data() -> Path:
    """The NLTK data directory inside llama-index-core that holds tokenizers/punkt_tab."""
    try:
        root = Path(str(metadata.distribution(PUNKT_PACKAGE).locate_file(PUNKT_ROOT)))
    except metadata.PackageNotFoundError as e:
        raise RuntimeError(f"IFEval counts sentences with NLTK's punkt, read offline from {PUNKT_PACKAGE}, "
                           "which is not installed: run `make install`") from e
    if not (root / "tokenizers" / "punkt_tab").is_dir():
        raise RuntimeError(f"{root} has no tokenizers/punkt_tab: install {PUNKT_PACKAGE}==0.14.25 "
                           "(`make install`)")
    return root


class UndetectedLanguage(logging.Filter):
    """IFEval's "Unable to detect language for text ... due to ..." as a warning with the reply's
    first REPLY_SHOWN characters; other records pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Unable to detect language") and len(record.args or ()) == 2:
            reply, error = record.args
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = ("IFEval could not detect the language of a reply (%r...: %s); counted as "
                          "followed, as IFEval does")
            record.args = (str(reply)[:REPLY_SHOWN], error)
        return True


_instructions_log = logging.getLogger(INSTRUCTIONS_LOGGER)
if not any(isinstance(f, UndetectedLanguage) for f in _instructions_log.filters):
    _instructions_log.addFilter(UndetectedLanguage())

if str(packaged_nltk_data()) not in nltk.data.path:
    nltk.data.path.append(str(packaged_nltk_data()))

from lm_eval.tasks.ifeval.utils import process_results  # noqa: E402  (after NLTK can find punkt)

__all__ = ["process_results"]
