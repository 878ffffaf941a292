"""`mmadapt train CONFIG`: build the model, tokenizer, datasets and collator a config names, then train.

`build_run(config)` returns the pieces (for notebooks that want to change one): the datasets and the collator are the
run's objective's (`train.objective`, `mmadapt.train.objectives`); `run(config)` trains and returns the trainer's
summary. Works the same under torchrun.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmadapt.data.tokenizer import TOKENIZER_FILES, tokenizer_for
from mmadapt.train.config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    model: Any
    tokenizer: Any
    encoder: Any
    train_data: Any
    eval_data: Any
    collate: Any


def build_model_from(config: RunConfig) -> Any:
    """The run's model; a `qlora` backbone's NF4 layers stored in NF4 as they are read (`mmadapt.quantize`)."""
    from contextlib import nullcontext

    from mmadapt import bnb
    from mmadapt.model import VisionLanguageModel
    from mmadapt.quantize import nf4_loading

    m = config.model
    # a bnb-4bit checkpoint cannot be sharded (FSDP2): said before any weight is read
    bnb.refuse_fsdp([m.pretrained, m.model_config().backbone.pretrained], config.distributed.strategy,
                    int(os.environ.get("WORLD_SIZE", "1")))
    qlora = config.stages.modes()["backbone"] == "qlora"
    with nf4_loading(config.quantization) if qlora else nullcontext():
        if m.pretrained:
            return VisionLanguageModel.from_pretrained(m.pretrained)
        return VisionLanguageModel(m.model_config())


def model_structure(config: RunConfig) -> Any:
    """The run's model with its parameters on the meta device (no weights read): what the data side needs (its
    processor, span tokens and chat template), for `mmadapt data check DATA RUN.yaml`."""
    from mmadapt import directory as model_directory
    from mmadapt.model import VisionLanguageModel
    from mmadapt.weights import architecture_only, empty_weights

    if config.model.pretrained:
        return model_directory.structure(VisionLanguageModel, config.model.pretrained)
    with empty_weights(), architecture_only():
        return VisionLanguageModel(config.model.model_config())


def tokenizer_source(config: RunConfig) -> str | None:
    """`data.tokenizer`, else the pretrained backbone's (or whole model's) directory if it has tokenizer files."""
    if config.data.tokenizer is not None:
        return config.data.tokenizer
    backbone = config.model.model_config().backbone.pretrained
    for candidate in (backbone, config.model.pretrained):
        if candidate and any((Path(candidate) / name).is_file() for name in TOKENIZER_FILES):
            return candidate
    if backbone:
        log.warning("the pretrained backbone %s has no tokenizer files; using mmadapt's character tokenizer, which "
                    "the backbone was not trained with. Set data.tokenizer to the backbone's tokenizer directory.",
                    backbone)
    return None


def build_run(config: RunConfig, model: Any = None) -> RunParts:
    """The model, tokenizer, sample encoder, and the datasets and collator of the run's objective (`Objective.data`)."""
    import torch

    from mmadapt.data import SampleEncoder
    from mmadapt.train.objectives import check_sequence_parallel, objective_for

    if config.data.train is None:
        raise ValueError("data.train is not set: give a LLaVA or messages .json/.jsonl file (data.train=PATH)")
    from mmadapt import directory as model_directory
    from mmadapt.data.config import DataConfig

    objective = objective_for(config)  # an unknown train.objective fails before anything is built
    if config.distributed.sequence_parallel > 1:  # refused before any weight or record is read
        check_sequence_parallel(objective, model if model is not None else model_structure(config),
                                config.distributed.sequence_parallel)
    torch.manual_seed(config.train.seed)
    model = model if model is not None else build_model_from(config)
    tokenizer = tokenizer_for(tokenizer_source(config))
    d = config.data
    # what this run renders and samples is what the model remembers: saved with its checkpoints, OUT/model and
    # exports, the defaults of Processor.for_model (chat, eval, serving)
    model_directory.set_data_settings(model, DataConfig.of(d).preprocessing())
    encoder = SampleEncoder.for_model(model, tokenizer, config=d)
    data = objective.data(model, encoder)
    return RunParts(model, tokenizer, encoder, data.train, data.eval, data.collate)


def run(config: RunConfig) -> dict[str, Any]:
    from mmadapt.train.trainer import Trainer

    parts = build_run(config)
    trainer = Trainer(parts.model, config, parts.train_data, parts.collate, eval_data=parts.eval_data,
                      tokenizer=parts.tokenizer)
    trainer.plan = planned(config, trainer.dist.world, trainer.device)
    return trainer.fit()


def planned(config: RunConfig, world: int, device: Any) -> dict[str, Any] | None:
    """The run's `mmadapt plan` (`--json`), logged with the config, when its probe is cached (`mmadapt plan` was run
    for this config: a run does not pay for a probe at start); None otherwise."""
    from mmadapt.train.plan import cached_probe_or_none, predict

    try:
        probe = cached_probe_or_none(config)
        if probe is None:
            log.info("no memory plan logged: run `mmadapt plan` on this config first to log it with the run")
            return None
        return predict(config, gpus=world, device=getattr(device, "type", "cpu"), probe=probe).to_json()
    except (OSError, ValueError) as e:  # a plan is a report: it never stops a run
        log.warning("the memory plan could not be made (%s); training goes on", e)
        return None
