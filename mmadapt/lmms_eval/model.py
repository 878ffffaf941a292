"""lmms-eval's chat model over a model in memory: `LmmsChatModel` (what `--model mmadapt` and a run's
`train.eval_tasks` answer with).

lmms-eval (the optional extra `mmadapt[lmms]`) is imported by this module. It takes a model and a processor, never a
path (`mmadapt.lmms_eval.plugin` loads one from disk; `mmadapt.lmms_eval.tasks` evaluates a training run's model).

`LmmsChatModel` is an lmms-eval chat model (`is_simple = False`). Its `generate_until` takes lmms-eval's chat
requests, `(ctx, doc_to_messages, gen_kwargs, doc_id, task, split)`, and answers each by the one answering function
(`mmadapt.answering.answer_prompts`, batched: what `mmadapt chat` and the server run): the task's messages (system /
user / assistant, text / image / video parts) through mmadapt's `Processor` - the model's own chat template with its
`template_kwargs`, its image processor and pixel budget, as in training -, then generation, decoding, stop strings
and the end cut as everywhere. Requests are grouped by their sampling settings and batched by similar prompt length.
A task's `gen_kwargs` become a `Sampling` (`task_sampling`): `max_new_tokens`, `temperature` / `do_sample` (greedy
unless the task samples), `top_p`, `seed`, `repetition_penalty` and `until` (`Sampling.stop`: the answer is cut
before the first stop string); `num_beams` > 1 and `top_k` raise, and keys that do not change decoding here are
ignored with a warning, once per task. A request that cannot become a prompt is answered "" and recorded
(`problems`), never stopping the evaluation. `loglikelihood` and `generate_until_multi_round` raise and say what to
use instead.

Each score can be traced to what decides it: `record` holds mmadapt's and lmms-eval's versions, the model's source and
checksum (SHA-256 of its state dict as evaluated: every parameter and buffer's name, dtype, shape and bytes, in name
order; taken again at each `generate_until` call, so a training run's record names the weights of that step), the
chat template (name, SHA-256 of the Jinja text in use, `template_kwargs`), the system prompt, the image processor
(its pixel budget) and limits, and the decoding settings each task ran with. The checksum reads every byte of the
weights once per evaluation (SHA-256 runs at about 1 GB/s on one CPU core: seconds for a 7B model in bf16, small
beside the evaluation itself).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

try:
    from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
    from lmms_eval.api.model import lmms
except ImportError as e:  # the optional extra
    raise ImportError(f"lmms-eval evaluation (train.eval_tasks, --model mmadapt) needs lmms-eval: pip install "
                      f"'mmadapt[lmms]' ({e})") from e

from mmadapt.answering import PromptInputs, answer_prompts
from mmadapt.processor import Processor
from mmadapt.sampling import Sampling
from mmadapt.version import __version__

log = logging.getLogger(__name__)

# gen_kwargs lmms-eval tasks pass that do not change how mmadapt decodes at these values
NEUTRAL = {"num_beams": (1, None), "top_k": (0, None), "use_cache": (True, False, None),
           "repetition_penalty": (1, 1.0, None)}


def task_sampling(gen_kwargs: dict[str, Any] | None, *, max_new_tokens: int, seed: int,
                task: str) -> tuple[Sampling, list[str]]:
    """The `Sampling` a task's `gen_kwargs` ask for (the model's `max_new_tokens` and `seed` where the task sets
    none; `until` is `Sampling.stop`), and the keys ignored (they do not change decoding here)."""
    given = dict(gen_kwargs or {})
    for key in ("num_beams", "top_k"):
        if given.get(key) not in NEUTRAL[key]:
            raise ValueError(f"task {task!r} asks for {key}={given[key]!r}, which mmadapt's generation does not "
                             "do (greedy or top-p sampling only). Fix: override it, e.g. lmms-eval --gen_kwargs "
                             f"{key}={NEUTRAL[key][0]}")
    sample = given.get("do_sample")
    temperature = float(given.get("temperature") or 0.0) if sample is not False else 0.0
    if sample is True and "temperature" not in given:
        temperature = 1.0  # transformers' default for do_sample without a temperature
    until = given.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(u for u in until if u)
    sampling = Sampling(max_new_tokens=int(given.get("max_new_tokens") or max_new_tokens), temperature=temperature,
                        top_p=float(1.0 if given.get("top_p") is None else given["top_p"]),
                        repetition_penalty=float(given.get("repetition_penalty") or 1.0),
                        seed=int(given.get("seed") if given.get("seed") is not None else seed), stop=until)
    known = {"max_new_tokens", "temperature", "do_sample", "top_p", "repetition_penalty", "seed", "until"}
    return sampling, sorted(k for k in given if k not in known and k not in NEUTRAL)


class LmmsChatModel(lmms):
    """An lmms-eval chat model over `model` with `processor` (module docstring): `simple_evaluate(model=this)`.

    `source` names the model in the record (a directory, or a run and step); `batch_size` requests are generated
    together; `max_new_tokens` applies when a task sets none; `system_prompt` becomes the system message of every
    request whose messages have none; `seed` seeds sampling when a task samples without a seed; `record_path`, when
    given, receives `record` as JSON after each `generate_until` call.
    """

    is_simple = False

    def __init__(self, model: Any, processor: Processor, *, source: str, batch_size: int = 1,
                 max_new_tokens: int = 256, system_prompt: str | None = None, seed: int = 0,
                 record_path: str | os.PathLike | None = None) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        self.model, self.processor, self.source = model, processor, source
        self.batch_size, self.max_new_tokens, self.seed = batch_size, max_new_tokens, seed
        self.system_prompt = system_prompt or None
        self.record_path = Path(record_path) if record_path is not None else None
        self.tasks: dict[str, dict[str, Any]] = {}  # task -> its decoding, ignored keys, requests
        self.checksum: str | None = None

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, *, data: Any = None, source: str = "in-memory model",
                   **settings: Any) -> LmmsChatModel:
        """The chat model of an in-memory `model` and its `tokenizer`, with the data settings `data` (a
        `DataConfig` or a run's data section: the chat template, `template_kwargs`, `max_length`, ...) and the
        `LmmsChatModel` settings (`batch_size`, `max_new_tokens`, ...). The model stays where it is (its device,
        dtype and mode) and is not copied: a training run evaluates the weights it is training."""
        model_settings = {k: settings.pop(k) for k in list(settings) if k in LMMS_SETTINGS}
        processor = Processor.for_model(model, tokenizer, config=data, **settings)
        return LmmsChatModel(model, processor, source=source, **model_settings)

    # ---- what lmms-eval calls ------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """One answer per request, in the requests' order."""
        self.checksum, self.tasks = state_sha256(self.model), {}  # the record describes this evaluation
        plans = [self.plan(request) for request in requests]
        results: list[GenerationResult | None] = [None] * len(requests)
        for batch in self.batches(requests, plans):
            for k, result in zip(batch, self.answer([requests[k] for k in batch], plans[batch[0]]), strict=True):
                results[k] = result
        if self.record_path is not None:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            self.record_path.write_text(json.dumps(self.record, indent=1))
        return results

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        task = requests[0].task_name if requests else "?"
        raise NotImplementedError(
            f"mmadapt's lmms-eval model generates answers (generate_until); task {task!r} asks for log-likelihoods "
            "(multiple_choice), which it does not compute. Use the task's generate_until variant (the choices in the "
            "prompt, the answer scored), or evaluate the transformers export (mmadapt export --format transformers) "
            "with a transformers-backed lmms-eval model that computes log-likelihoods (e.g. --model llava_hf).")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        task = requests[0].task_name if requests else "?"
        raise NotImplementedError(
            f"mmadapt's lmms-eval model answers single-round requests (generate_until); task {task!r} is "
            "multi-round (generate_until_multi_round). Evaluate the transformers export (mmadapt export --format "
            "transformers) with lmms-eval's --model vllm, which runs multi-round tasks.")

    def clean(self) -> None:
        """lmms-eval calls this after generating; the default drops the model, which a caller (a training run, a
        notebook evaluating again) still uses, so the model is kept."""

    # ---- requests -> batches -> answers ---------------------------------------------------------------------------
    def plan(self, request: Instance) -> Sampling:
        """The request's sampling; the first request of a task records it (and warns of ignored keys)."""
        if len(request.args) != 6 or not callable(request.args[1]):
            raise ValueError(
                f"task {request.task_name!r} sent a plain (non-chat) request: lmms-eval 0.7 builds a task given as a "
                "config or as a YAML file path as a plain task, which chat models cannot answer. Give the task by "
                "name with its directory: lmms-eval --include_path DIR --tasks NAME, or simple_evaluate(tasks=[NAME], "
                "task_manager=TaskManager(include_path=DIR))")
        _, _, gen_kwargs, _, task, _ = request.args
        decoding, ignored = task_sampling(gen_kwargs, max_new_tokens=self.max_new_tokens, seed=self.seed, task=task)
        entry = self.tasks.setdefault(task, {"decoding": asdict(decoding), "ignored_gen_kwargs": ignored,
                                             "requests": 0, "with_own_system_message": 0})
        if entry["requests"] == 0 and ignored:
            log.warning("task %r: gen_kwargs %s do not change mmadapt's decoding and are ignored", task, ignored)
        if entry["decoding"] != asdict(decoding):
            entry["decoding"] = "differs between requests"
        entry["requests"] += 1
        return decoding

    def batches(self, requests: list[Instance], plans: list[Sampling]) -> Iterator[list[int]]:
        """Request indices, `batch_size` at a time: one sampling per batch, similar prompt lengths together."""
        groups: dict[Sampling, list[int]] = {}
        for k, plan in enumerate(plans):
            groups.setdefault(plan, []).append(k)
        for members in groups.values():
            members.sort(key=lambda k: -len(str(requests[k].args[0])))  # ctx: the task's text context
            for start in range(0, len(members), self.batch_size):
                yield members[start:start + self.batch_size]

    def answer(self, requests: list[Instance], sampling: Sampling) -> list[GenerationResult]:
        """The answers of one batch (one sampling), by `answer_prompts`. A request that cannot become a prompt (a part
        mmadapt does not read, a bad image, a prompt over max_length, a template that refuses it: a `ValueError` /
        `TypeError`) is answered "" (scored as such), logged and listed under its task's `problems` in the record;
        the other requests of its batch are answered, so a bad sample never stops an evaluation or a training run."""
        try:
            prompt = PromptInputs.batch(self.model, self.processor, [self.conversation(r) for r in requests])
        except (ValueError, TypeError) as e:
            if len(requests) > 1:  # find which: each request alone
                return [result for request in requests for result in self.answer([request], sampling)]
            return [self.problem(requests[0], e)]
        return [GenerationResult(text=answer.text, token_counts=TokenCounts(
                    input_tokens=answer.usage.prompt_tokens, output_tokens=answer.usage.completion_tokens))
                for answer in answer_prompts(self.model, self.processor, prompt, sampling=sampling)]

    def problem(self, request: Instance, error: Exception) -> GenerationResult:
        """The answer "" to a request that could not be asked, recorded under its task's `problems`."""
        _, _, _, doc_id, task, _ = request.args
        self.tasks[task].setdefault("problems", {})[str(doc_id)] = f"{type(error).__name__}: {error}"
        log.warning("lmms-eval request %s[%s] could not be asked; answered \"\" (%s: %s)", task, doc_id,
                    type(error).__name__, error)
        return GenerationResult(text="", token_counts=TokenCounts(output_tokens=0))

    def conversation(self, request: Instance) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
        """The request's messages as the Processor takes them (parts `{"type": "image"}` / `{"type": "video"}` in
        place), with their images and videos in order; the system prompt first when the task gives none."""
        _, doc_to_messages, _, doc_id, task, split = request.args
        raw = doc_to_messages(self.task_dict[task][split][doc_id])
        messages, images, videos = [], [], []
        for k, message in enumerate(raw):
            content = message.get("content")
            if isinstance(content, str):
                messages.append({"role": message["role"], "content": content})
                continue
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image", "video"):
                    (images if kind == "image" else videos).append(media(part, kind, f"{task}[{doc_id}]"))
                    parts.append({"type": kind})
                else:
                    raise ValueError(f"lmms-eval request {task}[{doc_id}]: message {k} has a {kind!r} part; mmadapt "
                                     "models read text, images and videos")
            messages.append({"role": message["role"], "content": parts})
        if messages and messages[0]["role"] == "system":
            self.tasks[task]["with_own_system_message"] += 1
        elif self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages, images, videos

    # ---- what decides the scores ---------------------------------------------------------------------------------
    @property
    def record(self) -> dict[str, Any]:
        """What decides this model's scores (module docstring), as plain JSON values."""
        from importlib.metadata import version

        encoder, tokenizer = self.processor.encoder, self.processor.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        video = encoder.config.video
        return {
            "mmadapt_version": __version__, "lmms_eval_version": version("lmms_eval"),
            "model": {"source": self.source, "sha256": self.checksum,
                      "sha256_of": "the state dict as evaluated (names, dtypes, shapes, bytes; in name order)",
                      "dtypes": sorted({str(p.dtype) for p in self.model.parameters()})},
            "template": {"name": encoder.template.name, "kwargs": dict(encoder.config.template_kwargs),
                         "jinja_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None},
            "system_prompt": self.system_prompt,
            "image_processor": repr(encoder.processor), "max_image_pixels": encoder.config.max_image_pixels,
            "video": video.to_dict() if encoder.video_processor is not None else None,
            "max_length": encoder.config.max_length,
            "generation": {"batch_size": self.batch_size, "max_new_tokens": self.max_new_tokens, "seed": self.seed,
                           "by_task": self.tasks},
        }


# LmmsChatModel's own settings (the rest of `from_model`'s keywords are data settings)
LMMS_SETTINGS = ("batch_size", "max_new_tokens", "system_prompt", "seed", "record_path")


def media(part: dict[str, Any], kind: str, where: str) -> Any:
    """An lmms-eval image or video part's content: a PIL image or a path (a video: a file or a list of frames)."""
    value = part.get("url", part.get(kind))
    if isinstance(value, dict):
        raise ValueError(f"lmms-eval request {where}: a {kind} with clip metadata ({sorted(value)}); mmadapt reads "
                         f"whole {kind}s (a file, frames or an image)")
    if value is None:
        raise ValueError(f"lmms-eval request {where}: a {kind} part without its {kind}")
    return value


def state_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of `model`'s state dict: each entry's name, dtype and shape, then its bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(value.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return digest.hexdigest()
