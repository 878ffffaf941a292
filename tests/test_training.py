"""Cross-family combinations learn: 20 AdamW steps on one fixed tiny batch lower the loss."""

from __future__ import annotations

import pytest
import torch

import mmadapt
from mmadapt.synthetic import synthetic_batch


@pytest.mark.parametrize("names", [("clip", "mlp2x_gelu", "qwen3_5"), ("qwen3_5_vit", "qwen_merger", "llama")])
def test_twenty_steps_lower_the_loss(names):
    torch.manual_seed(0)
    model = mmadapt.build_model(*names).train()
    batch = synthetic_batch(model, (1, 2), seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(20):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("names", [("qwen3_5_vit", "qwen_merger", "qwen3_5"), ("clip", "mlp2x_gelu", "llama"),
                                   ("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe")],
                         ids=["qwen3_5", "llava", "deepstack-moe"])
def test_a_text_only_batch_runs_the_vision_side_with_exactly_zero_effect(names, monkeypatch):
    """What a rank without images does in a multi-process step (`runs_vision_for_every_batch`, forced here): the encoder
    and projector (DeepStack levels included) run on a minimal input, the loss and the backbone's gradients are
    bit for bit those of the text-only forward, and every vision parameter gets an exactly-zero gradient."""
    torch.manual_seed(0)
    model = mmadapt.build_model(*names).train()
    batch = synthetic_batch(model, (0, 0), seed=3)
    assert batch.get("pixel_values") is None

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert not model.runs_vision_for_every_batch()  # one process: nothing to keep in step
    loss, grads = step()
    assert not any(n.startswith(("encoder.", "projector.")) for n in grads)
    monkeypatch.setattr(model, "runs_vision_for_every_batch", lambda: True)
    loss_with, grads_with = step()
    assert torch.equal(loss, loss_with)
    vision = {n: g for n, g in grads_with.items() if n.startswith(("encoder.", "projector."))}
    with_images = synthetic_batch(model, (1, 0), seed=3)
    model.zero_grad(set_to_none=True)
    model(**with_images).loss.backward()  # the vision parameters an image reaches (CLIP's last layer is unused)
    side = ("encoder.", "projector.")
    reached = [n for n, p in model.named_parameters() if p.grad is not None and n.startswith(side)]
    assert sorted(vision) == sorted(reached) and all(not g.any() for g in vision.values())
    assert grads.keys() == grads_with.keys() - vision.keys()
    assert all(torch.equal(grads[n], grads_with[n]) for n in grads)


def test_which_forwards_run_the_vision_side_for_a_batch_without_pictures(tmp_path, monkeypatch):
    """`runs_vision_for_every_batch` in a multi-process run (a 1-rank gloo group here, told it has 2 ranks once the
    parts are wrapped): a vision side sharded by FSDP2 runs for every batch, in training and eval, with gradients or
    without (each forward gathers its parameters); an unsharded one (DDP) only in a training forward with gradients
    whose vision side trains (its backward reduces their gradients); frozen and unsharded, never; one process, never."""
    from torch import distributed as dist

    from mmadapt.precision import as_precision
    from mmadapt.train import distributed as dist_utils

    ddp, fsdp = (mmadapt.build_model("clip", "mlp2x_gelu", "llama") for _ in range(2))
    ddp.encoder.requires_grad_(False)  # the default stages: the projector trains
    assert not ddp.runs_vision_for_every_batch()  # one process
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dist_utils.shard(fsdp, dist_utils.DistContext(0, 1, torch.device("cpu")), as_precision("fp32"))
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        for training in (True, False):
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    assert fsdp.train(training).runs_vision_for_every_batch()
                    assert ddp.train(training).runs_vision_for_every_batch() == (training and grad), (training, grad)
        ddp.projector.requires_grad_(False)
        assert not ddp.train().runs_vision_for_every_batch()  # frozen and unsharded: nothing to pair
    finally:
        dist.destroy_process_group()


CHECKPOINTED = {  # every backbone family, with the DeepStack, packed and LoRA combinations
    "llama": (("clip", "mlp2x_gelu", "llama"), {}),
    "qwen3_5 packed": (("qwen3_5_vit", "qwen_merger", "qwen3_5"), {"packed": True}),
    "qwen3_5_moe": (("timm", "mlp2x_gelu", "qwen3_5_moe"), {}),
    "qwen3_vl DeepStack": (("qwen3_vl_vit", "qwen_merger", "qwen3_vl"), {}),
    "qwen3_vl_moe DeepStack packed": (("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe"), {"packed": True}),
    "llava LoRA": (("siglip", "mlp2x_gelu", "llama"), {"lora": True}),
    "qwen3_5 LoRA packed": (("qwen3_5_vit", "qwen_merger", "qwen3_5"), {"lora": True, "packed": True}),
}


@pytest.mark.parametrize("case", list(CHECKPOINTED))
def test_activation_checkpointing_gives_the_same_loss_and_gradients(case):
    """fp32: loss and every gradient within 1e-6 relative (in fact equal) with the backbone's decoder layers and the
    encoder's blocks recomputed in the backward; a hook counts the recomputation, so it really happened."""
    from mmadapt.data import Collator
    from mmadapt.synthetic import synthetic_samples
    from mmadapt.train import apply_stages
    from mmadapt.train.config import StagesSection
    from mmadapt.train.optim import enable_activation_checkpointing

    names, options = CHECKPOINTED[case]
    torch.manual_seed(0)
    model = mmadapt.build_model(*names).train()
    if options.get("lora"):
        apply_stages(model, StagesSection(preset="lora"))
    samples = synthetic_samples(model, [1, 2, 0], text_lengths=[5, 9, 7], seed=2)
    batch = Collator.for_model(model, 0, max_tokens=512 if options.get("packed") else None)(samples)
    batch = {k: v for k, v in batch.items() if k != "meta"}
    assert ("cu_seqlens" in batch) == bool(options.get("packed"))

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    enable_activation_checkpointing(model, "all")
    calls = []
    # transformers checkpoints the layer's forward, so a hook inside it sees the recomputation (a pre-hook: the
    # recomputation stops once it has every saved tensor, before the MLP returns)
    inside = model.backbone.get_decoder().layers[0].mlp
    vision = next(m for n, m in model.encoder.named_modules() if n.endswith("mlp"))  # the first vision block's
    vision_calls = []
    handles = [inside.register_forward_pre_hook(lambda *_: calls.append(1)),
               vision.register_forward_pre_hook(lambda *_: vision_calls.append(1))]
    loss_ac, grads_ac = step()
    for handle in handles:
        handle.remove()
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    assert len(vision_calls) == (1 if options.get("lora") else 2)  # a frozen encoder has no backward to recompute
    assert abs(float(loss_ac) - float(loss)) <= 1e-6 * abs(float(loss))
    assert grads.keys() == grads_ac.keys() and len(grads) > 4
    for name, g in grads.items():
        assert (grads_ac[name] - g).norm() <= 1e-6 * g.norm() + 1e-12, name
