"""The host (CPU) memory of saving a checkpoint, per rank, for `mmadapt plan`: `saving_memory` -> `SavingMemory`.

Counted from the planned model (meta device, the run's stages applied): its parameters and buffers at their stored
dtypes, and AdamW's state of what trains (`exp_avg` and `exp_avg_sq` at the trained parameter's dtype, fp32, and a
4-byte `step`, per trained tensor), as each way of saving holds them:

- **gathered** (`checkpoint.format: gathered`, mmadapt < 0.26): the whole state gathered to rank 0
  (`StateDictOptions(full_state_dict=True, cpu_offload=True)`): rank 0 holds all of it in host memory at once, the
  other ranks nothing (FSDP2 on the CPU device: the all-gather's output, one tensor at a time; there a tensor of
  uneven shards also keeps its padding rows, less than one row per rank, not counted). FSDP2 gathers each
  name on its own (a tied tensor twice); one process and DDP copy the model's tensors from the GPU once each, and on
  the CPU device write the live tensors and hold nothing more.
- **sharded, synchronous**: DCP's `FileSystemWriter` copies one tensor (a shard, by name) at a time to host memory:
  at most the rank's largest (on the CPU device a tensor is copied only when it is an uneven FSDP2 shard: at most).
- **sharded, asynchronous** (`checkpoint.async: true`): DCP's `DefaultStager` copies every storage of the rank's
  state dict to host memory (pinned on CUDA) before the step loop goes on (a tied tensor once), and keeps its
  buffers for the next save (the trainer's stager lives as long as the run): one copy per rank, held from the first
  save on. Under FSDP2 that is every parameter's storage - its padded dim-0 chunk, rows / N rounded up, the same on
  every rank - with its moments' shards, and the replicated buffers and steps; under DDP and one process, the whole
  state on every rank (DCP deduplicates what the ranks write, after staging, not what they stage).

FSDP2 shards over every rank of the world, sequence-parallel ones included (`distributed.shard`'s one-dimensional
mesh). Not counted: the scheduler, RNG, sampler and trainer state (kilobytes).

With the host memory of a machine known (`--host-memory`, shared by `--gpus-per-machine` ranks), a way of saving that
holds more than `HOST_SHARE` of it on rank 0's machine (its ranks' data loading included) is named, with the
settings that would hold less (`SavingMemory.suggestions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from mmadapt.quantize import is_4bit
from mmadapt.train.plan.model import unique_parameters
from mmadapt.train.plan.report import gib

# the share of a machine's host memory saving may take with the ranks' data loading: the rest is for the ranks'
# processes themselves (the CUDA runtime and libraries, DataLoader workers) and the page cache
HOST_SHARE = 0.5
STEP_BYTES = 4  # AdamW's `step`: a float32 scalar per trained tensor
WAYS = ("sharded sync", "sharded async", "gathered")


@dataclass(frozen=True)
class StateTensor:
    """One tensor of the saved state: its size; whether FSDP2 shards it on dim 0 (a parameter and its moments;
    buffers and steps are replicated on every rank), and whether its storage is FSDP2's padded chunk (a parameter:
    every rank holds rows / N rounded up; a moment is allocated at its shard's own size)."""

    numel: int
    element_size: int
    rows: int
    sharded: bool
    padded: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def local(self, rank: int, world: int) -> int:
        """The bytes of `rank`'s shard of `world`: FSDP2's dim-0 chunk (rows / world rounded up; the last ranks hold
        fewer rows, or none), the whole tensor when it is not sharded."""
        if not self.sharded or world == 1 or self.rows == 0:
            return self.nbytes
        chunk = -(-self.rows // world)
        return max(0, min(chunk, self.rows - rank * chunk)) * (self.numel // self.rows) * self.element_size

    def storage(self, rank: int, world: int) -> int:
        """The bytes of the storage `rank`'s shard lives in (what a stager copies): a parameter's padded chunk."""
        if not (self.padded and self.sharded) or world == 1 or self.rows == 0:
            return self.local(rank, world)
        return -(-self.rows // world) * (self.numel // self.rows) * self.element_size


def _tensor(t: Any, *, sharded: bool, padded: bool = False) -> StateTensor:
    return StateTensor(numel=t.numel(), element_size=t.element_size(), rows=t.shape[0] if t.dim() else 1,
                       sharded=sharded, padded=padded)


def _model_tensor(t: Any) -> StateTensor:
    parameter = isinstance(t, nn.Parameter)
    return _tensor(t, sharded=parameter, padded=parameter)


def _saved(model: nn.Module) -> list[Any]:
    """The model's state dict as a checkpoint holds it: a QLoRA base's 4-bit weights left out (its source has them)."""
    return [t for t in model.state_dict(keep_vars=True).values() if not is_4bit(t)]


def model_tensors(model: nn.Module) -> list[StateTensor]:
    """The model's state dict by name (parameters sharded, buffers replicated; a tied tensor under each name)."""
    return [_model_tensor(t) for t in _saved(model)]


def unique_model_tensors(model: nn.Module) -> list[StateTensor]:
    """The model's state dict with a tied tensor once (one storage: as a stager copies it and one process gathers
    it)."""
    return [_model_tensor(t) for t in {id(t): t for t in _saved(model)}.values()]


def optimizer_tensors(model: nn.Module) -> list[StateTensor]:
    """AdamW's state of the trained parameters: two moments at the parameter's dtype and a float32 step each."""
    out = []
    for p in unique_parameters(model):
        if p.requires_grad:
            out += [_tensor(p, sharded=True), _tensor(p, sharded=True),
                    StateTensor(numel=1, element_size=STEP_BYTES, rows=1, sharded=False)]
    return out


@dataclass(frozen=True)
class Way:
    """What one way of saving holds in host memory: on rank 0, and at most on any other rank (0 with one rank)."""

    rank0: int
    others: int
    what: str


def ways(model: nn.Module, *, strategy: str, ranks: int, device: str) -> dict[str, Way]:
    """{way: Way} for `model` saved by `ranks` ranks under `strategy` ("single", "ddp", "fsdp2")."""
    by_name = model_tensors(model) + optimizer_tensors(model)
    storages = unique_model_tensors(model) + optimizer_tensors(model)
    fsdp = strategy == "fsdp2" and ranks > 1
    world = ranks if fsdp else 1

    def held(rank: int) -> int:
        return sum(t.storage(rank, world) for t in storages) if rank < ranks else 0

    def largest(rank: int) -> int:
        return max((t.local(rank, world) for t in by_name), default=0) if rank < ranks else 0

    staged = (f"each parameter's padded shard (/ {ranks}) and its moments, buffers and steps whole" if fsdp
              else "the whole state on every rank: DCP deduplicates what ranks write, not what they stage")
    pinned = " (pinned)" if device == "cuda" else ""
    out = {"sharded sync": Way(largest(0), largest(1), "one tensor at a time copied to host memory: at most the "
                               "rank's largest"),
           "sharded async": Way(held(0), held(1), f"its state dict staged{pinned}, the buffers kept for the next "
                                f"saves; {staged}")}
    if fsdp:  # each name all-gathered on its own: a tied tensor gathered under each name
        others = max((t.nbytes for t in by_name), default=0) if device == "cpu" else 0
        out["gathered"] = Way(sum(t.nbytes for t in by_name), others, "the whole state at once" + (
            "; the others one all-gathered tensor at a time" if device == "cpu" else "; the others nothing"))
    elif device == "cuda":
        whole = sum(t.nbytes for t in storages)
        out["gathered"] = Way(whole, 0, "the whole state copied from the GPU at once; the others nothing")
    else:
        out["gathered"] = Way(0, 0, "the live tensors written (CPU device): nothing more")
    return out


@dataclass
class SavingMemory:
    """The host memory of this run's saves, and of the other ways of saving; what rank 0's machine holds."""

    way: str  # this run's: one of WAYS
    strategy: str
    ranks: int
    model: int  # the model's state, a tied tensor once
    optimizer: int  # AdamW's state of what trains
    ways: dict[str, Way]
    sequence_parallel: int = 1
    host_memory: int | None = None  # one machine's (`--host-memory`)
    ranks_per_machine: int = 1
    data_private: int = 0  # a rank's data loading (`DataMemory.private`), on the same machine
    suggestions: list[tuple[str, int]] = field(default_factory=list)  # (change, rank 0's machine with it)

    def __post_init__(self) -> None:
        assert self.way in WAYS and set(self.ways) == set(WAYS), (self.way, sorted(self.ways))

    @property
    def this(self) -> Way:
        return self.ways[self.way]

    def machine(self, way: Way) -> int:
        """What rank 0's machine holds while saving this way: rank 0's, the machine's other ranks', their data
        loading."""
        return way.rank0 + (self.ranks_per_machine - 1) * way.others + self.ranks_per_machine * self.data_private

    @property
    def fits(self) -> bool | None:
        return None if self.host_memory is None else self.machine(self.this) <= HOST_SHARE * self.host_memory

    def headline(self) -> str:
        this, gathered, sync = self.this, self.ways["gathered"], self.ways["sharded sync"]
        if self.way == "gathered":
            others = f", {gib(this.others)} on each other rank" if self.ranks > 1 else ""
            staged = gib(self.ways["sharded async"].rank0)
            return (f"gathered: {gib(this.rank0)} on rank 0{others}; sharded would hold at most {gib(sync.rank0)} "
                    f"per rank ({staged} staged with checkpoint.async)")
        held = (f"{gib(this.rank0)} staged per rank" if self.way == "sharded async"
                else f"at most {gib(this.rank0)} per rank (one tensor at a time)")
        return f"{self.way}: {held}; gathered would hold {gib(gathered.rank0)} on rank 0"

    def lines(self) -> list[str]:
        spread = (f", FSDP2 shards over all {self.ranks} ranks (sequence-parallel ones included)"
                  if self.strategy == "fsdp2" and self.sequence_parallel > 1 else "")
        lines = [f"host, per rank (saving): {self.headline()}",
                 f"  {'state':<13} {gib(self.model + self.optimizer):>10}   model {gib(self.model)} (parameters and "
                 f"buffers as stored) + AdamW {gib(self.optimizer)} (moments and steps of what trains){spread}"]
        for name, way in self.ways.items():
            where = "rank 0" if name == "gathered" else "per rank"
            mark = " (this run)" if name == self.way else ""
            lines.append(f"  {name:<13} {gib(way.rank0):>10}   {where}{mark}: {way.what}")
        if self.host_memory is not None:
            need = self.machine(self.this)
            lines.append(f"  rank 0's machine ({self.ranks_per_machine} rank(s), data loading included): {gib(need)} "
                         f"of {gib(self.host_memory)} host memory: {'fits' if self.fits else 'too much'} (at most "
                         f"{HOST_SHARE:.0%} for saving)")
            lines += [f"  would fit the host: {change} ({gib(total)})" for change, total in self.suggestions]
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"format": "gathered" if self.way == "gathered" else "sharded", "async": self.way == "sharded async",
                "rank0": self.this.rank0, "others": self.this.others,
                "model": self.model, "optimizer": self.optimizer, "strategy": self.strategy, "ranks": self.ranks,
                "ways": {name: {"rank0": w.rank0, "others": w.others} for name, w in self.ways.items()},
                "host_memory": self.host_memory, "ranks_per_machine": self.ranks_per_machine,
                "machine": self.machine(self.this), "fits": self.fits,
                "suggestions": [{"change": c, "machine": t} for c, t in self.suggestions]}


def saving_memory(model: nn.Module, checkpoint: Any, *, strategy: str, ranks: int, device: str,
                  sequence_parallel: int = 1, host_memory: int | None = None, ranks_per_machine: int | None = None,
                  data_private: int = 0) -> SavingMemory:
    """The host memory of saving `model` (the planning model) with `checkpoint` (the run's `CheckpointSection`) on
    `ranks` ranks under `strategy`; with `host_memory`, the changes that would fit rank 0's machine when this way
    does not (`ranks_per_machine`: default min(ranks, 8))."""
    way = "gathered" if checkpoint.format == "gathered" else "sharded async" if checkpoint.async_ else "sharded sync"
    saving = SavingMemory(
        way=way, strategy=strategy, ranks=ranks, ways=ways(model, strategy=strategy, ranks=ranks, device=device),
        model=sum(t.nbytes for t in unique_model_tensors(model)),
        optimizer=sum(t.nbytes for t in optimizer_tensors(model)), sequence_parallel=sequence_parallel,
        host_memory=host_memory, ranks_per_machine=min(ranks, ranks_per_machine or 8), data_private=data_private)
    if saving.fits is False:
        saving.suggestions = _suggestions(saving, model, device)
    return saving


def _suggestions(saving: SavingMemory, model: nn.Module, device: str) -> list[tuple[str, int]]:
    """The settings that hold less on rank 0's machine than this run's, each with what the machine would hold."""
    sync = ("checkpoint.format: sharded" if saving.way == "gathered" else "checkpoint.async: false",
            saving.machine(saving.ways["sharded sync"]))
    out = [sync] if saving.way != "sharded sync" else []
    if saving.way == "sharded async" and saving.strategy == "ddp":  # FSDP2 stages a shard, not the whole state
        fsdp = ways(model, strategy="fsdp2", ranks=saving.ranks, device=device)["sharded async"]
        out.append(("distributed.strategy: fsdp", saving.machine(fsdp)))
    return [(change, total) for change, total in out if total <= HOST_SHARE * saving.host_memory]
