"""Tokenizers: make any transformers tokenizer fit a model, and a small offline one for tiny models.

`prepare_tokenizer(model, tokenizer)` adds the special tokens the backbone's image span and
chat template need when the tokenizer lacks them (logged), points the model's span token ids
at the tokenizer's ids, and resizes the embeddings when the vocabulary grew (logged). After
it, the tokenizer and the model agree on every id the pipeline emits.

`saved_tokenizer(directory)` reads the tokenizer saved in a model directory or checkpoint (None when it holds
none); `tokenizer_for(source)` is the tokenizer a run or a command names (a directory that must hold one, or None:
the character tokenizer). `char_tokenizer()` is a character-level `PreTrainedTokenizerFast` over printable ASCII, built
in code (no hub): the tokenizer of the tiny presets, the demo and the tests.
"""

from __future__ import annotations

import logging
import os
import string
from pathlib import Path
from typing import Any

from mmadapt.data.templates import TEMPLATES
from mmadapt.remote_code import AUTO_MAP, warn_dropped

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class RemoteCodeError(ValueError):
    """A directory asks transformers to run its own Python code; mmadapt never does (`trust_remote_code=False`)."""


def saved_tokenizer(directory: str | os.PathLike) -> Any:
    """The transformers tokenizer saved in `directory` (a model directory or checkpoint); None when it has none.

    The directory's own code never runs (`trust_remote_code=False`; no prompt): a tokenizer that exists only as
    code in the directory (`auto_map`) raises `RemoteCodeError`; an `auto_map` beside a class transformers ships is
    dropped with a warning (`mmadapt.remote_code`), so no save of the tokenizer carries it.
    """
    directory = Path(directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise RemoteCodeError(
            f"the tokenizer in {directory} is custom code in that directory (auto_map in its tokenizer_config.json / "
            "config.json); mmadapt never runs a checkpoint's own code. Fix: save the tokenizer as a plain "
            "transformers tokenizer (tokenizer.json) with a class transformers ships, or point data.tokenizer at "
            "the tokenizer of a registered family (mmadapt list)") from None
    return forget_auto_map(tokenizer, directory)


def forget_auto_map(tokenizer: Any, directory: Path) -> Any:
    """`tokenizer` (read from `directory`) without the `auto_map` its config carried, which its `save_pretrained`
    would write back (warned about: `mmadapt.remote_code`). Returns `tokenizer`."""
    found = tokenizer.init_kwargs.pop(AUTO_MAP, None) or getattr(tokenizer, "_auto_map", None)
    if found:
        warn_dropped(directory / "tokenizer_config.json", {AUTO_MAP: found})
        tokenizer._auto_map = None
    return tokenizer


def tokenizer_for(source: str | os.PathLike | None) -> Any:
    """The tokenizer a run or a command names: the one saved in `source` (a `FileNotFoundError` when it holds none),
    or, for None, mmadapt's character tokenizer (the tiny presets')."""
    if source is None:
        return char_tokenizer()
    tokenizer = saved_tokenizer(source)
    if tokenizer is None:
        raise FileNotFoundError(f"{source} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}). Fix: point "
                                "data.tokenizer (--tokenizer) at a model directory or a tokenizer's folder")
    return tokenizer


def char_tokenizer() -> Any:
    """One token per printable ASCII character, plus <unk> <pad> <s> </s>; about 100 ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3}
    for char in string.printable:
        if char not in "\r\x0b\x0c":
            vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def required_tokens(model: Any, tokenizer: Any, template: Any = None) -> list[str]:
    spec = model.backbone_spec
    span = [spec.image_token, spec.vision_start_token, spec.vision_end_token, spec.video_token]
    template = template or TEMPLATES.get(spec.chat_template)
    return [t for t in [*span, *template.specials(tokenizer)] if t]


def prepare_tokenizer(model: Any, tokenizer: Any, template: Any = None) -> Any:
    """Add missing special tokens (the backbone's image span and what `template` writes; default: the backbone's
    built-in), align the model's span ids, resize embeddings if needed. Returns `tokenizer`."""
    template = template or TEMPLATES.get(model.backbone_spec.chat_template)
    vocab = tokenizer.get_vocab()
    missing = [t for t in dict.fromkeys(required_tokens(model, tokenizer, template)) if t not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
        log.info("added special tokens %s to the tokenizer (ids %s)", missing,
                 tokenizer.convert_tokens_to_ids(missing))
    spec = model.backbone_spec
    if tokenizer.eos_token is None:
        tokenizer.eos_token = template.end_of_turn(tokenizer)
        log.info("the tokenizer has no EOS token; using the template's end of turn %r", tokenizer.eos_token)
    ids = {"image_token_id": tokenizer.convert_tokens_to_ids(spec.image_token)}
    if spec.vision_start_token is not None:
        ids["vision_start_token_id"] = tokenizer.convert_tokens_to_ids(spec.vision_start_token)
        ids["vision_end_token_id"] = tokenizer.convert_tokens_to_ids(spec.vision_end_token)
    if spec.video_token is not None:
        ids["video_token_id"] = tokenizer.convert_tokens_to_ids(spec.video_token)
    changed = {k: v for k, v in ids.items() if getattr(model.tokens, k) != v}
    if changed:
        log.info("model span token ids now follow the tokenizer: %s", changed)
        model.set_span_tokens(**ids)
    size = model.backbone.get_input_embeddings().num_embeddings
    if len(tokenizer) > size:
        resize_embeddings(model.backbone, len(tokenizer))
    return tokenizer


def resize_embeddings(lm: Any, size: int) -> None:
    """Grow the input embeddings (and an untied lm_head) to `size` rows; new rows = the mean of the old ones.

    LLaVA's initialisation for added tokens: the mean keeps the new tokens' logits and inputs ordinary,
    where a random row would be an outlier. transformers' `mean_resizing` samples around the mean instead.
    """
    import torch

    old = lm.get_input_embeddings().num_embeddings
    lm.resize_token_embeddings(size, mean_resizing=False)
    output = lm.get_output_embeddings()
    weights = [lm.get_input_embeddings().weight] + ([output.weight] if output is not None else [])
    with torch.no_grad():
        for weight in {id(w): w for w in weights}.values():  # once when tied
            weight[old:] = weight[:old].mean(0, keepdim=True)
    log.info("vocabulary %d -> %d tokens: resized the backbone's embeddings%s; new rows are the mean of the existing "
             "rows", old, size, "" if lm.config.tie_word_embeddings else " and lm_head")
