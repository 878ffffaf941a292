"""What training leaves behind, written as a model directory: `export(src, dst)` (`mmadapt export`, the trainer's
`OUT/model`).

A source is what `mmadapt.loading` loads (`resolve_source`, `load_trained`; importable from here too): a complete
checkpoint directory, a run directory (its newest checkpoint whose files match their checksums), or a model directory
(mmadapt or transformers). The model is built on the meta device, LoRA layers are injected exactly as in training,
the weights are loaded strictly and LoRA is merged, so the model directory `export` writes holds plain weights that
`VisionLanguageModel.from_pretrained` opens with no other argument. A sharded checkpoint is written in mmadapt's
format without ever holding the whole model (`mmadapt.train.sharded_export`), into the same files.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mmadapt import directory as model_directory
from mmadapt.atomic import TargetExistsError, check_target
from mmadapt.data.tokenizer import saved_tokenizer
from mmadapt.loading import (  # noqa: F401  (loading's names, where callers have found them: mmadapt.loading)
    TrainedWith,
    load_checkpoint_model,
    load_trained,
    resolve_source,
)
from mmadapt.processor import export_processor
from mmadapt.quantize import QUANTIZED_BASE_KEY
from mmadapt.run_directory import RunDirectory, is_complete
from mmadapt.sharded_checkpoint import is_sharded
from mmadapt.train.sharded_export import export_sharded, transformers_from_sharded

log = logging.getLogger(__name__)


def export(src: str | Path, dst: str | Path, *, format: str = "mmadapt", overwrite: bool = False,
           verify: bool = True, max_shard_size: int | str = "5GB") -> Path:
    """Write the model directory of `src` (see module docstring) to `dst`; returns `dst`. `format="transformers"`
    writes what transformers, vLLM and SGLang load, with the processor settings and chat template the model was
    trained with and a record of mmadapt's version and of the checksums of `src` and of every file written
    (`mmadapt.directory.save`, docs/export.md).

    Atomic (`VisionLanguageModel.save_pretrained`): `dst` ends as it was or as the whole new model, never a mix. A
    `dst` that already holds a model directory is replaced only with `overwrite=True` (`mmadapt export --overwrite`;
    the trainer's own `OUT/model`); one that holds anything else (a checkpoint, a run, other files) never. The target
    is checked before the model is loaded, and a checkpoint's files against their checksums (`resolve_source`;
    `verify=False`: the trainer's own just-written one). Weights are split into files of at most `max_shard_size`.

    A sharded checkpoint (`mmadapt.sharded_checkpoint`) is exported without a gather (`mmadapt.train.sharded_export`:
    the same files as from its gathered twin): mmadapt's format one weight file's tensors at a time; transformers'
    from a model memory-mapped from such a directory written beside `dst` first (and removed). A QLoRA checkpoint is
    loaded whole, its base's weights read in full precision from the checkpoint its run started from (`mmadapt.qlora`),
    and its adapters merged into them."""
    if format not in ("mmadapt", "transformers"):
        raise ValueError(f"unknown format {format!r}; use 'mmadapt' or 'transformers'")
    dst = Path(dst)
    if is_complete(dst) or RunDirectory(dst).exists():
        raise TargetExistsError(f"{dst} is a training checkpoint or run directory, not a model directory: export "
                                "writes a model directory and never replaces a checkpoint. Choose another dst.")
    check_target(dst, what="model directory", overwrite=overwrite, recognise=model_directory.is_model_directory)
    path = resolve_source(src, verify=verify)
    if is_complete(path) and is_sharded(path) and QUANTIZED_BASE_KEY not in model_directory.read_config(path):
        run, tokenizer = TrainedWith.read(path), saved_tokenizer(path)
        if format == "transformers":
            transformers_from_sharded(path, dst, run, tokenizer=tokenizer, max_shard_size=max_shard_size,
                                      overwrite=overwrite)
        else:
            done = export_sharded(path, dst, run, tokenizer=tokenizer, max_shard_size=max_shard_size,
                                  overwrite=overwrite)
            log.info("read %s one weight file at a time: at most %.1f MiB of the model's %.1f MiB held", path,
                     done.peak_bytes / 2**20, done.model_bytes / 2**20)
    else:
        model, tokenizer = load_trained(path, verify=False)  # verified above
        model.save_pretrained(dst, format=format, tokenizer=tokenizer, processor_export=export_processor,
                              max_shard_size=max_shard_size, overwrite=overwrite)
    log.info("exported %s to %s (%s format%s)", src, dst, format, ", with its tokenizer" if tokenizer else "")
    return dst
