"""The run config: nested keyword-only dataclasses, read from YAML with dotted command-line overrides.

    cfg = RunConfig.load("run.yaml", ["train.lr=1e-4", "stages.preset=llava-stage1"])

Unknown keys (in the file or an override) raise with the closest valid key suggested; the
resolved config is saved with the run (`config.yaml`) and in every checkpoint. The `data` section
extends `mmadapt.data.DataConfig`: every data setting of `mmadapt data check` is a `data.` key here.

Paths: in the file a user passes, a relative path (data.train, train.out, ...: `PATH_SETTINGS`) is relative to the
working directory, as a shell reads it. The config a run saves holds them absolute, as they resolved when it was
saved (`RunConfig.resolved`), so that `mmadapt train OUT --resume`, `mmadapt serve OUT --ui` and a notebook find the
same files from any directory; `RunConfig.load(OUT)` reads the config a run saved.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from mmadapt.atomic import open_unlinked
from mmadapt.config import DEFAULT_PARTS
from mmadapt.data.config import DataConfig, about
from mmadapt.lora import COMPONENT_MODES as COMPONENT_MODES  # the sections LoRA loading reads: mmadapt.lora
from mmadapt.lora import STAGE_PRESETS as STAGE_PRESETS
from mmadapt.lora import LoraSection, StagesSection
from mmadapt.precision import FP32, Precision
from mmadapt.quantize import QuantizationSection
from mmadapt.run_directory import CONFIG, RunDirectory
from mmadapt.sections import as_written, build_section

log = logging.getLogger(__name__)

REPORTERS = ("jsonl", "tensorboard", "wandb")  # train.report_to
# The settings that name a file or directory; also each model part's `pretrained` and train.eval_tasks' task YAML files
PATH_SETTINGS = (("model", "pretrained"), ("data", "train"), ("data", "eval"), ("data", "tokenizer"),
                 ("data", "image_root"), ("train", "out"))


@dataclass(kw_only=True)
class ModelSection:
    """Each part is a registry name (built from `preset`) or a mapping {name, preset, options, pretrained, dtype}.

    `pretrained` here is one whole model directory (mmadapt or transformers); per-part `pretrained`
    starts a part from a checkpoint (`model.backbone: {name: qwen3_5, pretrained: Qwen3.5-0.8B}`).
    `deepstack: drop` builds the parts without the encoder's DeepStack levels (`mmadapt.ModelConfig`).
    """

    encoder: str | dict[str, Any] = DEFAULT_PARTS["encoder"]
    projector: str | dict[str, Any] = DEFAULT_PARTS["projector"]
    backbone: str | dict[str, Any] = DEFAULT_PARTS["backbone"]
    preset: str | None = "tiny"
    pretrained: str | None = None
    deepstack: Literal["use", "drop"] = "use"

    def __post_init__(self) -> None:
        parts = self.model_config()  # unknown names, keys and preset + pretrained fail here, at load time
        from_parts = [p for p in ("encoder", "projector", "backbone") if getattr(parts, p).pretrained]
        if self.pretrained and from_parts:
            raise ValueError(f"model.pretrained loads one whole model; it cannot be combined with pretrained parts "
                             f"(model.{from_parts[0]}.pretrained). Use one or the other.")
        if self.pretrained and self.deepstack != "use":
            raise ValueError("model.deepstack applies to a model built from parts; model.pretrained loads a whole "
                             "model as it was saved. To drop the DeepStack levels of a pretrained Qwen3-VL, load its "
                             "parts: model.encoder / projector / backbone: {name: ..., pretrained: DIR}.")

    def model_config(self) -> Any:
        """The parts as a `ModelConfig` (names take `preset`; the projector has options, not presets)."""
        from mmadapt.config import ComponentConfig, ModelConfig

        parts = {part: ComponentConfig.coerce(getattr(self, part), preset=None if part == "projector" else self.preset,
                                              where=f"model.{part}") for part in ("encoder", "projector", "backbone")}
        return ModelConfig(**parts, deepstack=self.deepstack)


@dataclass(frozen=True, kw_only=True)
class DataSection(DataConfig):
    """The run's data: every data setting (`DataConfig`, the same keys as `mmadapt data check`'s flags) and what
    only a run has: the files, the tokenizer, batching, packing, workers and the bad-sample budget."""

    train: str | list[Any] | dict[str, Any] | None = field(default=None, metadata=about(
        "the training set: a LLaVA or messages .json / .jsonl file, a Parquet / Arrow dataset, a list of sources "
        "mixed ({path, weight} or {path, samples} each; mmadapt.data.mixture), or WebDataset shards streamed "
        "({stream: SHARDS, buffer: N}; mmadapt.data.stream)"))
    eval: str | list[Any] | None = field(default=None, metadata=about(
        "an evaluation set, the same formats (a list: the sources one after the other)"))
    tokenizer: str | None = field(default=None, metadata=about(
        "a transformers tokenizer directory; None: the pretrained backbone's (or model's) directory when it holds "
        "tokenizer files, else mmadapt's char tokenizer (with a warning when the backbone is pretrained)"))
    max_bad_fraction: float = field(default=0.2, metadata=about(
        "bad samples (missing image, placeholder mismatch, too long, ...) are skipped, counted and logged (the first "
        "of each reason in full); the run stops once more than this share of the samples seen were bad (after 32, or "
        "at once when every sample so far was bad): `mmadapt data check` the file"))
    batch_size: int = field(default=8, metadata=about("samples per micro-batch and rank"))
    packing: bool = field(default=False, metadata=about("pack samples into rows of max_tokens instead of padding"))
    max_tokens: int = field(default=4096, metadata=about("tokens per packed row"))
    num_workers: int = field(default=0, metadata=about("DataLoader worker processes"))

    def __post_init__(self) -> None:
        super().__post_init__()
        from mmadapt.data.mixture import parse_sources
        from mmadapt.data.stream import stream_source

        for value in (self.train, self.eval):  # a bad source is one error when the config is read, not at a step
            if stream_source(value) is None:
                parse_sources(value)


@dataclass(kw_only=True)
class TrainSection:
    steps: int = 100
    # a registered objective (`mmadapt.train.objectives.OBJECTIVES`, checked when the run is built): sft, next-token
    # loss on the answers; dpo, preference pairs; grpo, online RL from verifiable rewards; ... Its settings are the
    # section of its name (`dpo:`, `grpo:`), parsed by the objective (`RunConfig.sections`)
    objective: str = "sft"
    # the run's length in epochs instead of steps (each epoch: the samples' full global batches); when set, it
    # decides the steps
    epochs: float | None = None
    lr: float = 1e-4
    # learning rates of single parts, e.g. {projector: 2.0e-5, encoder: 2.0e-6} (LLaVA's mm_projector_lr,
    # Qwen-VL's vision lr); the others train at lr
    lr_by_part: dict[str, float] = field(default_factory=dict)
    weight_decay: float = 0.0  # never on biases and norm weights (as transformers' Trainer)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    warmup_ratio: float | None = None  # warmup as a share of the steps (LLaVA: 0.03), instead of warmup_steps
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    grad_accum: int = 1
    clip_grad_norm: float | None = 1.0
    seed: int = 0
    eval_every: int = 0
    # lmms-eval tasks (task names, or task YAML files) the model is evaluated on at each eval step and at the end, in
    # this process, as `mmadapt chat` would answer (`mmadapt.lmms_eval.tasks`; `pip install 'mmadapt[lmms]'`): scores
    # logged as lmms/TASK/METRIC, each step's answers and record in OUT/lmms_eval/
    eval_tasks: list[str] = field(default_factory=list)
    log_every: int = 10
    max_consecutive_skips: int = 5
    # recompute activations in the backward instead of keeping them (non-reentrant, per decoder layer / vision
    # block): a list of parts (backbone, encoder) or "all"; default none
    activation_checkpointing: list[str] | str = field(default_factory=list)
    # the loss from full (B, L, V) logits, as transformers computes it; default: supervised positions only,
    # lm_head + cross-entropy in chunks (`mmadapt.loss`: the same loss and gradients, far less memory)
    full_logits: bool = False
    out: str = "runs/train"
    progress: bool = True
    # where the per-step records go: jsonl (OUT/log.jsonl, always), tensorboard (OUT/tensorboard), wandb (OUT/wandb;
    # WANDB_MODE=offline works without a network)
    report_to: list[str] | str = field(default_factory=lambda: ["jsonl"])
    # a one-time warning when waiting for data takes more than this share of a step
    slow_data_share: float = 0.2
    # the accelerator's peak (bf16 dense TFLOP/s) for MFU; None: from mmadapt.train.tracking.PEAK_TFLOPS by the CUDA
    # device's name (no MFU on a CPU or an unknown device)
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        unknown = sorted(set(names) - set(REPORTERS))
        if unknown:
            raise ValueError(f"train.report_to: unknown {unknown}; known: {list(REPORTERS)}")
        self.report_to = ["jsonl", *[n for n in REPORTERS[1:] if n in names]]
        if not all(isinstance(t, str) and t for t in self.eval_tasks):
            raise ValueError(f"train.eval_tasks must be a list of lmms-eval task names or task YAML files, got "
                             f"{self.eval_tasks!r}")
        if self.steps < 1 or self.grad_accum < 1:
            raise ValueError(f"train.steps ({self.steps}) and train.grad_accum ({self.grad_accum}) must be >= 1")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"train.epochs must be > 0, got {self.epochs}")
        parts = ("encoder", "projector", "backbone")
        unknown = sorted(set(self.lr_by_part) - set(parts))
        if unknown:
            raise ValueError(f"train.lr_by_part has unknown parts {unknown}; parts: {list(parts)}")
        bad = {k: v for k, v in self.lr_by_part.items() if isinstance(v, bool) or not isinstance(v, (int, float))
               or v <= 0}
        if bad:
            raise ValueError(f"train.lr_by_part rates must be numbers > 0, got {bad}")
        checkpointed = [self.activation_checkpointing] if isinstance(self.activation_checkpointing, str) else list(
            self.activation_checkpointing)
        wrong = [p for p in checkpointed if p not in ("all", "backbone", "encoder")]
        if wrong or ("all" in checkpointed and len(checkpointed) > 1):
            raise ValueError("train.activation_checkpointing must be 'all' or a list of parts from [backbone, "
                             f"encoder], got {self.activation_checkpointing!r}")
        if self.warmup_ratio is not None:
            if not 0 <= self.warmup_ratio < 1:
                raise ValueError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
            if self.warmup_steps:
                raise ValueError("give train.warmup_steps or train.warmup_ratio, not both")


@dataclass(kw_only=True)
class PrecisionSection:
    """`policy`: a `mmadapt.precision.Precision` by name (`fp32`, or `bf16-autocast`: bf16 compute, fp32 master
    weights / optimizer state / grad accumulation and reduction), parsed once: readers ask `mode`."""

    policy: str = FP32.name

    def __post_init__(self) -> None:
        Precision.named(self.policy)  # an unknown name fails here, at load time, listing the known ones

    @property
    def mode(self) -> Precision:
        """The policy as an object: its autocast context, dtypes and description."""
        return Precision.named(self.policy)


@dataclass(kw_only=True)
class CheckpointSection:
    every: int = 0  # steps; 0 = only at the end
    keep: int = 2
    resume: bool = False
    # sharded: every rank writes its own shards (torch.distributed.checkpoint), no rank holds the whole state;
    # gathered: the whole state gathered to rank 0 and written by it (one model.safetensors, mmadapt < 0.26's format)
    format: Literal["sharded", "gathered"] = "sharded"
    # `checkpoint.async: true`: the state is copied to host memory and the step loop goes on while it is written
    # (sharded only); at most one save in flight, the run's end waits for it
    async_: bool = field(default=False, metadata={"key": "async"})

    def __post_init__(self) -> None:
        if self.async_ and self.format != "sharded":
            raise ValueError("checkpoint.async: true needs checkpoint.format: sharded (a gathered checkpoint is "
                             "written by rank 0 while the others wait). Fix: drop checkpoint.format: gathered, or "
                             "checkpoint.async")


@dataclass(kw_only=True)
class DistributedSection:
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"  # auto: fsdp when world size > 1
    # every collective gives up after this long (init_process_group's timeout; NCCL's default is 10 minutes): long
    # enough for a checkpoint of a large model (checkpoint.format: gathered: rank 0 writes it while the others wait)
    timeout_minutes: float = 30.0
    # N ranks share each sample's sequence (Ulysses: tokens split across them, heads exchanged around attention and
    # Gated DeltaNet); the world is then world / N data-parallel groups of N consecutive ranks
    sequence_parallel: int = 1
    # how a group's ranks run the vision side: replicated (each encodes the batch's pictures) or sharded (the pictures
    # - images, a video's temporal patches - encoded across the group's ranks and gathered: its activations / N)
    sequence_parallel_vision: Literal["replicated", "sharded"] = "replicated"

    def __post_init__(self) -> None:
        if not self.timeout_minutes > 0:
            raise ValueError(f"distributed.timeout_minutes must be > 0, got {self.timeout_minutes}")
        if isinstance(self.sequence_parallel, bool) or not isinstance(self.sequence_parallel, int) or (
                self.sequence_parallel < 1):
            raise ValueError(f"distributed.sequence_parallel must be an integer >= 1 (ranks sharing each sample), got "
                             f"{self.sequence_parallel!r}")
        if self.sequence_parallel_vision == "sharded" and self.sequence_parallel == 1:
            log.warning("distributed.sequence_parallel_vision: sharded has no effect with "
                        "distributed.sequence_parallel: 1 (no group shares a sample's pictures)")


@dataclass(kw_only=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    stages: StagesSection = field(default_factory=StagesSection)
    lora: LoraSection = field(default_factory=LoraSection)
    quantization: QuantizationSection = field(default_factory=QuantizationSection)  # stages.backbone: qlora's NF4
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    # the objectives' settings by section name (`dpo: {beta: 0.1}`), as written: each is parsed by its objective's
    # own settings class (`Objective.settings_class`, `parse_section`), which names unknown keys as this file does
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunConfig:
        data = dict(data or {})
        _moved_rewards(data)
        fixed = {f.name for f in fields(cls)} - {"sections"}
        sections = {}
        for name in [key for key in data if key not in fixed]:
            typo = difflib.get_close_matches(name, sorted(fixed), n=1, cutoff=0.75)  # objective sections are checked
            if typo:  # by their objective (`check_sections`); a fixed section's typo is named here
                raise ValueError(f"unknown config key '{name}'. Did you mean '{typo[0]}'? Valid keys here: "
                                 f"{sorted(fixed)} and the objectives' sections (dpo, grpo, ...)")
            if not isinstance(data[name], dict | None):
                raise ValueError(f"config section {name} must be a mapping, got {data[name]!r}")
            sections[name] = dict(data.pop(name) or {})
        config = build_section(cls, data, "")
        config.sections = sections
        return config

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as a run file writes them (`data.video` flat, as users write it; each objective's section at
        the top level)."""
        data = plain(as_written(self))
        data["data"]["video"] = self.data.video.to_dict()
        sections = data.pop("sections")
        return {**data, **sections}

    @staticmethod
    def fixed_sections() -> list[str]:
        """The sections every run has (an objective's section is its own)."""
        return [f.name for f in fields(RunConfig) if f.name != "sections"]

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
        """A YAML file (or the defaults) plus `section.key=value` overrides (values parsed as YAML). `path` may be a
        run directory (OUT): the config that run saved, with OUT as its `train.out`, wherever the run was when it
        saved it (a run copied or moved elsewhere is resumed, served and exported where it is now: its data paths
        may stay absolute, its own directory does not); so is the `config.yaml` of a run. Relative paths stay as
        written: relative to the working directory."""
        import yaml

        data: dict[str, Any] = {}
        run = RunDirectory.saving(path) if path is not None else None
        if path is not None and os.path.isdir(path):
            path = RunDirectory(path).config_file
            if not path.is_file():
                raise FileNotFoundError(f"{path.parent} is a directory without a {CONFIG}: give a run config (YAML), "
                                        "or a run directory (a train.out) holding the config its run saved")
        if path is not None:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        if run is not None:
            _located(data, run)
        for override in overrides:
            key, sep, value = override.partition("=")
            if not sep:
                raise ValueError(f"override {override!r} must look like section.key=value (e.g. train.lr=1e-4)")
            set_dotted(data, key.strip(), yaml.safe_load(value))
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as a run records it (OUT/config.yaml, each checkpoint's copy): `resolved()`, its paths
        absolute, so that it names the same files read from any working directory. A link at `path` is refused, never
        written through (`mmadapt.atomic.open_unlinked`)."""
        import yaml

        with open_unlinked(path, "w") as f:
            yaml.safe_dump(self.resolved().to_dict(), f, sort_keys=False)

    def resolved(self) -> RunConfig:
        """This config with every path setting absolute (`~` expanded), as the working directory resolves it now:
        `PATH_SETTINGS`, each model part's `pretrained` and train.eval_tasks' YAML files. An unset data.image_root
        (image paths relative to the working directory) becomes that directory when the run names data files."""
        data = self.to_dict()
        for section, key in PATH_SETTINGS:
            data[section][key] = absolute(data[section][key])
        for part in ("encoder", "projector", "backbone"):
            if isinstance(data["model"][part], dict) and data["model"][part].get("pretrained"):
                data["model"][part]["pretrained"] = absolute(data["model"][part]["pretrained"])
        data["train"]["eval_tasks"] = [absolute(task) if task.endswith((".yaml", ".yml")) else task
                                       for task in data["train"]["eval_tasks"]]
        if data["data"]["image_root"] is None and (data["data"]["train"] or data["data"]["eval"]):
            data["data"]["image_root"] = os.getcwd()
        return RunConfig.from_dict(data)


def _moved_rewards(data: dict[str, Any]) -> None:
    """`train.rewards` (before 0.24) read as `grpo.rewards`, where GRPO's settings are: once, at the boundary."""
    train = data.get("train")
    if not isinstance(train, dict) or "rewards" not in train:
        return
    data["train"] = {k: v for k, v in train.items() if k != "rewards"}
    if not train["rewards"]:
        return
    grpo = data.setdefault("grpo", {}) or {}
    if not isinstance(grpo, dict) or grpo.get("rewards"):
        raise ValueError("the config sets both train.rewards and grpo.rewards: keep grpo.rewards (train.rewards is its "
                         "name before 0.24)")
    data["grpo"] = {**grpo, "rewards": train["rewards"]}
    log.warning("train.rewards is now grpo.rewards: read as grpo.rewards=%s", train["rewards"])


def parse_section(cls: type, data: Any, where: str) -> Any:
    """A section of the config as the dataclass `cls` (an objective's settings): unknown keys raise with the closest
    valid key suggested, values are coerced as the run config's are; `where` is the section's prefix ("dpo.")."""
    return build_section(cls, data or {}, where)


def _located(data: dict[str, Any], run: RunDirectory) -> None:
    """`data` (a run's saved config) with `train.out` = where the run is now (`RunConfig.load`), said when it moved."""
    train = data.setdefault("train", {})
    if not isinstance(train, dict):
        raise ValueError(f"{run.config_file}: its train section is {type(train).__name__}, not a mapping")
    saved, here = train.get("out"), os.path.abspath(run.path)
    if saved is not None and os.path.abspath(os.path.expanduser(str(saved))) != here:
        log.info("%s was saved by the run at %s; this run is %s, and its files are written there", run.config_file,
                 saved, here)
    train["out"] = os.fspath(run.path)


def absolute(path: Any) -> Any:
    """`path` made absolute against the working directory (None stays None); a list of sources (`data.train` as a
    mixture), each source's path."""
    if isinstance(path, list | tuple):
        return [absolute(p) if not isinstance(p, dict) else {**p, "path": absolute(p.get("path"))} for p in path]
    if isinstance(path, dict):  # a stream ({stream: SHARDS, buffer: N})
        return {**path, "stream": absolute(path.get("stream"))}
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {key!r}: {part!r} is not a section")
    node[last] = value


def plain(value: Any) -> Any:
    """Plain YAML values: mappings and lists of them, tuples as lists."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
