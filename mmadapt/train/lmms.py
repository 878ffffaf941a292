"""lmms-eval over a model in memory: `LmmsChatModel`, and `evaluate_tasks` for a run's `train.eval_tasks`.

lmms-eval (the optional extra `mmadapt[lmms]`) is imported by this module, which nothing imports until it is used:
`mmadapt.lmms_eval` (the `--model mmadapt` plugin, `pretrained=DIR`) builds on it, and the trainer imports it only
when `train.eval_tasks` is set. It sits below the trainer, so it takes a model and a tokenizer, never a path.

`LmmsChatModel` is an lmms-eval chat model (`is_simple = False`). Its `generate_until` takes lmms-eval's chat
requests, `(ctx, doc_to_messages, gen_kwargs, doc_id, task, split)`, and answers each with the library's batched
generation: the task's messages (system / user / assistant, text / image / video parts) through mmadapt's
`Processor` - the model's own chat template with its `template_kwargs`, its image processor and pixel budget, as in
training - then `model.generate`, in eval mode (the model's modes restored after). Requests are grouped by their
decoding settings and batched by similar prompt length. From the task's `gen_kwargs` it honours `max_new_tokens`,
`temperature` / `do_sample` (greedy unless the task samples), `top_p`, `seed`, `repetition_penalty` and `until`
(the answer is cut before the first stop string); `num_beams` > 1 and `top_k` raise, and keys that do not change
decoding here are ignored with a warning, once per task. A request that cannot become a prompt is answered "" and
recorded (`problems`), never stopping the evaluation. `loglikelihood` and `generate_until_multi_round` raise and say
what to use instead.

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
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
    from lmms_eval.api.model import lmms
except ImportError as e:  # the optional extra
    raise ImportError(f"lmms-eval evaluation (train.eval_tasks, --model mmadapt) needs lmms-eval: pip install "
                      f"'mmadapt[lmms]' ({e})") from e

from mmadapt.modes import eval_mode
from mmadapt.processor import Processor
from mmadapt.version import __version__

log = logging.getLogger(__name__)

# gen_kwargs lmms-eval tasks pass that do not change how mmadapt decodes at these values
NEUTRAL = {"num_beams": (1, None), "top_k": (0, None), "use_cache": (True, False, None),
           "repetition_penalty": (1, 1.0, None)}


@dataclass(frozen=True)
class Decoding:
    """How one request is answered, resolved from its task's `gen_kwargs` and the model's defaults."""

    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    repetition_penalty: float
    seed: int
    until: tuple[str, ...]

    @classmethod
    def resolve(cls, gen_kwargs: dict[str, Any], *, max_new_tokens: int, seed: int,
                task: str) -> tuple[Decoding, list[str]]:
        """The decoding `gen_kwargs` ask for, and the keys ignored (they do not change decoding here)."""
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
        decoding = cls(max_new_tokens=int(given.get("max_new_tokens") or max_new_tokens), temperature=temperature,
                       top_p=float(1.0 if given.get("top_p") is None else given["top_p"]),
                       repetition_penalty=float(given.get("repetition_penalty") or 1.0),
                       seed=int(given.get("seed") if given.get("seed") is not None else seed), until=until)
        known = {"max_new_tokens", "temperature", "do_sample", "top_p", "repetition_penalty", "seed", "until"}
        return decoding, sorted(k for k in given if k not in known and k not in NEUTRAL)

    def cut(self, text: str) -> str:
        """`text` up to the first stop string (`until`), which is not part of the answer."""
        ends = [i for i in (text.find(stop) for stop in self.until) if i >= 0]
        return text[:min(ends)] if ends else text


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
    def plan(self, request: Instance) -> Decoding:
        """The request's decoding; the first request of a task records it (and warns of ignored keys)."""
        if len(request.args) != 6 or not callable(request.args[1]):
            raise ValueError(
                f"task {request.task_name!r} sent a plain (non-chat) request: lmms-eval 0.7 builds a task given as a "
                "config or as a YAML file path as a plain task, which chat models cannot answer. Give the task by "
                "name with its directory: lmms-eval --include_path DIR --tasks NAME, or simple_evaluate(tasks=[NAME], "
                "task_manager=TaskManager(include_path=DIR))")
        _, _, gen_kwargs, _, task, _ = request.args
        decoding, ignored = Decoding.resolve(gen_kwargs, max_new_tokens=self.max_new_tokens, seed=self.seed, task=task)
        entry = self.tasks.setdefault(task, {"decoding": asdict(decoding), "ignored_gen_kwargs": ignored,
                                             "requests": 0, "with_own_system_message": 0})
        if entry["requests"] == 0 and ignored:
            log.warning("task %r: gen_kwargs %s do not change mmadapt's decoding and are ignored", task, ignored)
        if entry["decoding"] != asdict(decoding):
            entry["decoding"] = "differs between requests"
        entry["requests"] += 1
        return decoding

    def batches(self, requests: list[Instance], plans: list[Decoding]) -> Iterator[list[int]]:
        """Request indices, `batch_size` at a time: one decoding per batch, similar prompt lengths together."""
        groups: dict[Decoding, list[int]] = {}
        for k, plan in enumerate(plans):
            groups.setdefault(plan, []).append(k)
        for members in groups.values():
            members.sort(key=lambda k: -len(str(requests[k].args[0])))  # ctx: the task's text context
            for start in range(0, len(members), self.batch_size):
                yield members[start:start + self.batch_size]

    def answer(self, requests: list[Instance], decoding: Decoding) -> list[GenerationResult]:
        """Generate the answers of one batch (one decoding). A request that cannot become a prompt (a part mmadapt
        does not read, a bad image, a prompt over max_length, a template that refuses it: a `ValueError` /
        `TypeError`) is answered "" (scored as such), logged and listed under its task's `problems` in the record;
        the other requests of its batch are answered, so a bad sample never stops an evaluation or a training run."""
        try:
            conversations = [self.conversation(request) for request in requests]
            inputs = self.processor([c[0] for c in conversations], images=[c[1] for c in conversations],
                                    videos=[c[2] for c in conversations])
        except (ValueError, TypeError) as e:
            if len(requests) > 1:  # find which: each request alone
                return [result for request in requests for result in self.answer([request], decoding)]
            return [self.problem(requests[0], e)]
        device = next(self.model.parameters()).device
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        generator = torch.Generator(device=device).manual_seed(decoding.seed)
        extra = {"repetition_penalty": decoding.repetition_penalty} if decoding.repetition_penalty != 1.0 else {}
        with eval_mode(self.model):
            out = self.model.generate(**inputs, max_new_tokens=decoding.max_new_tokens,
                                      eos_token_id=self.processor.eos_token_ids,
                                      pad_token_id=self.processor.encoder.pad_token_id,
                                      temperature=decoding.temperature, top_p=decoding.top_p, generator=generator,
                                      **extra)
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        return [self.result(row, decoding, prompt) for row, prompt in zip(out.tolist(), prompt_tokens, strict=True)]

    def result(self, ids: list[int], decoding: Decoding, prompt_tokens: int) -> GenerationResult:
        """A generated row (new tokens, padded after the end) as the answer text, cut at the stop strings."""
        ends = set(self.processor.eos_token_ids)
        end = next((k + 1 for k, token in enumerate(ids) if token in ends), len(ids))
        text = decoding.cut(self.processor.decode(ids[:end]))
        return GenerationResult(text=text, token_counts=TokenCounts(input_tokens=int(prompt_tokens),
                                                                    output_tokens=end))

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


# ---- a run's train.eval_tasks ------------------------------------------------------------------------------------
def check_eval_tasks(tasks: Sequence[str], *, world: int, tokenizer: Any) -> None:
    """Before training starts: `train.eval_tasks` can run (one process, a tokenizer, each task found)."""
    if world > 1:
        raise ValueError(f"train.eval_tasks runs in one process, and this run has {world}: evaluate the run's model "
                         "afterwards with `lmms-eval eval --model mmadapt --model_args pretrained=OUT/model` "
                         "(docs/lmms_eval.md), or drop train.eval_tasks")
    if tokenizer is None:
        raise ValueError("train.eval_tasks needs the run's tokenizer: Trainer(..., tokenizer=tokenizer)")
    names, include = task_names(tasks)
    known = task_manager(include, defaults=len(include) < len(tasks)).all_tasks
    for task, name in zip(tasks, names, strict=True):
        if name not in known:
            raise ValueError(f"train.eval_tasks: lmms-eval knows no task {name!r}"
                             + (f" (from {task})" if task != name else "")
                             + "; give a task name (lmms-eval tasks list) or a task YAML file")


def evaluate_tasks(model: Any, tokenizer: Any, config: Any, *, step: int, out: str | os.PathLike) -> dict[str, float]:
    """Evaluate the in-memory `model` on the run's `train.eval_tasks`: {"lmms/TASK/METRIC": value} for the run's log.

    The model is answered as `mmadapt chat` would answer its export (the run's data settings: chat template,
    `template_kwargs`, `max_length`; `data.batch_size` requests at a time). The whole result - scores, each sample's
    answer, and the record of what decides the scores - is written to `OUT/lmms_eval/step-N.json`. lmms-eval's seeds
    and answer post-processing are its command line's (`cli_defaults`), and the process's random states (Python,
    NumPy, torch) are restored after, so evaluating does not change the training that follows."""
    from lmms_eval.evaluator import simple_evaluate

    path = Path(out) / "lmms_eval" / f"step-{step:07d}.json"
    lm = LmmsChatModel.from_model(model, tokenizer, data=config.data, source=f"run {out}, step {step} (in memory)",
                                  batch_size=config.data.batch_size)
    lm.accelerator = None  # lmms-eval would create an accelerate `Accelerator` in the training process otherwise
    names, include = task_names(config.train.eval_tasks)
    manager = task_manager(include, defaults=len(include) < len(names))
    with kept_random_states():
        results = simple_evaluate(model=lm, tasks=names, task_manager=manager, verbosity="WARNING",
                                  cli_args=cli_defaults())
    scores = {f"lmms/{task}/{name}": value for task, metrics in results["results"].items()
              for name, value in metric_values(metrics).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "scores": scores, "record": lm.record,
                                "results": results["results"], "configs": results.get("configs"),
                                "samples": answers(results.get("samples", {}))}, indent=1, default=str))
    log.info("step %d lmms-eval: %s (%s)", step, ", ".join(f"{k} {v:.4g}" for k, v in scores.items()), path)
    return scores


def task_names(tasks: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    """`train.eval_tasks` as lmms-eval task names, and the directories of the task files among them, to be indexed as
    `lmms-eval --include_path DIR` indexes them: lmms-eval 0.7 builds chat tasks only from indexed names (a task
    given as a config becomes a plain task, which a chat model cannot answer)."""
    from lmms_eval import utils

    names, include = [], []
    for task in tasks:
        if not task.endswith((".yaml", ".yml")):
            names.append(task)
            continue
        if not Path(task).is_file():
            raise FileNotFoundError(f"train.eval_tasks: task file {task} does not exist")
        config = utils.load_yaml_config(task, mode="simple")
        name = config.get("task") if isinstance(config.get("task"), str) else config.get("group")
        if not isinstance(name, str):
            raise ValueError(f"train.eval_tasks: {task} names no task (its `task:` or `group:` key)")
        names.append(name)
        include.append(str(Path(task).resolve().parent))
    return names, tuple(dict.fromkeys(include))


def cli_defaults() -> Any:
    """lmms-eval's command-line defaults (among them `reasoning_tags`: thinking blocks are stripped from answers
    before scoring), so that a training run scores answers as `lmms-eval eval` does. Its parser reads `sys.argv`,
    which is this process's own: it is given lmms-eval's bare command line while it parses."""
    import sys

    from lmms_eval.__main__ import parse_eval_args

    argv, sys.argv = sys.argv, ["lmms-eval"]
    try:
        return parse_eval_args()[1]
    finally:
        sys.argv = argv


def metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    """lmms-eval's "METRIC,FILTER" numbers as "METRIC" (filter "none") or "METRIC/FILTER"; no stderr, no alias."""
    out = {}
    for key, value in metrics.items():
        name, _, kept = key.partition(",")
        if not kept or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name if kept == "none" else f"{name}/{kept}"] = float(value)
    return out


def answers(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each task's samples as {doc_id, target, answer}: what was asked is in the task's data."""
    return {task: [{"doc_id": s.get("doc_id"), "target": s.get("target"),
                    "answer": (s.get("filtered_resps") or [None])[0]} for s in rows] for task, rows in samples.items()}


_TASK_MANAGERS: dict[tuple[tuple[str, ...], bool], Any] = {}


def task_manager(include: tuple[str, ...] = (), *, defaults: bool = True) -> Any:
    """lmms-eval's index of the tasks under the `include` directories and, with `defaults`, of its own (built once
    per process for each: indexing lmms-eval's own reads every task file it ships, seconds)."""
    key = (include, defaults)
    if key not in _TASK_MANAGERS:
        import lmms_eval.models  # noqa: F401  (sets lmms-eval's log to WARNING; indexing logs every file at DEBUG)
        from lmms_eval.tasks import TaskManager

        _TASK_MANAGERS[key] = TaskManager("WARNING", include_path=list(include) or None, include_defaults=defaults,
                                          model_name="mmadapt")
    return _TASK_MANAGERS[key]


@contextmanager
def kept_random_states() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and CUDA) random states as they were before the block."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
