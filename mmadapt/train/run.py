"""`mmadapt train CONFIG`: build the model, tokenizer, datasets and collator a config names, then train.

`build_run(config)` returns the pieces (for notebooks that want to change one); `run(config)`
trains and returns the trainer's summary. Works the same under torchrun.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmadapt.train.config import RunConfig


@dataclass
class RunParts:
    model: Any
    tokenizer: Any
    encoder: Any
    train_data: Any
    eval_data: Any
    collate: Any


def build_model_from(config: RunConfig) -> Any:
    from mmadapt import VisionLanguageModel, build_model

    m = config.model
    if m.pretrained:
        return VisionLanguageModel.from_pretrained(m.pretrained)
    return build_model(m.encoder, m.projector, m.backbone, preset=m.preset)


def load_tokenizer(path: str | None) -> Any:
    if path is None:
        from mmadapt.data import char_tokenizer

        return char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_run(config: RunConfig, model: Any = None) -> RunParts:
    import torch

    from mmadapt.data import Collator, SampleEncoder, VLMDataset

    if config.data.train is None:
        raise ValueError("data.train is not set: give a LLaVA or messages .json/.jsonl file (data.train=PATH)")
    torch.manual_seed(config.train.seed)
    model = model if model is not None else build_model_from(config)
    tokenizer = load_tokenizer(config.data.tokenizer)
    d = config.data
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=d.image_root, max_length=d.max_length,
                                      truncation=d.truncation)
    collate = Collator.for_model(model, encoder.pad_token_id, max_tokens=d.max_tokens if d.packing else None)
    train = VLMDataset(d.train, encoder)
    evaluation = VLMDataset(d.eval, encoder) if d.eval else None
    return RunParts(model, tokenizer, encoder, train, evaluation, collate)


def run(config: RunConfig) -> dict[str, Any]:
    from mmadapt.train.trainer import Trainer

    parts = build_run(config)
    trainer = Trainer(parts.model, config, parts.train_data, parts.collate, eval_data=parts.eval_data)
    return trainer.fit()
