"""The prediction: the run's model counted on the meta device (parameters by dtype; fp32 gradients and AdamW's two
fp32 moments for what the stages train; sharded by the strategy), the probe's activations swept over the run's real
depth for its longest micro-batch, plus the loss and the backward's temporaries, or the optimizer step, whichever is
higher, or what the objective holds between steps (`Objective.memory`: a GRPO rollout's generation cache of its
B x G rows, counted from the backbone's config); and, when it does not fit, the usual changes that would, each
planned alone. In host memory per rank: data loading (`mmadapt.data.memory`) and a checkpoint save
(`mmadapt.train.plan.saving`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

from torch import nn

from mmadapt.loss import chunk_rows
from mmadapt.precision import Precision
from mmadapt.quantize import is_nf4, nf4_layout
from mmadapt.train.config import RunConfig
from mmadapt.train.objectives import objective_for
from mmadapt.train.plan.model import planning_model, unique_parameters
from mmadapt.train.plan.probe import PROBE_VOCAB, cached_probe
from mmadapt.train.plan.report import Plan, QuantizedParameters, cuda_margin, gib
from mmadapt.train.plan.saving import saving_memory
from mmadapt.train.plan.segments import (
    LOSS,
    Line,
    Segment,
    at,
    fit,
    probe_sweep_segments,
    segments,
    stored_bytes,
    sweep,
)
from mmadapt.train.plan.workloads import workload


def predict(config: RunConfig, *, gpus: int = 1, gpu_memory: int | None = None, device: str = "cuda",
            probe: dict[str, Any] | None = None, host_memory: int | None = None,
            gpus_per_machine: int | None = None) -> Plan:
    """The per-GPU memory of `config`'s training step on `gpus` devices (see the package docstring); `probe`: a probe
    measured already (else the cached one, or measured now). Per rank in host memory: data loading, and a checkpoint
    save (`saving`: against `host_memory`, one machine's, shared by `gpus_per_machine` ranks, when given)."""
    from mmadapt.train.optim import checkpointed_parts

    model, notes = planning_model(config)
    probe = probe if probe is not None else cached_probe(config)
    work = workload(config, model)
    strategy = "single" if gpus == 1 else ("ddp" if config.distributed.strategy == "ddp" else "fsdp2")
    split = config.distributed.sequence_parallel
    if gpus % split:
        raise ValueError(f"distributed.sequence_parallel: {split} does not divide --gpus {gpus}")
    if split > 1:
        from mmadapt.sequence_parallel import check_model

        check_model(model, split)
    forward = segments(model, probe)
    checkpointed = set(checkpointed_parts(config.train.activation_checkpointing))
    # the vision side replicated on every rank of a group, or its pictures spread across the group's ranks (sharded:
    # patches / N each, as if evenly spread; a picture is cut no finer than an image or a video's temporal patch)
    sharded = split > 1 and config.distributed.sequence_parallel_vision == "sharded"
    vision = (work.images * work.patches_per_image / (split if sharded else 1), work.patches_per_image)
    # a rank's decoder holds tokens / N of every row; attention sees whole rows for heads / N (Ulysses), so a
    # quadratic term (c x s) also falls by N
    load = {"encoder": vision, "projector": vision, "backbone": (work.tokens / split, work.tokens / work.rows)}
    shard = gpus if strategy == "fsdp2" else 1
    peak, acts = sweep(forward, load, checkpointed, shard)
    _, acts_off = sweep(forward, load, set(), shard)
    _, acts_all = sweep(forward, load, {"encoder", "backbone"}, shard)
    precision = config.precision.mode
    transient = at(_transient(probe, precision), load["backbone"])
    recompute = max((at(s.acts, load[s.part]) for s in forward if s.part in checkpointed), default=0.0)

    params = list(unique_parameters(model))
    by_dtype: dict[str, int] = defaultdict(int)
    for p in params:  # a QLoRA base's NF4 weights under "nf4", as stored (codes and scales)
        by_dtype["nf4" if is_nf4(p) else str(p.dtype).removeprefix("torch.")] += stored_bytes(p)
    trained = [p for p in params if p.requires_grad]
    trained_bytes = sum(p.numel() * 4 for p in trained)
    width = model.backbone.config.hidden_size
    vocab = model.backbone.get_output_embeddings().weight.shape[0]
    # the supervised rows' gradients (kept from the forward to the backward) and the chunk of logits
    supervised = -(-work.supervised // split)  # a rank's share of the supervised rows (evenly spread: the mean)
    loss = supervised * width * precision.hidden_bytes + _chunk_bytes(supervised, vocab, precision)
    exchange = exchange_bytes(model, work, split, precision)
    parameters = sum(by_dtype.values()) // shard
    gradients = trained_bytes // shard
    optimizer_state = 2 * trained_bytes // shard
    step_temp = _optimizer_temporaries(trained, device) // shard
    sharding = _sharding_bytes(strategy, forward, trained_bytes, precision)
    # the step's peak: the backward sweep (gradients appear as the saved activations go) with its temporaries and
    # the loss, or the optimizer step (every gradient + its temporaries); parameters and moments are there throughout
    backward = peak + transient + recompute + loss + exchange
    # what the objective holds between steps (gradients freed), for this rank's own rows (not sharded): a GRPO
    # rollout's generation cache and one prefill's working set; and what it keeps throughout (a teacher's weights)
    objective = objective_for(config)
    between = {name: size for name, size in objective.memory(model, precision).items() if size}
    resident = {name: size for name, size in objective.resident_memory(model, precision).items() if size}
    total = int(parameters + sum(resident.values()) + optimizer_state + sharding
                + max(backward, gradients + step_temp, *between.values()))
    per_gpu = {"parameters": parameters, "gradients": gradients, "optimizer": optimizer_state + step_temp,
               "activations": int(acts + transient + recompute), "loss": int(loss), "sharding": sharding,
               **({"exchange": exchange} if split > 1 else {}),
               **resident, **between, "total": total}
    margin = cuda_margin(total) if device == "cuda" else 0
    if split > 1:
        per_row = work.tokens / work.rows
        notes.append(f"sequence parallelism: {split} ranks share each sample ({gpus // split} data-parallel groups), "
                     f"each decoding {per_row / split:,.0f} of every row's {per_row:,.0f} tokens; the vision side "
                     + (f"sharded (the batch's pictures spread across the {split} ranks of a group, by images and "
                        f"video temporal patches: each encodes {1 / split:.0%} of the patches, as if evenly spread, "
                        "and the visual tokens are gathered)" if sharded else
                        "replicated (every rank of a group encodes the sample's pictures)"))
    quantized = quantized_parameters(model, config)
    if quantized is not None and not quantized.parameters:
        notes.append(f"stages.backbone: qlora stores no layer of this backbone in NF4 ({quantized.layout}), which "
                     "the run refuses: lower quantization.scaler_block_size, or train with stages.backbone: lora")
    plan = Plan(gpus=gpus, device=device, strategy=strategy, workload=work, per_gpu=per_gpu,
                activations_without_checkpointing=int(acts_off), activations_with_checkpointing=int(acts_all),
                checkpointing=sorted(checkpointed), parameters_by_dtype=dict(by_dtype), margin=margin,
                gpu_memory=gpu_memory, notes=notes, attention=attention_paths(model, forward, load),
                quantized=quantized)
    if config.data.train is not None:
        from mmadapt.data.memory import data_memory

        try:
            plan.host = data_memory(config.data.train, num_workers=config.data.num_workers,
                                    columns=config.data.columns)
        except FileNotFoundError as e:  # a recipe's placeholder path, like its absent checkpoints
            plan.notes.append(f"data.train {e.filename or e} is not here: data loading not planned")
        except (OSError, ValueError) as e:  # a plan is a report: data it cannot read is a note
            plan.notes.append(f"data loading not planned: {e}")
    plan.saving = saving_memory(model, config.checkpoint, strategy=strategy, ranks=gpus, device=device,
                                sequence_parallel=split, host_memory=host_memory, ranks_per_machine=gpus_per_machine,
                                data_private=plan.host.private if plan.host is not None else 0)
    if plan.fits is False:
        plan.suggestions = suggestions(config, gpus=gpus, device=device, probe=probe, gpu_memory=gpu_memory)
    return plan


def quantized_parameters(model: Any, config: RunConfig) -> QuantizedParameters | None:
    """A `qlora` backbone's NF4 weights: how many, their bytes as stored, what stays in precision; else None."""
    if config.stages.modes()["backbone"] != "qlora":
        return None
    four_bit = [p for p in unique_parameters(model) if is_nf4(p)]
    keep = tuple(model.backbone_spec.keep_precision) + tuple(config.quantization.keep)
    return QuantizedParameters(parameters=sum(p.numel() for p in four_bit),
                               bytes=sum(stored_bytes(p) for p in four_bit),
                               source_bytes=sum(p.numel() * p.element_size() for p in four_bit),
                               layout=nf4_layout(model.backbone, keep, config.quantization).summary())


ATTENTION = {  # the backbone's; a vision tower attends within each image, without a mask
    "mmadapt_sdpa": "SDPA, causal without a mask (right-padded rows; packed rows sample by sample): the flash / "
                    "memory-efficient kernels",
    "sdpa": "SDPA with a (B, 1, L, L) mask for padded rows",
    "eager": "eager: (B, H, L, L) scores and probabilities kept for the backward",
    "flash_attention_2": "flash-attn (varlen)", "flash_attention_3": "flash-attn 3 (varlen)",
}
VISION_ATTENTION = {"sdpa": "SDPA within each image, without a mask",
                    "eager": "eager: (H, P, P) scores and probabilities per image kept for the backward"}
LENGTH = {"backbone": ("tokens", "row"), "encoder": ("patches", "image")}


def attention_paths(model: Any, forward: list[Segment], load: dict[str, tuple[float, float]]) -> dict[str, str]:
    """{part: its attention implementation and how its blocks' activations grow with length}, as measured: linear
    where the probe's three lengths show no quadratic term; else the quadratic bytes of this micro-batch and the
    length above which they pass the linear part."""
    out = {}
    for part, (unit, sequence) in LENGTH.items():
        blocks = [s for s in forward if s.part == part and s.key.is_block]
        implementation = next((m.config._attn_implementation for m in getattr(model, part).modules()
                               if hasattr(getattr(m, "config", None), "_attn_implementation")), None)
        path = (ATTENTION if part == "backbone" else VISION_ATTENTION).get(implementation,
                                                                         implementation or "no attention")
        linear, quadratic = sum(s.acts[1] for s in blocks), sum(s.acts[2] for s in blocks)
        x, length = load[part]
        if quadratic > 0:
            out[part] = (f"{path}; quadratic in length: {gib(quadratic * x * length)} of the activations at "
                         f"{length:,.0f} {unit} per {sequence}, more than the linear part above "
                         f"{linear / quadratic:,.0f} {unit} per {sequence}")
        else:
            out[part] = f"{path}; linear in length (no quadratic term at the probe's three lengths)"
    return out


def exchange_bytes(model: Any, work: Any, split: int, precision: Precision) -> int:
    """Ulysses' all-to-all buffers at their peak, one exchange at a time: the parts sent (a copy of the tensor for this
    rank's tokens) and the parts received, both the size of the largest tensor exchanged (attention's q, Gated
    DeltaNet's projections, exchanged at once), in the compute dtype (0 without sequence parallelism). The joined
    result replaces the tensor it came from among the saved activations (SDPA keeps its q / k / v either way)."""
    if split <= 1:
        return 0
    config = model.backbone.config
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    widths = [heads * head_dim]  # q; k and v (replicated to N when fewer) are no wider
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        key, value = config.linear_num_key_heads * config.linear_key_head_dim, (
            config.linear_num_value_heads * config.linear_value_head_dim)
        widths.append(2 * key + 2 * value + 2 * config.linear_num_value_heads)
    return int(2 * max(widths) * work.tokens / split * precision.hidden_bytes)


def _sharding_bytes(strategy: str, segments: list[Segment], trained_bytes: int, precision: Precision) -> int:
    """FSDP2: the root unit (the LLM's modules outside its blocks, the head) stays unsharded through the step, two
    units are gathered at a time (the current one and the prefetched next: blocks, and the encoder's and the
    projector's own modules, `distributed.vision_units`), and one unit's gradients are unsharded before their
    reduce-scatter; in the compute dtype (NF4 weights as stored). DDP: its gradient buckets, one more copy of the
    gradients."""
    if strategy == "ddp":
        return trained_bytes
    if strategy != "fsdp2":
        return 0
    compute = precision.hidden_bytes / 4  # the gathered parameters in the compute dtype, counted in fp32 bytes

    def in_root(s: Segment) -> bool:
        return not s.key.is_block and s.key.part not in ("encoder", "projector")

    def gathered(s: Segment) -> float:  # NF4 weights are gathered as stored (torchao's all-gather hooks), not cast
        return (s.param_bytes - s.four_bit_bytes) * compute + s.four_bit_bytes

    units = [s for s in segments if not in_root(s)]
    biggest = max((gathered(s) for s in units), default=0)
    root = sum(gathered(s) for s in segments if in_root(s))
    return int(2 * biggest + root + max((s.trained_bytes for s in units), default=0))


def _chunk_bytes(rows: int, vocab: int, precision: Precision) -> int:
    """The chunked loss's logits alive at once (`Precision.logit_bytes` each): one fp32 chunk (fp32), or the bf16
    logits, their fp32 copy and the bf16 gradient (autocast)."""
    return min(rows, chunk_rows(vocab)) * vocab * precision.logit_bytes


def _transient(probe: dict[str, Any], precision: Precision) -> Line:
    """The probe's measured dynamic peak minus its own sweep and loss, fitted in tokens: the backward's
    temporaries (of one block at a time, so counted once)."""
    excess = []
    probed = probe_sweep_segments(probe)
    for point in probe["points"]:
        vision = (point["patches"], point["patches"] / point["images"])
        load = {"encoder": vision, "projector": vision, "backbone": (point["tokens"], point["tokens"] / point["rows"])}
        exact = [replace(s, acts=(float(point["saved"].get(str(s.key), 0)), 0.0, 0.0)) for s in probed]
        peak, _ = sweep(exact, load, set())
        loss = point["saved"].get(str(LOSS), 0) + _chunk_bytes(point["supervised"], PROBE_VOCAB, precision)
        excess.append({"tokens": point["tokens"], "rows": point["rows"],
                       "excess": max(point["dynamic"] - peak - loss, 0)})
    return fit(excess, "tokens", lambda p: p["excess"], "rows")


def _optimizer_temporaries(trained: list[nn.Parameter], device: str) -> int:
    """AdamW's step: on CUDA the foreach implementation makes one fp32 temporary the size of all trained tensors;
    on the CPU it goes tensor by tensor (two temporaries of the largest)."""
    if not trained:
        return 0
    if device == "cuda":
        return sum(p.numel() * 4 for p in trained)
    return 2 * max(p.numel() * 4 for p in trained)


def suggestions(config: RunConfig, *, gpus: int, device: str, probe: dict[str, Any],
                gpu_memory: int | None = None) -> list[tuple[str, int]]:
    """The usual changes that make a run fit, each planned alone: (change, its total per GPU); sequence parallelism
    at the smallest size that fits `gpu_memory` (`smallest_sequence_parallel`)."""
    base, modes = config.to_dict(), config.stages.modes()
    candidates = [(f"data.max_length: {config.data.max_length // 2}",
                   {"data": {"max_length": config.data.max_length // 2}})]
    if config.train.activation_checkpointing != "all":
        candidates.insert(0, ("train.activation_checkpointing: all", {"train": {"activation_checkpointing": "all"}}))
    if modes.get("backbone") == "full":
        candidates.append(("stages.backbone: lora", {"stages": {"preset": None, **modes, "backbone": "lora"}}))
    if modes.get("backbone") in ("full", "lora") and _pretrained_backbone(config):
        candidates.append(("stages.backbone: qlora", {"stages": {"preset": None, **modes, "backbone": "qlora"}}))
    changes = []
    for change, update in candidates:
        same_probe = "stages" not in update  # other stages save other activations: a probe of their own
        plan = predict(RunConfig.from_dict(_merge(base, update)), gpus=gpus, device=device,
                       probe=probe if same_probe else None)
        changes.append((change, plan.per_gpu["total"]))
    split = smallest_sequence_parallel(config, gpus=gpus, device=device, probe=probe, gpu_memory=gpu_memory)
    if split is not None:
        changes.append(split)
    if config.distributed.strategy != "ddp":  # DDP replicates: more GPUs do not lower its memory
        changes.append((f"--gpus {gpus * 2}", predict(config, gpus=gpus * 2, device=device, probe=probe).per_gpu[
            "total"]))
    return changes


def _pretrained_backbone(config: RunConfig) -> bool:
    """The run's backbone is read from a checkpoint (QLoRA needs one: its adapters merge into the source's weights)."""
    return bool(config.model.pretrained or config.model.model_config().backbone.pretrained)


def smallest_sequence_parallel(config: RunConfig, *, gpus: int, device: str, probe: dict[str, Any],
                               gpu_memory: int | None = None) -> tuple[str, int] | None:
    """The smallest `distributed.sequence_parallel` above the run's that fits `gpu_memory` on `gpus` devices (its
    change and total), else the largest one possible (the most it can do); None when no larger size is possible
    (the GPUs, or the heads, do not divide)."""
    from mmadapt.sequence_parallel import check_model

    model, _ = planning_model(config)
    base = config.to_dict()
    tried = None
    for size in range(config.distributed.sequence_parallel + 1, gpus + 1):
        if gpus % size:
            continue
        try:
            check_model(model, size)
        except ValueError:
            continue
        total = predict(RunConfig.from_dict(_merge(base, {"distributed": {"sequence_parallel": size}})), gpus=gpus,
                        device=device, probe=probe).per_gpu["total"]
        tried = (f"distributed.sequence_parallel: {size}", total)
        margin = cuda_margin(total) if device == "cuda" else 0
        if gpu_memory is not None and total + margin <= gpu_memory:
            return tried  # the smallest that fits
    return tried


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out
