"""Weights from checkpoints, as the hub ships them: find the files, read only a part's tensors, load strictly.

Every component family loads itself (`ClipEncoder.from_pretrained`, `BackboneSpec.from_pretrained`, ...)
with the three pieces here:

- `Checkpoint.open(path)`: a directory (its `config.json` and weight files: safetensors or `.bin`,
  single or sharded through `*.index.json`) or a single weight file. Keys are listed from headers;
  tensors are read lazily and memory-mapped (safetensors, `torch.load(mmap=True, weights_only=True)`),
  so reading one part of a composite checkpoint touches only that part's bytes. A sharded training checkpoint
  (`mmadapt.sharded_checkpoint`: DCP shards in `state/`) is one too: its `files` are the state's files, its keys the
  model's tensors, read through `ModelTensors` (allow-listed, a batch of up to `SHARDED_BATCH_BYTES` at a time).
- `empty_weights()`: build a module with its parameters on the meta device (no random init, no
  memory); buffers are real, so computed non-persistent buffers (rotary `inv_freq`) stay correct.
- `load_pretrained(build, checkpoint, rules)`: the one recipe every family (and whole models) load with: build
  on the meta device, load strictly (`load_part`), re-tie tied embeddings, record `Provenance`, check that no
  parameter was left on the meta device (`finish`).
- `load_part(module, checkpoint, rules)`: rename the checkpoint's keys by prefix rules, materialise
  the module from them (`assign=True`: zero-copy when no dtype change is asked), and raise
  `MissingWeightsError` naming the checkpoint and the first missing keys when any parameter of the
  part is not in it. Keys of the checkpoint that the rules do not map belong to other parts: ignored.

`Provenance` (`mmadapt.provenance`) records where a part came from: its path, files and a SHA-256 over the weight files,
hashed once per set of files in a background thread while the model is built.
"""

from __future__ import annotations

import contextvars
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmadapt.provenance import Provenance as Provenance  # where each part came from: mmadapt.provenance
from mmadapt.remote_code import warn_dropped, without_auto_map
from mmadapt.sharded_checkpoint import ModelTensors, is_sharded, state_files

SAFETENSORS_INDEX, SAFETENSORS = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN = "pytorch_model.bin.index.json", "pytorch_model.bin"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")
MMADAPT_KEY = "mmadapt"  # config.json of an mmadapt model directory / training checkpoint (`mmadapt.directory`)
SHOW_KEYS = 5
SHARDED_BATCH_BYTES = 256 << 20  # a sharded checkpoint's tensors read together (one DCP load each batch)


class MissingWeightsError(ValueError):
    """A pretrained part lacks weights in its checkpoint (or they have the wrong shape)."""


def _short_list(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOW_KEYS])
    return shown + (f" (and {len(keys) - SHOW_KEYS} more)" if len(keys) > SHOW_KEYS else "")


@dataclass
class Checkpoint:
    """A checkpoint on disk: `path`, its `config` (config.json as a dict; {} for a bare file), weight `files`."""

    path: Path
    config: dict[str, Any]
    files: list[Path]
    _index: dict[str, Path] = field(default_factory=dict, repr=False)
    _open: dict[Path, Any] = field(default_factory=dict, repr=False)
    _sharded: ShardedTensors | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike, *, what: str = "checkpoint",
             weights: Iterable[str] = ()) -> Checkpoint:
        """`path`: a model directory or a weight file; `weights`: extra file names to look for (mm_projector.bin)."""
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{what}: pretrained path {path} does not exist")
        if path.is_file():
            if not path.name.endswith(WEIGHT_SUFFIXES):
                raise ValueError(f"{what}: {path} is not a weight file ({', '.join(WEIGHT_SUFFIXES)}) or a directory")
            config_file = path.parent / "config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            return cls(path, config, [path])
        config_file = path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if is_sharded(path):
            return cls(path, config, [path / name for name in state_files(path)], _sharded=ShardedTensors(path))
        return cls(path, config, _weight_files(path, what, list(weights)))

    @property
    def directory(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def model_type(self) -> str | None:
        if MMADAPT_KEY in self.config:
            return MMADAPT_KEY
        return self.config.get("model_type")

    def describe_type(self) -> str:
        text = self.config.get("text_config", {}).get("model_type") if isinstance(
            self.config.get("text_config"), dict) else None
        found = repr(self.model_type) if self.model_type else "no model_type (no config.json)"
        return found + (f" (text_config {text!r})" if text else "")

    def keys(self) -> list[str]:
        if self._sharded is not None:
            return self._sharded.keys()
        if not self._index:
            for file in self.files:
                for key in self._reader(file).keys():
                    self._index.setdefault(key, file)
        return list(self._index)

    def tensor(self, key: str) -> torch.Tensor:
        if self._sharded is not None:
            return self._sharded.tensor(key)
        self.keys()
        reader = self._reader(self._index[key])
        return reader.get_tensor(key) if hasattr(reader, "get_tensor") else reader[key]

    def _reader(self, file: Path) -> Any:
        if file not in self._open:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                self._open[file] = safe_open(str(file), framework="pt")
            else:
                try:
                    state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                except RuntimeError:  # files of torch < 1.6 (legacy format) cannot be memory-mapped
                    state = torch.load(file, map_location="cpu", weights_only=True)
                self._open[file] = _unwrap_state(state, file)
        return self._open[file]

    def read_once(self, key: str) -> torch.Tensor:
        """`key`'s tensor through a file mapping of its own, released with the tensor (a weight read to be converted:
        its pages do not stay in the process with the mapping the kept weights hold)."""
        self.keys()
        if self._sharded is not None or self._index[key].suffix != ".safetensors":
            return self.tensor(key)
        from safetensors import safe_open

        with safe_open(str(self._index[key]), framework="pt") as f:
            return f.get_tensor(key)

    def stamps(self) -> tuple[tuple[str, int, int], ...]:
        """Each weight file's (name, size, modification time): whether the files are still the ones read."""
        return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in self.files)

    def close(self) -> None:
        """Drop the open files; tensors already read stay valid (they hold their own mapping)."""
        self._open.clear()
        if self._sharded is not None:
            self._sharded.ready.clear()


class ShardedTensors(ModelTensors):
    """A sharded checkpoint's model tensors for `Checkpoint`: a tensor asked for is read with the ones after it (in
    the checkpoint's order, up to `SHARDED_BATCH_BYTES`), since a loader asks for them in that order and each DCP load
    reads `.metadata` again. At most one batch is held: a miss drops what is left of the last one."""

    def __init__(self, checkpoint: str | os.PathLike) -> None:
        super().__init__(checkpoint)
        self.order = {key: i for i, key in enumerate(self.keys())}
        self.ready: dict[str, torch.Tensor] = {}

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.ready:
            self.ready.clear()
            if key not in self:
                raise KeyError(f"{self.checkpoint} holds no model tensor {key!r}")
            batch, size = [], 0
            for name in self.keys()[self.order[key]:]:
                if batch and size + self.nbytes(name) > SHARDED_BATCH_BYTES:
                    break
                batch.append(name)
                size += self.nbytes(name)
            self.ready = self.read(batch)
        return self.ready.pop(key)


def _unwrap_state(state: Any, file: Path) -> dict[str, torch.Tensor]:
    """Training checkpoints nest the weights under 'state_dict' or 'model' (timm, Lightning)."""
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file} does not hold a flat dict of tensors")
    return state


def _weight_files(directory: Path, what: str, extra: list[str]) -> list[Path]:
    for index in (SAFETENSORS_INDEX, BIN_INDEX):
        if (directory / index).is_file():
            files = [directory / name for name in shard_names(directory / index, what)]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise FileNotFoundError(f"{what}: {directory / index} lists shards that are missing: {absent}")
            return files
    for name in (SAFETENSORS, BIN, *extra):
        if (directory / name).is_file():
            return [directory / name]
    found = sorted(p for p in directory.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    if len(found) == 1:
        return found
    looked = ", ".join([SAFETENSORS_INDEX, SAFETENSORS, BIN_INDEX, BIN, *extra])
    raise FileNotFoundError(f"{what}: no weights in {directory} (looked for {looked}"
                            + (f"; found several candidates: {[p.name for p in found]}" if found else "") + ")")


def shard_names(index: Path, what: str) -> list[str]:
    """The weight files an index (`*.index.json`) lists in its `weight_map`, each once, in order. Each must be a plain
    file name inside the index's directory: a name with a path in it ('/', '..', an absolute path) is an error, so an
    index never makes mmadapt read (or hash) a file outside the directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{what}: {index} is not a weight index (JSON with a 'weight_map' object): {e!r}") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{what}: {index}: 'weight_map' must map tensor names to file names")
    names = list(dict.fromkeys(weight_map.values()))
    bad = [name for name in names if not _plain_file_name(name)]
    if bad:
        raise ValueError(f"{what}: {index} names weight files that are not plain file names inside its directory: "
                         f"{_short_list([repr(b) for b in bad])}. An index may only name files beside it "
                         "(no '/', '..' or absolute path); this one is damaged or was made to read other files.")
    return names


def _plain_file_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and not os.path.isabs(name))


# ---- building without initialising ------------------------------------------------------------------
@contextmanager
def empty_weights() -> Iterator[None]:
    """Parameters created inside go to the meta device (shapes only); buffers stay real."""
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    with init_empty_weights(include_buffers=False), no_init_weights():
        yield


_ARCHITECTURE_ONLY = contextvars.ContextVar("mmadapt_architecture_only", default=False)


@contextmanager
def architecture_only() -> Iterator[None]:
    """Inside, `load_pretrained` builds a part from its checkpoint's config and key layout and stops there: the
    parameters stay on the meta device and no weight is read (`mmadapt plan`)."""
    token = _ARCHITECTURE_ONLY.set(True)
    try:
        with empty_weights():
            yield
    finally:
        _ARCHITECTURE_ONLY.reset(token)


def meta_parameters(module: nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters(remove_duplicate=False) if p.is_meta]


# ---- loading a part ---------------------------------------------------------------------------------
Rules = tuple[tuple[str, str], ...]


def renamed_keys(keys: Iterable[str], rules: Rules, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """{checkpoint key: module key} for keys matching a rule's prefix (first rule wins) and no `skip` prefix."""
    out = {}
    for key in keys:
        if key.startswith(skip):
            continue
        for old, new in rules:
            if key.startswith(old):
                out.setdefault(new + key[len(old):], key)
                break
    return {source: target for target, source in out.items()}


@dataclass(frozen=True)
class Fused:
    """A module tensor `<prefix><name>` (E, ...) that checkpoints may store per expert: for e in range(E), the
    checkpoint tensors `<prefix><part with {e} = e>` concatenated along dim 0, then stacked (MoE experts: some
    checkpoints hold `mlp.experts.{e}.gate_proj.weight` / `up_proj`, transformers' module `mlp.experts.gate_up_proj`).
    Used only when the fused key itself is absent."""

    name: str
    parts: tuple[str, ...]

    def assemble(self, target: str, shape: torch.Size, sources: dict[str, str],
                 checkpoint: Checkpoint) -> tuple[str, torch.Tensor] | None:
        if target in sources:
            return None
        prefix = target[: -len(self.name)]
        keys = [[sources.get(prefix + part.format(e=e)) for part in self.parts] for e in range(shape[0])]
        if any(k is None for row in keys for k in row):
            return None
        tensor = torch.stack([torch.cat([checkpoint.tensor(k) for k in row]) for row in keys])
        return f"{target} (assembled per expert)", tensor


@dataclass(frozen=True)
class Transposed:
    """A module tensor `<prefix><name>` that checkpoints may store with dims `dims` swapped (Qwen3-VL-MoE's experts:
    the hub's (E, hidden, 2 x intermediate) is transformers' (E, 2 x intermediate, hidden)). Swapped only when the
    stored shape is the swapped one and not the module's, as transformers' own loader decides."""

    name: str
    dims: tuple[int, int] = (1, 2)

    def assemble(self, target: str, shape: torch.Size, sources: dict[str, str],
                 checkpoint: Checkpoint) -> tuple[str, torch.Tensor] | None:
        if target not in sources:
            return None
        tensor = checkpoint.tensor(sources[target])
        if tuple(tensor.shape) == tuple(shape) or tuple(tensor.transpose(*self.dims).shape) != tuple(shape):
            return None
        return f"{sources[target]} (transposed {self.dims})", tensor.transpose(*self.dims).contiguous()


WeightLayout = Fused | Transposed


def load_part(module: nn.Module, checkpoint: Checkpoint, rules: Rules, *, what: str, skip: tuple[str, ...] = (),
              dtype: torch.dtype | None = None, tied: dict[str, str] | None = None,
              hint: str | None = None, layouts: tuple[WeightLayout, ...] = (),
              quantize: Callable[[nn.Module], dict[str, Callable[[torch.Tensor], Any]]] | None = None) -> nn.Module:
    """Materialise `module` (built under `empty_weights`) from `checkpoint`, strictly.

    `tied` maps a module key to the key it is tied to: either may be absent from the checkpoint (the
    caller ties them after loading). `dtype` casts floating tensors; None keeps the checkpoint's dtype
    (and its memory map). `hint` replaces the generic advice of the shape-mismatch error. `layouts`: module
    tensors a checkpoint may store in another layout (`Fused` per expert, `Transposed`), converted here.
    `quantize(module)`: {key: quantiser} of the weights to store quantised, each as it is read (after the cast), so
    that no more than one full-precision tensor of them is held at a time (`mmadapt.quantize.nf4_targets`).
    """
    quantizers = quantize(module) if quantize is not None else {}
    mapping = renamed_keys(checkpoint.keys(), rules, skip)
    expected = module.state_dict()
    sources = {target: source for source, target in mapping.items()}
    assembled = {}
    for target, value in expected.items():
        for layout in layouts:
            if target.endswith(layout.name) and (found := layout.assemble(target, value.shape, sources, checkpoint)):
                assembled[target] = found
                break
    state, wrong = {}, []
    items = [(source, target, None) for source, target in mapping.items() if target not in assembled]
    items += [(source, target, tensor) for target, (source, tensor) in assembled.items()]
    for source, target, tensor in items:
        if target not in expected:
            continue  # e.g. a persistent buffer of an older transformers version; harmless
        if tensor is None:  # a weight to quantise is read through a mapping of its own, gone with it
            tensor = checkpoint.read_once(source) if target in quantizers else checkpoint.tensor(source)
        if tuple(tensor.shape) != tuple(expected[target].shape):
            wrong.append(f"{source} {tuple(tensor.shape)} vs {tuple(expected[target].shape)}")
            continue
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        state[target] = quantizers[target](tensor) if target in quantizers else tensor
    if wrong:
        advice = hint or ("the options describe another architecture than the checkpoint; drop the architecture "
                          "options (they come from the checkpoint)")
        raise MissingWeightsError(f"{what}: {len(wrong)} weights in {checkpoint.path} have another shape than this "
                                  f"part (checkpoint vs part): {_short_list(wrong)}. Likely cause: {advice}.")
    for key, partner in (tied or {}).items():
        if key not in state and partner in state:
            state[key] = state[partner]
    missing = [k for k in expected if k not in state and not _is_buffer(module, k)]
    if missing:
        raise MissingWeightsError(
            f"{what}: {checkpoint.path} lacks {len(missing)} of the {len(expected)} weights of this part: "
            f"{_short_list(missing)}. Is it a complete checkpoint of this family (model_type "
            f"{checkpoint.describe_type()})? Key prefixes tried: {[old for old, _ in rules]}.")
    module.load_state_dict(state, strict=False, assign=True)
    return module


def raise_on_key_mismatch(missing: Any, unexpected: Any, source: Any, strict: bool) -> None:
    """A whole model's keys against its weights': missing keys always raise, unexpected ones when `strict`."""
    if missing or (strict and unexpected):
        raise ValueError(
            f"weights in {source} do not match the model: missing keys {sorted(missing)}, unexpected keys "
            f"{sorted(unexpected)}. " + ("Missing weights are always an error (they would stay random)." if missing
                                         else "Pass strict=False to ignore unexpected keys.")
        )


def load_pretrained(build: Callable[[], nn.Module], checkpoint: Checkpoint, rules: Rules = (("", ""),), *, what: str,
                    skip: tuple[str, ...] = (), dtype: str | torch.dtype | None = None, hint: str | None = None,
                    layouts: tuple[WeightLayout, ...] = (), tied: Callable[[nn.Module], dict[str, str]] | None = None,
                    strict: bool | None = None, provenance: bool = True,
                    quantize: Callable[[nn.Module], dict[str, Callable[[torch.Tensor], Any]]] | None = None
                    ) -> nn.Module:
    """`build()` on the meta device, materialised from `checkpoint` by `rules` (see `load_part`), strictly.

    `tied(module)`: {key: key it is tied to} of tied weights (either side may be stored); the module's
    `tie_weights()` re-ties them after loading. `strict`: None for a part of a composite checkpoint (keys of other
    parts are ignored); True / False for a whole model, whose checkpoint must hold exactly its keys (False
    tolerates extra keys; a missing one is always an error). `provenance`: record where the weights came from.
    `quantize`: weights stored quantised as they are read (`load_part`).
    """
    with empty_weights():
        module = build()
    if _ARCHITECTURE_ONLY.get():
        return module
    tied_keys = tied(module) if tied is not None else {}
    if strict is not None:
        ours, theirs = set(module.state_dict()), set(checkpoint.keys())
        missing = sorted(k for k in ours - theirs if not (k in tied_keys and tied_keys[k] in theirs))
        raise_on_key_mismatch(missing, sorted(theirs - ours), checkpoint.path, strict)
    load_part(module, checkpoint, rules, what=what, skip=skip, dtype=parse_dtype(dtype), tied=tied_keys, hint=hint,
              layouts=layouts, quantize=quantize)
    if tied_keys:
        module.tie_weights()
    if provenance:
        module.provenance = Provenance(checkpoint, claimed=renamed_keys(checkpoint.keys(), rules, skip))
    return finish(module, what)


def _is_buffer(module: nn.Module, key: str) -> bool:
    parent, _, name = key.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    return name in owner._buffers


def finish(module: nn.Module, what: str) -> nn.Module:
    """After loading (and tying): no parameter may be left on the meta device."""
    left = meta_parameters(module)
    if left:
        raise MissingWeightsError(f"{what}: {len(left)} parameters were not loaded: {_short_list(left)}")
    return module


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """'bfloat16' / 'bf16' / torch.bfloat16 / None ('the checkpoint's')."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = getattr(torch, aliases.get(dtype, dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating torch dtype; use float32, bfloat16 or float16")
    return value


def without_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tied weights (one tensor under two names, e.g. lm_head and embed_tokens) stored once: safetensors refuses
    shared tensors. Returns the weights and {alias: stored name}."""
    weights, aliases, seen = {}, {}, {}
    for key, value in state.items():
        value = value.detach()
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        weights[key] = value.to("cpu").contiguous()
    return weights, aliases


def save_weights(state: dict[str, torch.Tensor], directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                 on_file: Callable[[str], None] | None = None) -> list[str]:
    """safetensors, sharded above `max_shard_size` (`model-0000k-of-0000n.safetensors` + index, as transformers
    writes them); tied tensors stored once. `directory` is a new one (a `mmadapt.atomic.StagedDirectory`'s: the
    directory is swapped in whole, so no reader sees some files of one save and some of another); `on_file(name)` is
    called after each file. A storage error is an `OSError` naming the file. Returns the names."""
    weights, aliases = without_aliases(state)
    return write_shards(weights, aliases, lambda keys: {k: weights[k] for k in keys}, directory,
                        max_shard_size=max_shard_size, on_file=on_file)


def write_shards(planned: dict[str, torch.Tensor], aliases: dict[str, str],
                 read: Callable[[list[str]], dict[str, torch.Tensor]], directory: str | os.PathLike, *,
                 max_shard_size: int | str, on_file: Callable[[str], None] | None = None) -> list[str]:
    """`save_weights`' files from a plan: `planned` {name: tensor, or a meta tensor of its shape and dtype} (tied
    tensors once, `aliases` {alias: stored name}), split by size in its order; `read(names)` gives one file's tensors
    just before that file is written (`mmadapt.train.sharded_export`: one file's worth held at a time)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from mmadapt.atomic import save_safetensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(planned, max_shard_size=max_shard_size)
    metadata = {"format": "pt", "aliases": json.dumps(aliases)}
    for name, keys in split.filename_to_tensors.items():
        save_safetensors(read(keys), directory / name, metadata=metadata)
        if on_file is not None:
            on_file(name)
    written = sorted(split.filename_to_tensors)
    if split.is_sharded:
        body = {"metadata": {**split.metadata, "aliases": aliases}, "weight_map": split.tensor_to_filename}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(body, indent=2))
        if on_file is not None:
            on_file(SAFETENSORS_INDEX)
        written.append(SAFETENSORS_INDEX)
    return sorted(written)


# ---- what every family's loader shares ------------------------------------------------------------------
# Config keys a pretrained part may still change: they do not alter the weights' meaning.
RUNTIME_KEYS = frozenset({"attention_dropout", "dropout", "hidden_dropout", "hidden_dropout_prob",
                          "attention_probs_dropout_prob", "use_cache", "attn_implementation", "pad_token_id",
                          "bos_token_id", "eos_token_id", "output_hidden_states", "initializer_range"})


def hf_config(checkpoint: Checkpoint, what: str) -> Any:
    """The checkpoint's transformers config (legacy fields and defaults handled by transformers). An `auto_map` in
    it is warned about here and never reaches a part's options (`mmadapt.options.hf_options` drops it)."""
    from transformers import AutoConfig

    if not checkpoint.config:
        raise ValueError(f"{what}: {checkpoint.path} has no config.json; a pretrained part needs its architecture")
    try:
        config = AutoConfig.from_pretrained(checkpoint.directory, trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"{what}: {checkpoint.path} describes its architecture with its own Python code (config.json "
            f"model_type {checkpoint.describe_type()}, 'auto_map' {checkpoint.config.get('auto_map')!r}). mmadapt "
            "never runs code from a model directory (trust_remote_code=False): use a checkpoint of an architecture "
            "transformers implements, or register a backbone for it (README, 'A new backbone in a few lines').") from e
    warn_dropped(checkpoint.directory / "config.json", checkpoint.config)
    return config


def wrong_family(what: str, checkpoint: Checkpoint, expected: str) -> ValueError:
    return ValueError(f"{what}: {checkpoint.path} is not a checkpoint of this family: its config.json has model_type "
                      f"{checkpoint.describe_type()}, expected {expected}")


def merge_options(from_checkpoint: dict[str, Any], overrides: dict[str, Any], *, what: str,
                  path: Path) -> dict[str, Any]:
    """The checkpoint's options updated by `overrides`; changing an architecture setting is an error."""
    clash = {k: v for k, v in overrides.items()
             if k in from_checkpoint and k not in RUNTIME_KEYS and v != from_checkpoint[k]}
    if clash:
        detail = ", ".join(f"{k}={v!r} (checkpoint: {from_checkpoint[k]!r})" for k, v in clash.items())
        raise ValueError(f"{what}: options {detail} contradict {path}; a pretrained part's architecture comes from "
                         "its checkpoint. Drop these options, or build the part from a preset instead.")
    return {**from_checkpoint, **overrides}


def mmadapt_part(checkpoint: Checkpoint, part: str, name: str, what: str) -> tuple[dict[str, Any], Rules]:
    """Options and key rules of one part of a saved mmadapt model directory (or training checkpoint)."""
    saved = checkpoint.config[MMADAPT_KEY][part]
    if saved["name"] != name:
        raise ValueError(f"{what}: the {part} saved in {checkpoint.path} is {saved['name']!r}, not {name!r}. "
                         f"Fix: name the component {saved['name']!r}, or point at another checkpoint.")
    warn_dropped(checkpoint.directory / "config.json", saved)  # written before mmadapt dropped them
    return without_auto_map(dict(saved.get("options") or {})), ((f"{part}.", ""),)
