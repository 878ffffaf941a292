"""torchrun / single-process plumbing: process group, FSDP2 or DDP wrapping, full state dicts.

`init()` starts the process group when launched by torchrun (gloo on CPU, nccl on GPU) and
is a no-op for one process. `wrap` applies FSDP2 (`fully_shard` on every decoder and vision
block, then the encoder and the projector (`vision_units`), then the root; mixed precision bf16
params with fp32 gradient reduction under the bf16 policy) or DDP. Checkpoints always hold full,
unsharded, unprefixed state dicts, so a checkpoint from any world size loads into any other and
into a plain model.

Ranks never wait silently: every collective has the run's `distributed.timeout_minutes` (passed to
`init_process_group`; NCCL's own default is 10 minutes), and `failing_together` turns an exception on one rank into
a prompt end of every rank: the failing rank reports its error and aborts the process group, so the others' pending
collectives fail at once instead of waiting for the timeout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmadapt.bnb import FSDP_REFUSAL, is_params4bit
from mmadapt.precision import Precision, as_precision
from mmadapt.quantize import four_bit_parameters

log = logging.getLogger(__name__)
BLOCK_LISTS = ("layers", "blocks")  # ModuleLists whose children are transformer blocks


@dataclass(frozen=True)
class DistContext:
    """This process's place: `rank` of `world`, and with sequence parallelism (`sequence_parallel` N > 1) its group
    of N consecutive ranks sharing each sample (`sequence_group`) and the data-parallel group of the ranks holding
    other data (`data_group`: one rank of each sequence group, this one's position in each)."""

    rank: int
    world: int
    device: torch.device
    sequence_parallel: int = 1
    sequence_group: Any = None
    data_group: Any = None  # None: every rank (no sequence parallelism)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank reads (the ranks of a sequence group read the same)."""
        return self.rank // self.sequence_parallel

    @property
    def data_world(self) -> int:
        """How many shares the data is cut into: world / sequence_parallel."""
        return self.world // self.sequence_parallel

    @property
    def sequence_rank(self) -> int:
        return self.rank % self.sequence_parallel


def init(timeout_minutes: float = 30.0, sequence_parallel: int = 1) -> DistContext:
    """The process group when launched by torchrun (every collective gives up after `timeout_minutes`), else one
    process; with `sequence_parallel` N > 1, a (world / N, N) mesh: groups of N consecutive ranks share each sample."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if sequence_parallel > 1 and world % sequence_parallel:
        raise ValueError(f"distributed.sequence_parallel: {sequence_parallel} does not divide the {world} processes "
                         f"torchrun started. Fix: --nproc_per_node (x nodes) a multiple of {sequence_parallel}, or "
                         f"one of {[n for n in range(1, world + 1) if world % n == 0]}")
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(minutes=timeout_minutes))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if sequence_parallel <= 1 or world == 1:
        return DistContext(rank=rank, world=world, device=device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // sequence_parallel, sequence_parallel),
                            mesh_dim_names=("data", "sequence"))
    return DistContext(rank=rank, world=world, device=device, sequence_parallel=sequence_parallel,
                       sequence_group=mesh.get_group("sequence"), data_group=mesh.get_group("data"))


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def wrap(model: nn.Module, ctx: DistContext, strategy: str, precision: Precision | str) -> nn.Module:
    """`model` for `ctx`'s ranks: as it is for one process, else FSDP2 (`shard`, under `precision`'s mixed precision:
    a `Precision` or its name) or DDP."""
    if not ctx.active:
        return model
    if strategy in ("auto", "fsdp"):
        if any(is_params4bit(p) for p in model.parameters()):  # normally refused before loading (mmadapt.bnb)
            raise ValueError(f"distributed.strategy: {strategy} cannot shard a bitsandbytes 4-bit backbone: "
                             f"{FSDP_REFUSAL}")
        return shard(model, ctx, as_precision(precision))
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # A QLoRA base's 4-bit weights are not broadcast: every rank quantised the same source, bit for bit
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, four_bit_parameters(model))
        # Frozen towers and CLIP's unused last layer leave parameters without gradients.
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)
    raise ValueError(f"distributed.strategy must be 'auto', 'ddp' or 'fsdp', got {strategy!r}")


def shard(model: nn.Module, ctx: DistContext, precision: Precision) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
    blocks = blocks_to_shard(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    for part in vision_units(model, blocks):
        fully_shard(part, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def vision_units(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The encoder and the projector, each a unit of its own for the parameters of no block (a ViT's patch embedding
    and merger, the projector's layers), so that the vision side can run outside the root's forward - an RL step
    encodes its pictures once, before its rollout and its forwards - gathering and reducing its own parameters. Parts
    whose parameters are all in blocks, or that have none, are left to the root. Each forward of a unit gathers, so a
    rank without pictures runs them on no picture wherever another encodes its own
    (`VisionLanguageModel.runs_vision_for_every_batch`)."""
    inside = {id(p) for block in blocks for p in block.parameters()}
    return [part for part in (model.encoder, model.projector)
            if any(id(p) not in inside for p in part.parameters())]


def blocks_to_shard(model: nn.Module) -> list[nn.Module]:
    """The units FSDP2 shards one by one: every block of the encoder's and the backbone's block lists (decoder
    layers of every registered backbone, dense or MoE; vision blocks); the rest goes with the root."""
    blocks = []
    for component in (model.encoder, model.backbone):
        for name, module in component.named_modules():
            if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS:
                blocks.extend(module)
    return blocks


def no_sync(wrapped: nn.Module) -> Any:
    """Skip gradient communication for a micro-batch that is not the last of the step."""
    if hasattr(wrapped, "no_sync"):  # DDP
        return wrapped.no_sync()
    if dist.is_initialized() and is_fsdp(wrapped):
        return _FsdpNoSync(wrapped)
    return nullcontext()


class _FsdpNoSync:
    def __init__(self, module: Any) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc: Any) -> None:
        self.module.set_requires_gradient_sync(True)


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The sum of `tensor` over `group`'s ranks (every rank: None); itself in one process."""
    tensor = tensor.clone()
    if dist.is_initialized():
        dist.all_reduce(tensor, group=group)
    return tensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank (any picklable object); `value` itself in one process."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank; `[value]` in one process."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


@contextmanager
def failing_together() -> Iterator[None]:
    """An exception raised on this rank ends every rank promptly: it is logged with the rank's number and the process
    group is aborted (its connections closed), so the other ranks' pending collectives fail within seconds instead
    of waiting out the timeout; torchrun then stops them and reports this rank as the first failure."""
    try:
        yield
    except BaseException as e:
        if dist.is_initialized() and dist.get_world_size() > 1:
            rank, world = dist.get_rank(), dist.get_world_size()
            log.error("rank %d of %d failed: %s: %s; ending every rank", rank, world, type(e).__name__, e)
            abort()
        raise


def abort() -> None:
    """Tear this rank's process group down without waiting for the others (closing its connections)."""
    try:
        if dist.get_backend() == "nccl":  # destroying would wait for the pending collectives
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception as e:  # an aborting rank reports its own error, not the teardown's
        log.debug("process group teardown: %s", e)


def grad_norm_and_clip(wrapped: nn.Module, max_norm: float | None) -> float:
    """The global gradient norm (all ranks, all shards), clipping to `max_norm` when given."""
    params = [p for p in wrapped.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def _options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, strict=strict)


def full_model_state(wrapped: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    if is_fsdp(wrapped):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(wrapped, options=_options())
    return model.state_dict()


def full_optimizer_state(wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state keyed by parameter names (one process, DDP and FSDP2 alike), so that a checkpoint of
    any world size and strategy loads into any other."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(wrapped, optimizer, options=_options())


def load_full_model_state(wrapped: nn.Module, model: nn.Module, state: dict[str, torch.Tensor],
                          absent: list[str] = ()) -> None:
    """Load a whole state dict into the model; `absent`: keys it does not hold (a QLoRA base's 4-bit weights)."""
    if is_fsdp(wrapped):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        result = set_model_state_dict(wrapped, state, options=_options(strict=not absent))
        missing = sorted(set(result.missing_keys) - set(absent))
        if missing:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}. Was it written with other "
                             "components or stages?")
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in set(absent)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}. Was it written with other components or stages?")


def load_full_optimizer_state(wrapped: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load `full_optimizer_state`'s dict; a checkpoint of mmadapt < 0.12 (one process: keyed by parameter position)
    is converted to names first."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(wrapped, optimizer, by_name(wrapped, optimizer, state), options=_options())


def by_name(wrapped: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """`optimizer.state_dict()`'s format (parameters numbered in the order of the optimizer's groups) as
    `full_optimizer_state`'s (parameter names); a dict already keyed by names is returned as it is."""
    if not any(isinstance(key, int) for group in state["param_groups"] for key in group["params"]):
        return state
    names = {id(p): name.removeprefix("module.") for name, p in wrapped.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[k]: v for k, v in state["state"].items()},
            "param_groups": [{**group, "params": [order[k] for k in group["params"]]}
                             for group in state["param_groups"]]}
