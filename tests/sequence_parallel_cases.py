"""Model-level sequence-parallel cases, run under torchrun by tests/test_sequence_parallel.py.

`torchrun --nproc_per_node N sequence_parallel_cases.py OUT CASE [CASE ...]`: every rank builds the same tiny model
and batch, computes one process's result itself (the model without `sequence_parallel`), then the same forward and
backward as a rank of an SP group of N; the group's gradients are summed (as the trainer's reduction does) and rank 0
writes, per case, the loss's relative difference and the largest gradient difference to OUT/CASE.json. A case whose
forward raises writes the error instead.

Shapes chosen so that the split point cuts an image span, rows have different (and odd) lengths, packed rows mix
text and image samples, and Qwen3-VL's batch has a video, an image and DeepStack levels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mmadapt import VisionLanguageModel, sequence_parallel
from mmadapt.data import Collator
from mmadapt.heads import SequenceLogps, TokenLogps, TokenLosses
from mmadapt.sequence_parallel import SequenceParallel
from mmadapt.synthetic import synthetic_batch, synthetic_samples, synthetic_video_batch

TAKE = sequence_parallel.take
MODELS = {"llava": ("clip", "mlp2x_gelu", "llama"), "qwen3_vl": ("qwen3_vl_vit", "qwen_merger", "qwen3_vl"),
          "qwen3_5": ("qwen3_5_vit", "qwen_merger", "qwen3_5")}


def model_for(family: str) -> VisionLanguageModel:
    torch.manual_seed(0)
    model = VisionLanguageModel.from_names(*MODELS[family])
    with torch.no_grad():  # LoRA-free full training: every parameter trains, none starts at exactly 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.train()


def batch_for(case: str, model: VisionLanguageModel) -> dict:
    if case in ("llava", "llava_odd"):  # two rows, one image each, the first row's image crossing the split
        batch = synthetic_batch(model, (1, 2), text_lengths=(7, 5 if case == "llava_odd" else 6))
    elif case == "qwen3_vl":  # a video and an image in one row, a video in the other; DeepStack levels
        batch = synthetic_video_batch(model, (("video", "image"), ("video",)),
                                      video_shapes=((4, 32, 48), (6, 48, 32)), image_sides=((32, 32),),
                                      text_lengths=(9, 5))
    else:  # packed rows of mixed text and image samples
        samples = synthetic_samples(model, (1, 0, 2, 0), text_lengths=(9, 7, 6, 11))
        batch = Collator.for_model(model, 0, max_tokens=max(len(s) for s in samples) + 12)(samples)
        batch.pop("meta")
    if model.uses_mrope and "mm_token_type_ids" not in batch:
        ids = batch["input_ids"]
        batch["mm_token_type_ids"] = (ids == model.tokens.image_token_id).int() + 2 * (
            ids == model.tokens.video_token_id).int()
    return batch


def sharded_vision_batch(family: str, model: VisionLanguageModel) -> dict:
    """The batches of the sharded-vision cases: Qwen3-VL's with its first video's three temporal patches cut between
    the ranks; "llava_one" one image only (rank 0 encodes nothing: its run on no picture); "llava_shared" four rows
    showing three encoded images; else the family's."""
    if family == "qwen3_vl":
        batch = synthetic_video_batch(model, (("video", "image"), ("video",)),
                                      video_shapes=((6, 32, 48), (4, 48, 32)), image_sides=((32, 32),),
                                      text_lengths=(9, 5))
        return _with_token_types(batch, model)
    if family == "llava_one":
        return synthetic_batch(model, (1, 0), text_lengths=(7, 6))
    if family == "llava_shared":  # rows sharing images, as a preference batch's pairs do (`image_index`)
        batch = synthetic_batch(model, (1, 2), text_lengths=(7, 6))
        rows = ("input_ids", "attention_mask", "labels", "images_per_sample")
        return batch | {k: torch.cat([batch[k], batch[k]]) for k in rows} | {"image_index": torch.tensor([0, 1, 2] * 2)}
    return batch_for(family, model)


def _with_token_types(batch: dict, model: VisionLanguageModel) -> dict:
    ids = batch["input_ids"]
    if "mm_token_type_ids" not in batch:
        batch["mm_token_type_ids"] = (ids == model.tokens.image_token_id).int() + 2 * (
            ids == model.tokens.video_token_id).int()
    return batch


def pieces(model: VisionLanguageModel, batch: dict, size: int) -> list[list]:
    """How `mmadapt.sequence_vision.assign` cuts the batch's pictures: [rank, video, index, first frame, frames]."""
    from mmadapt.batch import VisionBatch
    from mmadapt.sequence_vision import assign

    if batch.get("pixel_values") is None and batch.get("pixel_values_videos") is None:
        return []
    return [[p.rank, p.video, p.index, p.first, p.frames] for p in assign(model, VisionBatch.of(batch), size)]


def forward_and_grads(model: VisionLanguageModel, batch: dict, head: str) -> tuple[torch.Tensor, dict, dict]:
    """The loss, every parameter's gradient, and the head's side results (`extra`: DPO's reference states and KL)."""
    model.zero_grad()
    labels = batch["labels"]
    n = int((labels[:, 1:] != -100).sum())
    extra = {}
    if head == "loss":
        loss = model(**batch, num_items_in_batch=n).loss
    elif head == "token_losses":
        loss = model(**batch, num_items_in_batch=n, head=TokenLosses()).loss
    elif head == "sequence":
        out = model(**batch, head=SequenceLogps())
        loss = (out.logps * torch.arange(1.0, out.logps.shape[0] + 1)).sum() / n  # rows weighed unequally
    elif head == "sequence_kl":  # DPO's adapters reference: its states kept, then the policy's token KL to them
        output = model.backbone.get_output_embeddings()
        with torch.no_grad():
            states = model(**batch, head=SequenceLogps(keep_states=True)).states
        out = model(**batch, head=SequenceLogps(reference=(states * 3.0, output)))
        loss = out.logps.sum() / n
        extra = {"states": states, "kl": out.kl}
    else:
        out = model(**batch, head=TokenLogps(temperature=0.7))
        loss = (out.logps * torch.linspace(0.5, 1.5, out.logps.shape[1])).sum() / n
    loss.backward()
    # every parameter, a rank's shard possibly reaching none of some (no supervised position: not the output layer)
    return loss.detach(), {k: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                           for k, p in model.named_parameters()}, extra


def crossing(batch: dict, model: VisionLanguageModel, size: int) -> bool:
    """Whether an image span runs across a split point of the (padded) sequence."""
    from mmadapt.contract import locate

    spans = locate(batch["input_ids"], model.tokens.image_token_id)
    length = batch["input_ids"].shape[1]
    n = (length + size - 1) // size
    cuts = [k * n for k in range(1, size)]
    return any(int(s) < cut < int(s) + int(k) for s, k in zip(spans.start, spans.length, strict=True) for cut in cuts)


def shifted_take(inputs, shards):
    """A wrong split: this rank's embeddings taken one position to the right of its tokens."""
    shard = TAKE(inputs, shards)
    embeds = inputs.inputs_embeds
    moved = torch.cat([embeds[:, 1:], embeds[:, :1]], dim=1)
    shard.inputs["inputs_embeds"] = shards.mine(moved)
    return shard


def run_case(case: str, out: Path, rank: int, size: int) -> None:
    if case == "shifted":  # the split is wrong on every rank; the contract names rank 1's first broken position
        sequence_parallel.take = shifted_take
        try:
            return run_case("llava", out / "shifted", rank, size)
        finally:
            sequence_parallel.take = TAKE
    family, _, head = case.partition(":")
    vision = "sharded" if head == "vision_sharded" else "replicated"
    head = "loss" if vision == "sharded" else head or "loss"
    model = model_for("llava" if family.startswith("llava") else family)
    batch = batch_for(family, model) if vision == "replicated" else sharded_vision_batch(family, model)
    expected_loss, expected, expected_extra = forward_and_grads(model, batch, head)
    model.sequence_parallel = SequenceParallel(dist.group.WORLD, size, rank, vision=vision)
    hook = model.encoder.register_forward_pre_hook(lambda _, args: encoded.append(int(args[0].shape[0])))
    encoded: list[int] = []  # the pixel rows (or images) this rank's encoder took in the SP forward
    try:
        loss, grads, extra = forward_and_grads(model, batch, head)
    except Exception as e:  # the error is the case's result (each rank's: rank 1's file last)
        errors = [None] * size
        dist.all_gather_object(errors, f"{type(e).__name__}: {e}")
        if rank == 0:
            name = out.name if out.name == "shifted" else case
            failed = [error for error in errors if error and "rank 1 of" in error] or errors
            (out.parent if name == "shifted" else out).joinpath(f"{name}.json").write_text(
                json.dumps({"error": failed[0]}))
        return
    finally:
        model.sequence_parallel = None
        hook.remove()
    seen = [None] * size
    dist.all_gather_object(seen, encoded)
    for g in grads.values():
        dist.all_reduce(g)
    if rank == 0:
        worst = max(expected, key=lambda k: float((grads.get(k, torch.zeros(())) - expected[k]).abs().max()))
        result = {"loss": float(loss), "expected_loss": float(expected_loss),
                  "loss_rel": abs(float(loss) - float(expected_loss)) / abs(float(expected_loss)),
                  "extra_max": max((float((extra[k] - v).abs().max()) for k, v in expected_extra.items()), default=0.0),
                  "kl": float(expected_extra["kl"].abs().sum()) if "kl" in expected_extra else None,
                  "grad_max": float((grads.get(worst, torch.zeros(())) - expected[worst]).abs().max()),
                  "worst": worst,
                  "length": int(batch["input_ids"].shape[1]), "crossing": crossing(batch, model, size),
                  "encoded": seen, "pieces": pieces(model, batch, size)}
        (out / f"{case}.json").write_text(json.dumps(result))


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        run_case(case, out, rank, size)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
