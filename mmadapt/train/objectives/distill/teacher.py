"""The teacher of on-policy distillation: loaded once, frozen, in eval mode; its tokenizer checked against the
student's; its per-GPU parameters counted for `mmadapt plan` without loading its weights.

`load_teacher(source)` reads any source `mmadapt.loading.load_for_inference` reads (an mmadapt model directory, a run
or checkpoint directory, a transformers export). `check_same_tokenizer` compares the vocabulary size, the token -> id
map of the special tokens and a fingerprint of the whole vocabulary (sha256 of its sorted (token, id) pairs), and
refuses in one line naming both sources. Under FSDP2 the teacher is replicated on every rank (never sharded: it is
no part of the wrapped student, and its forward runs no collective), so each GPU holds all its parameters.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


def load_teacher(source: str) -> tuple[Any, Any]:
    """(teacher, tokenizer): the model of `source`, frozen and in eval mode (`load_for_inference` merges any LoRA)."""
    from mmadapt.loading import load_for_inference

    if not Path(source).exists():
        raise FileNotFoundError(f"distill.teacher {source} does not exist: give a model, run or checkpoint directory")
    model, tokenizer = load_for_inference(source)
    model.requires_grad_(False)
    return model.eval(), tokenizer


def vocabulary_of(tokenizer: Any) -> tuple[int, dict[str, int], str]:
    """(size with added tokens, {special token: id}, sha256 of the sorted (token, id) pairs)."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in sorted(vocab.items())).encode()).hexdigest()
    specials = {token: vocab.get(token, -1) for token in tokenizer.all_special_tokens}
    return len(tokenizer), specials, digest


def check_same_tokenizer(student: Any, teacher: Any, student_source: str, teacher_source: str) -> None:
    """`ValueError` in one line naming both sources unless the two tokenizers are the same (`vocabulary_of`)."""
    (n_s, special_s, hash_s), (n_t, special_t, hash_t) = vocabulary_of(student), vocabulary_of(teacher)
    if n_s != n_t:
        why = f"{n_s} tokens against {n_t}"
    elif special_s != special_t:
        differ = sorted(set(special_s.items()) ^ set(special_t.items()))[:3]
        why = f"their special tokens differ ({differ})"
    elif hash_s != hash_t:
        why = f"their vocabularies differ (sha256 {hash_s[:12]} against {hash_t[:12]})"
    else:
        return
    raise ValueError(f"distill.teacher {teacher_source} has another tokenizer than the student {student_source}: "
                     f"{why}; distillation compares their distributions token by token, so the teacher must use the "
                     "student's tokenizer")


def check_same_vocabulary(student: Any, teacher: Any, teacher_source: str) -> None:
    """The two output layers score the same V tokens (the divergence is over one vocabulary)."""
    v_s = student.backbone.get_output_embeddings().weight.shape[0]
    v_t = teacher.backbone.get_output_embeddings().weight.shape[0]
    if v_s != v_t:
        raise ValueError(f"distill.teacher {teacher_source} scores {v_t} tokens and the student {v_s}: the output "
                         "layers must share the tokenizer's vocabulary")


def teacher_parameters(source: str) -> int:
    """The teacher's parameter count, from its structure (an mmadapt directory's on the meta device: no weights
    read; a transformers export is loaded as it comes, `mmadapt.directory.structure`)."""
    from mmadapt import directory
    from mmadapt.loading import resolve_source
    from mmadapt.model import VisionLanguageModel

    model = directory.structure(VisionLanguageModel, resolve_source(source, verify=False))
    return sum(p.numel() for p in model.parameters())
