"""The GRPO loss of a model equals trl's `GRPOTrainer`: the same tiny model exported to transformers, the same batch.

The acceptance check of issue 47, a model-level one (tests/test_grpo_loss.py checks the arithmetic on fixed tensors).
A tiny model (LLaVA-1.5: CLIP + mlp2x_gelu + Llama; Qwen3.5: its ViT + merger + the hybrid backbone) is exported with
`save_pretrained(format="transformers", processor_export=export_processor)` and loaded by `AutoModelForImageTextToText`.
The fixed batch: 2 prompts (one with two pictures, one text-only, of different lengths) x G = 2 completions of fixed
random token ids, ragged (5, 2, 4, 3 tokens: a completion mask), advantages of both signs, old per-token log-probs = the
current ones off by fixed
noise (ratios outside [1 - 0.2, 1 + 0.28] on both sides, none near a clip boundary), and for beta > 0 fixed reference
log-probs; sampling temperature 0.9.

mmadapt: `scored_rows` (each prompt's tokens then its completion, right-padded, each picture once per group) ->
`forward(head=TokenLogps(0.9))` -> `completion_logps` -> `policy_loss`. trl 1.16: its own
`GRPOTrainer._compute_loss` on an `object.__new__(GRPOTrainer)` that holds only the attributes it reads, its real
`_get_per_token_logps_and_entropies` running the export patched by trl's `add_fused_lm_head` (as `GRPOTrainer.__init__`
patches it, temperature included), the inputs laid out as trl's generation step lays them out: prompts left-padded,
each row's pictures repeated per row with `num_images`, Qwen's `mm_token_type_ids` left-padded and extended with zeros
over the completion. For grpo, dapo and dr_grpo, beta 0 and 0.04, fp32, asserted: the same tokens in every row, the
loss within 1e-5, trl's logged clip / KL metrics within 1e-5, and the gradient of every parameter (LLM layers,
embeddings and lm_head, vision tower, projector; mapped to transformers' names by the export's own key map) per
element |ours - trl's| <= 1e-5 + 1e-5 |trl's| (torch.allclose's rule; measured: loss <= 5e-8, gradients <= 3e-7 of
up to 0.45). The old and reference log-probs are offsets of mmadapt's own, so trl's ratios are exp(its log-probs -
mmadapt's - offset): the loss compares the two forwards token by token.

Layout, not numbers: trl's Llama places a left-padded row's tokens at positions shifted by its padding (transformers
counts positions from the row's first column), mmadapt's right-padded rows from 0; RoPE depends on relative positions
only, so the two agree within rounding. Qwen's mRoPE skips padding on both sides.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import mmadapt
from mmadapt.convert import ARCHITECTURES, export_architecture, rename
from mmadapt.heads import TokenLogps
from mmadapt.processor import export_processor
from mmadapt.synthetic import synthetic_batch
from mmadapt.train.objectives.grpo.loss import PolicyLoss, policy_loss
from mmadapt.train.objectives.rollout import Rollouts, completion_logps, scored_rows

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # two tiny models built and exported (~2.5 s), then ~0.2 s a case: ~7.5 s on one thread

ATOL = RTOL = 1e-5
G, TEMPERATURE, PAD = 2, 0.9, 0
LENGTHS = (5, 2, 4, 3)  # the completions' tokens (R = 4 rows: prompt 0's two, then prompt 1's)
ADVANTAGES = torch.tensor([0.9, -0.7, 1.3, -1.1])
EPSILON, EPSILON_HIGH, MAX_COMPLETION_LENGTH = 0.2, 0.28, 8
FAMILIES = {"llava": ("clip", "mlp2x_gelu", "llama"), "qwen3_5": ("qwen3_5_vit", "qwen_merger", "qwen3_5")}
# the export's parameters whose gradients must not all be zero: vision tower, projector, LLM, head
TRAINED = {"llava": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head."),
           "qwen3_5": ("model.visual.blocks.", "model.visual.merger.", "model.language_model.", "lm_head.")}


class Accelerator:
    """What `_compute_loss` and trl's profiling decorator ask of the accelerator, for one process."""

    num_processes, sync_gradients, is_main_process = 1, True, True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def autocast(self):
        return nullcontext()


def trl_trainer(settings: PolicyLoss):
    """A `GRPOTrainer` holding only what `_compute_loss` reads (its log-probs: its own forward of the model given)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        loss_type=settings.loss_type, beta=settings.beta, epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon_upper, max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        aux_loss_enabled=False, use_vllm=False, vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True),
        accelerator=Accelerator(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=1))
    return trainer


def fixed_completions(model) -> Rollouts:
    """R = 4 completions of random non-special token ids, `PAD` after their ends."""
    tokens = model.tokens
    special = {tokens.image_token_id, tokens.vision_start_token_id, tokens.vision_end_token_id, tokens.video_token_id}
    vocab = torch.tensor([t for t in range(model.backbone.config.vocab_size) if t not in special])
    mask = torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]
    picks = torch.randint(len(vocab), mask.shape, generator=torch.Generator().manual_seed(47))
    return Rollouts(vocab[picks].masked_fill(~mask, PAD), mask, torch.zeros(len(LENGTHS), dtype=torch.bool), G)


def trl_inputs(prompts: dict, done: Rollouts, image_token_id: int) -> dict:
    """The rows as trl's generation step hands them to `_compute_loss` (before old / ref / advantages)."""
    rows = done.completions.shape[0]
    valid = prompts["attention_mask"].bool()
    width = int(valid.sum(1).max())
    prompt_ids = torch.full((rows, width), PAD, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width), dtype=torch.long)
    for r in range(rows):  # left-padded, as trl's processor pads prompts
        ids = prompts["input_ids"][r // G][valid[r // G]]
        prompt_ids[r, width - len(ids):], prompt_mask[r, width - len(ids):] = ids, 1
    per_prompt = prompts["images_per_sample"]
    first = torch.cumsum(per_prompt, 0) - per_prompt
    images = [i for r in range(rows) for i in range(int(first[r // G]), int(first[r // G] + per_prompt[r // G]))]
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": done.completions,
           "completion_mask": done.mask.long(), "num_images": per_prompt.repeat_interleave(G).tolist()}
    grids = prompts.get("image_grid_thw")
    if grids is None:  # LLaVA: one (C, H, W) picture per image
        return {**out, "pixel_values": prompts["pixel_values"][images]}
    patches = grids.prod(-1)
    starts = torch.cumsum(patches, 0) - patches
    pixels = [prompts["pixel_values"][int(starts[i]):int(starts[i] + patches[i])] for i in images]
    types = torch.cat([(prompt_ids == image_token_id).long(), torch.zeros_like(done.completions)], dim=1)
    return {**out, "pixel_values": torch.cat(pixels), "image_grid_thw": grids[images], "mm_token_type_ids": types}


def fixed_noise(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Offsets of random sign, |x| in [0.02, 0.1] or [0.4, 0.6]: a ratio exp(-x) far from the clip bounds
    (0.8 <-> x = 0.22, 1.28 <-> x = -0.25), so that no rounding difference flips a clip."""
    g = torch.Generator().manual_seed(seed)
    size = torch.where(torch.rand(shape, generator=g) < 0.5, 0.02 + 0.08 * torch.rand(shape, generator=g),
                       0.4 + 0.2 * torch.rand(shape, generator=g))
    return size * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)


@pytest.fixture(scope="module", params=list(FAMILIES))
def setup(request, tmp_path_factory):
    """The mmadapt model, its transformers export (patched as `GRPOTrainer.__init__` patches it), the batch."""
    from transformers import AutoModelForImageTextToText
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = mmadapt.build_model(*FAMILIES[request.param]).train()
    path = tmp_path_factory.mktemp(f"grpo-{request.param}")
    model.save_pretrained(path, format="transformers", processor_export=export_processor)
    export = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).train()
    add_fused_lm_head(export, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    prompts = synthetic_batch(model, (2, 0), text_lengths=[4, 7], seed=1)  # right-padded; prompt 1 has no picture
    del prompts["labels"]
    done = fixed_completions(model)
    rows = scored_rows(prompts, done, PAD)
    with torch.no_grad():  # the current log-probs: the old and reference ones are fixed offsets of them
        current = completion_logps(model(**rows, head=TokenLogps(TEMPERATURE)).logps, rows["labels"], done)
    old = current + fixed_noise(current.shape, 1)
    ref = current + 0.5 * fixed_noise(current.shape, 2)
    inputs = trl_inputs(prompts, done, model.tokens.image_token_id)
    return SimpleNamespace(family=request.param, model=model, export=export, done=done, rows=rows, inputs=inputs,
                           old=old, ref=ref)


def test_trl_scores_the_same_tokens_left_padded(setup):
    s = setup
    ids = torch.cat([s.inputs["prompt_ids"], s.inputs["completion_ids"]], dim=1)
    attended = torch.cat([s.inputs["prompt_mask"], s.inputs["completion_mask"]], dim=1).bool()
    assert not attended[:, 0].all()  # some prompt really is left-padded
    for r in range(ids.shape[0]):
        assert ids[r][attended[r]].tolist() == s.rows["input_ids"][r][s.rows["attention_mask"][r].bool()].tolist()
    assert s.inputs["num_images"] == [2, 2, 0, 0]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_grpo_loss_and_gradients_equal_trls_grpo_trainer(setup, loss_type, beta):
    s = setup
    settings = PolicyLoss(loss_type=loss_type, beta=beta, epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
                          max_completion_length=MAX_COMPLETION_LENGTH)
    mask = s.done.mask.long()
    s.model.zero_grad(set_to_none=True)
    s.export.zero_grad(set_to_none=True)

    trainer = trl_trainer(settings)
    inputs = {**s.inputs, "advantages": ADVANTAGES, "old_per_token_logps": s.old,
              "ref_per_token_logps": s.ref if beta else None, "num_items_in_batch": mask.sum()}
    theirs = trainer._compute_loss(s.export, inputs)
    theirs.backward()
    their_metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}

    scored = s.model(**s.rows, head=TokenLogps(TEMPERATURE, entropy=True))
    logps, entropy = completion_logps(scored.logps, s.rows["labels"], s.done), scored.entropy
    terms = policy_loss(logps, s.old, s.ref if beta else None, ADVANTAGES, mask, settings)
    terms.loss.backward()
    entropies = completion_logps(entropy, s.rows["labels"], s.done)  # trl's logged entropy: the tokens' mean
    assert abs(float((entropies * mask).sum() / mask.sum()) - their_metrics["entropy"]) <= ATOL

    assert abs(terms.loss.item() - theirs.item()) <= ATOL, (terms.loss.item(), theirs.item())
    ours_metrics = terms.stats.means()
    assert ours_metrics["clip_ratio/low_mean"] > 0 and ours_metrics["clip_ratio/high_mean"] > 0  # both sides clip
    assert ours_metrics == pytest.approx({k: their_metrics[k] for k in ours_metrics}, abs=ATOL)

    keys = ARCHITECTURES[export_architecture(s.model)].keys
    ours = rename({name: p.grad for name, p in s.model.named_parameters() if p.grad is not None},
                  tuple((new, old) for old, new in keys))
    their_grads = {name: p.grad for name, p in s.export.named_parameters() if p.grad is not None}
    assert set(ours) == set(their_grads), sorted(set(ours) ^ set(their_grads))[:5]
    for prefix in TRAINED[s.family]:
        assert any(float(g.abs().max()) > 0 for k, g in their_grads.items() if k.startswith(prefix)), prefix
    worst = max((float(((ours[k] - their_grads[k]).abs() - RTOL * their_grads[k].abs()).max()), k) for k in ours)
    assert worst[0] <= ATOL, worst
