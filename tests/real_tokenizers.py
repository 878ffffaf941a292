"""Real tokenizers for tests, unpacked from `tests/fixtures/tokenizers/` (see its README: sources, licences).

`real_tokenizer("llama2")`: a SentencePiece Llama-family tokenizer (legacy, BOS added, no chat template);
`real_tokenizer("qwen3")`: Qwen3's BPE tokenizer with its own chat template. Each call returns a fresh tokenizer
(the pipeline adds tokens and sets templates on the one it is given); the files are unpacked once per session.
"""

from __future__ import annotations

import atexit
import functools
import lzma
import shutil
import tempfile
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
NAMES = ("llama2", "qwen3")


@functools.cache
def unpacked(name: str) -> Path:
    if name not in NAMES:
        raise ValueError(f"no vendored tokenizer {name!r}; known: {NAMES}")
    target = Path(tempfile.mkdtemp(prefix=f"mmadapt-tokenizer-{name}-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    with lzma.open(FIXTURES / name / "tokenizer.json.xz") as packed, open(target / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(packed, out)
    shutil.copy(FIXTURES / name / "tokenizer_config.json", target)
    return target


def real_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(unpacked(name))
