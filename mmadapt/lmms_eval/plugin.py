"""`--model mmadapt`: `MmadaptModel`, a trained model from disk as an lmms-eval chat model (the package docstring,
`mmadapt.lmms_eval`, lists its `--model_args`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from mmadapt.inference import load_for_inference
from mmadapt.lmms_eval.model import LmmsChatModel
from mmadapt.processor import Processor

log = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    """`MANIFEST`, the entry point (`mmadapt.lmms_eval.plugin:MANIFEST`), built when first asked for: lmms-eval's model
    registry loads this entry point when it is imported, and would find this module half-imported otherwise."""
    if name == "MANIFEST":
        from lmms_eval.models.registry_v2 import ModelManifest

        manifest = ModelManifest(model_id="mmadapt", chat_class_path="mmadapt.lmms_eval.plugin.MmadaptModel")
        globals()["MANIFEST"] = manifest  # one object, however often it is asked for
        return manifest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
