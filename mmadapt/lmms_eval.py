"""The lmms-eval plugin: `lmms-eval eval --model mmadapt --model_args pretrained=DIR --tasks TASKS`.

lmms-eval 0.7 finds outside models through the entry-point group `lmms_eval.models`: mmadapt's entry point `mmadapt`
(pyproject.toml) is `MANIFEST`, a `ModelManifest` naming `MmadaptModel` as the chat implementation of `--model
mmadapt`. Installed with the optional extra: `pip install 'mmadapt[lmms]'`; nothing in mmadapt imports this module.

`MmadaptModel` loads `pretrained` as `mmadapt chat` does (`load_for_inference`: a model directory, a run, a
checkpoint, a run's adapters directory, or a base model with `adapters=DIR`) and answers lmms-eval's chat requests
with `mmadapt.train.lmms.LmmsChatModel` (the model's own chat template and processor, batched generation, the task's
decoding settings; its `record` says what decides the scores). Its `--model_args`:

    pretrained=DIR        the model (required); adapters=DIR: LoRA adapters merged into it
    device=cuda:0         default: the CUDA device of LOCAL_RANK when there is one, else the CPU
    max_new_tokens=256    when a task sets none
    system_prompt=TEXT    the system message of requests whose task gives none (a file path: its text)
    seed=0                for tasks that sample without a seed
    chat_template=auto    auto (the model's own), tokenizer, or a built-in name (mmadapt list)
    template_kwargs=JSON  e.g. '{"enable_thinking": false}'
    max_length=2048       tokens per prompt, image and video tokens included
    record=PATH           write the record (what decides the scores) there as JSON after generating

and lmms-eval's own `--batch_size N` (requests generated together; an integer). `MmadaptModel.from_model(model,
tokenizer)` is the same chat model over a model in memory (`LmmsChatModel.from_model`), for
`lmms_eval.evaluator.simple_evaluate(model=...)` in a notebook or a training loop.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from lmms_eval.models.registry_v2 import ModelManifest

from mmadapt.inference import load_for_inference
from mmadapt.processor import Processor
from mmadapt.train.lmms import LmmsChatModel

log = logging.getLogger(__name__)

MANIFEST = ModelManifest(model_id="mmadapt", chat_class_path="mmadapt.lmms_eval.MmadaptModel")


class MmadaptModel(LmmsChatModel):
    """`--model mmadapt`: a trained model from disk as an lmms-eval chat model (module docstring)."""

    def __init__(self, pretrained: str | None = None, adapters: str | None = None, *, batch_size: int | str = 1,
                 max_batch_size: int | None = None, device: str | None = None, max_new_tokens: int = 256,
                 system_prompt: str | None = None, seed: int = 0, chat_template: str = "auto",
                 template_kwargs: str | dict[str, Any] | None = None, max_length: int | None = None,
                 record: str | None = None, **unknown: Any) -> None:
        if unknown:
            raise TypeError(f"--model mmadapt takes no model_args {sorted(unknown)}; its model_args: pretrained, "
                            "adapters, device, max_new_tokens, system_prompt, seed, chat_template, template_kwargs, "
                            "max_length, record (and lmms-eval's --batch_size)")
        if pretrained is None:
            raise ValueError("--model mmadapt needs --model_args pretrained=DIR (a model directory, a run, a "
                             "checkpoint or a run's adapters directory)")
        if max_batch_size is not None:
            log.warning("--max_batch_size %s has no effect: --model mmadapt generates --batch_size requests at a time",
                        max_batch_size)
        model, tokenizer = load_for_inference(pretrained, adapters)
        self.device = torch.device(device) if device is not None else default_device()
        model.to(self.device).eval()
        data: dict[str, Any] = {"chat_template": chat_template, "template_kwargs": parse_kwargs(template_kwargs)}
        if max_length is not None:
            data["max_length"] = int(max_length)
        source = str(Path(pretrained).resolve()) + (f" + adapters {Path(adapters).resolve()}" if adapters else "")
        super().__init__(model, Processor.for_model(model, tokenizer, **data), source=source,
                         batch_size=parse_batch_size(batch_size), max_new_tokens=int(max_new_tokens),
                         system_prompt=self._resolve_system_prompt(system_prompt) if system_prompt else None,
                         seed=int(seed), record_path=record)


def default_device() -> torch.device:
    """This process's CUDA device (LOCAL_RANK's, for `accelerate launch`) when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def parse_batch_size(value: int | str) -> int:
    """lmms-eval's `--batch_size` (a string on its command line) as an integer >= 1."""
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--batch_size {value!r}: --model mmadapt takes an integer >= 1 (no 'auto')")
    return int(text)


def parse_kwargs(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """`template_kwargs` from `--model_args` (JSON text) or Python (a dict)."""
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"template_kwargs={value!r} is not JSON; give e.g. template_kwargs='{{\"enable_thinking\": "
                         "false}'") from e
    if not isinstance(parsed, dict):
        raise ValueError(f"template_kwargs must be a JSON object, got {value!r}")
    return parsed
