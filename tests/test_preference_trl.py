"""DPO equals trl's `DPOTrainer`: the same tiny model exported to transformers, the same pairs with images, beta 0.1.

A tiny model (LLaVA-1.5: CLIP + mlp2x_gelu + Llama with the real Llama-2 tokenizer and vicuna_v1; Qwen3.5 with the
real Qwen3 tokenizer and its official template, thinking off) is exported with `save_pretrained(format=
"transformers")`; trl 1.16's `DPOTrainer` loads the export (policy and reference) and computes its sigmoid loss on one
batch of two image pairs through its own code path (`get_train_dataloader` -> `compute_loss` -> `backward`). mmadapt
encodes the same records (`PairEncoder`, `PairCollator`: the prompt's image once per pair), takes its reference from
the starting model (as `compute_table` precomputes it) and runs `PairScorer.terms` on the model whose lm_head
moved by the same delta as trl's policy. Asserted: the same token rows and answer positions as trl's, and the loss and
every gradient (mapped to transformers' names by the export's own key map) within 1e-5 (fp32; gradients: 1e-5 +
1e-5 x |trl's|, per element).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from real_tokenizers import real_tokenizer

import mmadapt
from mmadapt import Processor
from mmadapt.convert import ARCHITECTURES, export_architecture, rename
from mmadapt.data import TEMPLATES
from mmadapt.data.preference import PairCollator, PairEncoder, PreferenceDataset
from mmadapt.heads import SequenceLogps
from mmadapt.processor import export_processor
from mmadapt.train.batches import inputs_of
from mmadapt.train.objectives import PairScorer, ReferenceTable
from mmadapt.train.objectives.dpo.settings import DpoSettings

trl = pytest.importorskip("trl")

ATOL = RTOL = 1e-5
QUESTIONS = ["What colour is it?", "Describe the picture."]
CHOSEN = ["Red.", "A blue square."]
REJECTED = ["It is green, I think.", "Nothing"]
COLOURS = [(255, 0, 0), (0, 0, 255)]
FAMILIES = {"llava": (("clip", "mlp2x_gelu", "llama"), "llama2", None, {}),
            "qwen3_5": (("qwen3_5_vit", "qwen_merger", "qwen3_5"), "qwen3", "qwen3_5", {"enable_thinking": False})}


def exported(family: str, path: Path):
    parts, tok_name, template, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    model = mmadapt.build_model(*parts)
    tokenizer = real_tokenizer(tok_name)
    if template:
        tokenizer.chat_template = TEMPLATES.get(template).jinja(tokenizer)
    processor = Processor.for_model(model, tokenizer)
    model.save_pretrained(path, format="transformers", processor_export=export_processor, tokenizer=processor.tokenizer)
    return model, processor.tokenizer, kwargs


def records(root: Path) -> list[dict]:
    out = []
    for k, (q, c, r, colour) in enumerate(zip(QUESTIONS, CHOSEN, REJECTED, COLOURS, strict=True)):
        Image.new("RGB", (64, 64), colour).save(root / f"{k}.png")
        out.append({"id": f"pair{k}", "images": [f"{k}.png"],
                    "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                    "chosen": [{"role": "assistant", "content": [{"type": "text", "text": c}]}],
                    "rejected": [{"role": "assistant", "content": [{"type": "text", "text": r}]}]})
    return out


def trl_step(path: Path, rows: list[dict], root: Path, delta: torch.Tensor, kwargs: dict, out: Path):
    """trl's loss and gradients on one batch of `rows` (its own collator and code path)."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import DPOConfig, DPOTrainer

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.add_(delta)
    data = [{**{k: r[k] for k in ("prompt", "chosen", "rejected")},
             "images": [Image.open(root / p).convert("RGB") for p in r["images"]],
             **({"chat_template_kwargs": kwargs} if kwargs else {})} for r in rows]
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=len(rows), bf16=False, fp16=False, use_cpu=True,
                     report_to=[], max_length=None, remove_unused_columns=False, train_sampling_strategy="sequential",
                     precompute_ref_log_probs=False, gradient_checkpointing=False, loss_type=["sigmoid"], beta=0.1,
                     label_smoothing=0.0, disable_dropout=True, dataloader_num_workers=0, seed=0)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(data),
                         processing_class=processor)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    return float(loss), grads, batch


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


@pytest.mark.slow  # trl's trainer and two transformers models: ~10 s a family
@pytest.mark.parametrize("family", ["llava", "qwen3_5"])
def test_the_dpo_loss_and_gradients_equal_trls_dpo_trainer(family, tmp_path):
    path = tmp_path / "export"
    model, tokenizer, kwargs = exported(family, path)
    root = tmp_path / "data"
    root.mkdir()
    rows = records(root)
    delta = 0.02 * torch.randn(model.backbone.get_output_embeddings().weight.shape,
                               generator=torch.Generator().manual_seed(1234))
    theirs, their_grads, their_batch = trl_step(path, rows, root, delta, kwargs, tmp_path / "trl")

    encoder = mmadapt.data.SampleEncoder.for_model(model, tokenizer, image_root=str(root), template_kwargs=kwargs)
    dataset = PreferenceDataset(rows, PairEncoder(encoder))
    collate = PairCollator.for_model(model, encoder.pad_token_id)
    batch = collate([dataset[0], dataset[1]])
    assert batch["pixel_values"].shape[0] == (2 if family == "llava" else batch["pixel_values"].shape[0])
    assert batch["image_index"].tolist() == [0, 1, 0, 1]  # each pair's image encoded once, read by both rows

    # the same sequences and the same answer positions as trl's (rows: chosen 0, chosen 1, rejected 0, rejected 1);
    # with Qwen's template trl also scores the "\n" after <|im_end|> (the turn separator, which mmadapt's SFT and
    # preference rows leave unscored, as the assistant masks of transformers' templates do): that one position is
    # scored on mmadapt's side too here, so that the arithmetic is compared on the same tokens
    newline = tokenizer.convert_tokens_to_ids("\u010a") if family == "qwen3_5" else None
    for r in range(4):
        valid = batch["attention_mask"][r]
        ours = batch["input_ids"][r][valid].tolist()
        their_mask = their_batch["attention_mask"][r].bool()
        assert ours == their_batch["input_ids"][r][their_mask].tolist(), f"row {r}"
        our_answer = (batch["labels"][r][valid] != -100).nonzero().flatten().tolist()
        their_answer = their_batch["completion_mask"][r][their_mask].nonzero().flatten().tolist()
        if newline is not None:
            assert their_answer == [*our_answer, our_answer[-1] + 1] and ours[our_answer[-1] + 1] == newline
            batch["labels"][r, our_answer[-1] + 1] = newline
        else:
            assert our_answer == their_answer, f"row {r}"

    model.train()
    with torch.no_grad():  # the reference: the starting model's log-probs of the pairs, as `compute_table` keeps them
        start = model(**inputs_of(batch), head=SequenceLogps()).logps
    table = torch.stack(start.chunk(2), dim=1)
    with torch.no_grad():
        model.backbone.get_output_embeddings().weight.add_(delta)
    objective = PairScorer(DpoSettings(beta=0.1), model, "precomputed", ReferenceTable({"train": table}, {}))
    terms, _ = objective.terms(model, batch, torch.device("cpu"))
    loss = terms.losses.mean()
    loss.backward()
    assert abs(float(loss) - theirs) <= ATOL, (float(loss), theirs)

    keys = ARCHITECTURES[export_architecture(model)].keys
    ours = rename({name: p.grad for name, p in model.named_parameters() if p.grad is not None},
                  tuple((new, old) for old, new in keys))
    assert set(ours) == set(their_grads), sorted(set(ours) ^ set(their_grads))[:5]
    # per element |ours - theirs| <= 1e-5 + 1e-5 |theirs| (torch.allclose's rule): a tied (V, D) embedding's
    # gradient sums the head's and the embedding's parts in a different order than transformers does
    worst = max((float(((ours[k] - their_grads[k]).abs() - RTOL * their_grads[k].abs()).max()), k) for k in ours)
    assert worst[0] <= ATOL, worst


def test_trl_records_are_read_as_trl_writes_them(tmp_path):
    """A plain-string trl record and a conversational one render the same pair."""
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    encoder = mmadapt.data.SampleEncoder.for_model(model, mmadapt.data.char_tokenizer(), image_root=str(tmp_path))
    Image.new("RGB", (32, 32), (9, 9, 9)).save(tmp_path / "a.png")
    plain = {"prompt": "<image>\nWhat is it?", "chosen": "A dot.", "rejected": "A cat.", "images": ["a.png"]}
    chat = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]}],
            "chosen": [{"role": "assistant", "content": "A dot."}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}], "images": ["a.png"]}
    pairs = PairEncoder(encoder)
    a, b = pairs.encode(plain, 0), pairs.encode(chat, 1)
    assert a.chosen.input_ids.tolist() == b.chosen.input_ids.tolist()
    assert a.rejected.input_ids.tolist() == b.rejected.input_ids.tolist()
