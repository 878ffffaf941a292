"""Preference pairs and `train.objective: dpo`: formats, the prompt's images once, never cut, the losses' formulas,
sequence log-probs without logits, the references, the preference view, and a tiny model that learns a preference
that needs its image.

Tolerances: sequence log-probs and their gradients vs full logits, 1e-5 (fp32); the losses vs their papers' formulas,
1e-6; a shared-image batch vs the same rows each with its own copy of the image, 1e-6. The trained test: a tiny
Qwen3.5 (random init, character tokenizer) trained 30 steps with DPO on 64 pairs "what colour is it?" -> chosen: the
colour, rejected: another; measured on 32 held-out pairs, seeds 0-2 (full training, precomputed reference) and seed 0
with LoRA (the adapters-off reference). Seen across seeds and 1 / 2 threads: held-out reward accuracy 1.0, margin
(reward / beta) 6.2-10.2 with real images, 0.08-0.44 blanked (accuracy 0.50-0.59), -0.8 to -1.9 shuffled; before
training the model's own preference is at chance (0.47). Asserted: >= 0.9 accuracy, blanked margin <= 0.2 x real,
blanked accuracy <= 0.75, shuffled margin <= 0.2 x real, chance before (0.25-0.75).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import mmadapt
from mmadapt.data import DataProblem, SampleEncoder, char_tokenizer
from mmadapt.data.preference import PairCollator, PairEncoder, PreferenceDataset, parse_preference
from mmadapt.heads import SequenceLogps, sequence_logps, supervised_rows
from mmadapt.run_directory import RunDirectory
from mmadapt.sees import preference_view
from mmadapt.train import RunConfig, Trainer, latest_checkpoint
from mmadapt.train.batches import inputs_of
from mmadapt.train.objectives import (
    ReferenceTable,
    adapters_disabled,
    objective_for,
    preference_losses,
    reference_kind,
)
from mmadapt.train.run import build_run
from mmadapt.train.stages import apply_stages

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220), "yellow": (230, 220, 30)}


def colour_pairs(root: Path, name: str, n: int, seed: int) -> Path:
    """`n` trl-style pairs over noisy solid-colour 32 x 32 images: chosen names the colour, rejected another."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    rng, names, records = random.Random(seed), list(COLOURS), []
    for k in range(n):
        colour = names[k % 4]
        noise = np.random.default_rng(seed * 1000 + k).integers(-25, 25, (32, 32, 3))
        Image.fromarray(np.clip(np.array(COLOURS[colour]) + noise, 0, 255).astype(np.uint8)).save(
            root / "img" / f"{name}{k}.png")
        records.append({"id": f"{name}{k}", "images": [f"img/{name}{k}.png"],
                        "prompt": [{"role": "user", "content": "<image>\nWhat colour is it?"}],
                        "chosen": [{"role": "assistant", "content": colour}],
                        "rejected": [{"role": "assistant", "content": rng.choice([c for c in names if c != colour])}]})
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return mmadapt.build_model(*QWEN)


@pytest.fixture(scope="module")
def encoder(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    for k, side in enumerate((32, 64, 32)):
        Image.new("RGB", (side, 32), (40 * k, 90, 200)).save(root / f"{k}.png")
    return SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root), max_length=256)


def trl_record(**changes):
    return {"id": "p", "images": ["0.png"], "prompt": "<image>\nWhat is it?", "chosen": "A square.",
            "rejected": "A circle.", **changes}


# ---- formats ---------------------------------------------------------------------------------------------------------
def test_trl_llama_factory_and_ms_swift_records_encode_the_same_pair(encoder):
    trl = trl_record()
    factory = {"conversations": [{"from": "human", "value": "<image>\nWhat is it?"}], "images": ["0.png"],
               "chosen": {"from": "gpt", "value": "A square."}, "rejected": {"from": "gpt", "value": "A circle."}}
    swift = {"messages": [{"role": "user", "content": "<image>\nWhat is it?"},
                          {"role": "assistant", "content": "A square."}], "rejected_response": "A circle.",
             "images": ["0.png"]}
    parts = [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]
    trl_messages = {"prompt": [{"role": "user", "content": parts}],
                    "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "A square."}]}],
                    "rejected": [{"role": "assistant", "content": "A circle."}], "images": ["0.png"]}
    pairs = PairEncoder(encoder)
    encoded = [pairs.encode(r, i) for i, r in enumerate((trl, factory, swift, trl_messages))]
    for pair in encoded:
        assert pair.shared and pair.rejected.pixel_values is None
        assert pair.chosen.input_ids.tolist() == encoded[0].chosen.input_ids.tolist()
        assert pair.rejected.input_ids.tolist() == encoded[0].rejected.input_ids.tolist()
    text = encoder.tokenizer.decode(encoded[0].chosen.labels[encoded[0].chosen.labels != -100].tolist())
    assert text.startswith("A square.")


def test_trls_preference_layout_as_parquet_with_embedded_images_gives_the_pairs_of_its_json(model, tmp_path):
    """trl's vision preference sets on the hub (prompt / chosen / rejected + images, e.g. RLAIF-V as trl formats it)
    are Parquet with the images embedded: read as the same pairs as the JSONL with image files."""
    import datasets

    from mmadapt.data import read_records
    from mmadapt.data.preference import PreferenceDataset

    path = colour_pairs(tmp_path, "c", 4, seed=0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cells = [{**r, "images": [{"bytes": (tmp_path / p).read_bytes(), "path": None} for p in r["images"]]}
             for r in rows]
    table = datasets.Dataset.from_list(cells).cast_column("images", datasets.Sequence(datasets.Image()))
    table.to_parquet(str(tmp_path / "pairs.parquet"))
    pairs = PairEncoder(SampleEncoder.for_model(model, char_tokenizer(), image_root=str(tmp_path)))
    ours, theirs = (PreferenceDataset(read_records(p, errors="report"), pairs)
                    for p in (tmp_path / "pairs.parquet", path))
    assert len(ours) == len(theirs) == 4
    for k in range(4):
        a, b = ours[k], theirs[k]
        assert a.id == b.id and a.shared and b.shared
        for row in ("chosen", "rejected"):
            assert torch.equal(getattr(a, row).input_ids, getattr(b, row).input_ids)
            assert torch.equal(getattr(a, row).labels, getattr(b, row).labels)
        assert torch.equal(a.chosen.pixel_values, b.chosen.pixel_values)


def test_ms_swift_rejected_images_are_the_rejected_rows_own(encoder, model):
    record = {"messages": [{"role": "user", "content": "<image>\nWhat is it?"},
                           {"role": "assistant", "content": "A square."}], "images": ["0.png"],
              "rejected_images": ["2.png"]}  # no rejected_response: the same answer, read with another image
    pair = PairEncoder(encoder).encode(record, 0)
    assert not pair.shared and pair.rejected.pixel_values is not None
    assert pair.chosen.input_ids.tolist() == pair.rejected.input_ids.tolist()  # the same text, another image
    batch = PairCollator.for_model(model, encoder.pad_token_id)([pair])
    assert batch["image_index"].tolist() == [0, 1] and batch["image_grid_thw"].shape[0] == 2
    out = model(**inputs_of(batch), head=SequenceLogps())
    assert out.logps.shape == (2,) and torch.isfinite(out.logps).all()


@pytest.mark.parametrize("record, reason", [
    (trl_record(rejected="A square."), "bad_pair"),  # nothing to prefer
    (trl_record(rejected=None), "bad_pair"),
    (trl_record(chosen="<image> here"), "bad_format"),  # images belong to the prompt
    (trl_record(prompt=[{"role": "user", "content": "<image>\nHi"}, {"role": "assistant", "content": "Hello"}]),
     "bad_format"),  # a prompt must end with the user's turn
    (trl_record(rejected_images=["0.png", "1.png"]), "bad_pair"),
    (trl_record(images=["0.png", "1.png"]), "placeholder_mismatch"),
    (trl_record(images=["missing.png"]), "missing_image"),
    (trl_record(chosen=""), "empty_answer"),
    ({"id": "x", "messages": [{"role": "user", "content": "hi"}]}, "bad_format"),  # not a pair
])
def test_bad_pairs_are_counted_problems_naming_the_pair(encoder, record, reason):
    dataset = PreferenceDataset([record], PairEncoder(encoder))
    problem = dataset[0]
    assert isinstance(problem, DataProblem) and problem.reason == reason, problem


def test_a_pair_over_max_length_is_dropped_never_cut(encoder):
    long = trl_record(chosen="A square " * 40)
    for truncation, fatal in (("text", False), ("drop", False), ("raise", True)):
        pairs = PairEncoder(SampleEncoder(tokenizer=encoder.tokenizer, template=encoder.template,
                                          processor=encoder.processor, image_token_id=encoder.image_token_id,
                                          vision_start_token_id=encoder.brackets[0],
                                          vision_end_token_id=encoder.brackets[1],
                                          config=dataclasses.replace(encoder.config, max_length=120,
                                                                     truncation=truncation)))
        with pytest.raises(DataProblem, match="never cut") as caught:
            pairs.encode(long, 0)
        assert caught.value.reason == "too_long" and caught.value.fatal is fatal
        assert len(pairs.encode(trl_record(), 0).chosen) <= 120


def test_the_prompts_images_are_decoded_and_encoded_once_per_pair(encoder, model, monkeypatch):
    import mmadapt.data.pipeline as pipeline

    loads = []
    real = pipeline.load_image
    monkeypatch.setattr(pipeline, "load_image", lambda path, **kw: loads.append(path) or real(path, **kw))
    record = trl_record(images=["0.png", "1.png"], prompt="<image><image>\nWhich is wider?")
    pair = PairEncoder(encoder).encode(record, 0)
    assert len(loads) == 2  # not 4
    batch = PairCollator.for_model(model, encoder.pad_token_id)([pair, PairEncoder(encoder).encode(trl_record(), 1)])
    assert batch["image_index"].tolist() == [0, 1, 2, 0, 1, 2] and batch["image_grid_thw"].shape[0] == 3
    rows = []
    handle = model.encoder.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    try:
        out = model(**inputs_of(batch), head=SequenceLogps())
        inputs = model.prepare(mmadapt.batch.VisionBatch.of(batch))
    finally:
        handle.remove()
    assert rows[0] == batch["pixel_values"].shape[0]  # the vision side ran once, on the three distinct images
    # both rows of a pair received the same visual tokens, exactly
    spans = inputs.spans
    for pair_row in range(2):
        chosen = inputs.inputs_embeds[pair_row][spans.mask[pair_row]]
        rejected = inputs.inputs_embeds[pair_row + 2][spans.mask[pair_row + 2]]
        assert torch.equal(chosen, rejected)
    # and the same log-probs as the rows collated one by one, each with its own copy of the images
    plain = mmadapt.data.Collator.for_model(model, encoder.pad_token_id)
    each = plain([pair.chosen, batch_rows_rejected(pair)])
    alone = model(**inputs_of(each), head=SequenceLogps()).logps
    assert torch.allclose(alone, out.logps[[0, 2]], atol=1e-6)


def test_a_batch_whose_rows_disagree_about_a_pairs_images_is_refused(encoder, model):
    from mmadapt.contract import ImageTokenContractError
    from mmadapt.train.objectives import PairScorer
    from mmadapt.train.objectives.dpo.settings import DpoSettings

    pairs = PairEncoder(encoder)
    batch = PairCollator.for_model(model, encoder.pad_token_id)([pairs.encode(trl_record(), 0),
                                                                 pairs.encode(trl_record(images=["1.png"]), 1)])
    objective = PairScorer(DpoSettings(loss_type="simpo"), model, None)
    objective.terms(model, batch, torch.device("cpu"))  # as collated: fine
    swapped = {**batch, "image_index": torch.tensor([0, 1, 1, 0])}  # rejected rows read the other pair's image
    with pytest.raises(ImageTokenContractError, match=r"pair 'p' .*reading other encoded images"):
        objective.terms(model, swapped, torch.device("cpu"))


def batch_rows_rejected(pair):
    return dataclasses.replace(pair.rejected, pixel_values=pair.chosen.pixel_values,
                               image_grid_thw=pair.chosen.image_grid_thw)


# ---- sequence log-probs without the logits ---------------------------------------------------------------------------
@pytest.mark.parametrize("head_kind", ["linear", "tied", "lora"])
def test_sequence_logps_and_their_gradients_equal_full_logits(head_kind):
    torch.manual_seed(0)
    vocab, width = 97, 16
    embedding = nn.Embedding(vocab, width)
    head = nn.Linear(width, vocab, bias=head_kind == "linear")
    if head_kind == "tied":
        head.weight = embedding.weight
    if head_kind == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        holder = nn.Module()
        holder.head = head
        inject_adapter_in_model(LoraConfig(r=4, target_modules=["head"], init_lora_weights=False), holder)
        head = holder.head
    ids = torch.randint(0, vocab, (3, 11))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 7:] = -100
    weights = torch.tensor([0.7, -1.3, 2.0])

    def run(full: bool):
        for p in [*embedding.parameters(), *head.parameters()]:
            p.grad = None
        embeds = embedding(ids)
        hidden = torch.tanh(embeds * 1.5)
        if full:
            logps = torch.log_softmax(head(hidden).float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            mask = labels[:, 1:] != -100
            per_row = (logps * mask).sum(1)
        else:
            states, targets, rows = supervised_rows(hidden, labels)
            per_row, _ = sequence_logps(states, head, targets, rows, 3, chunk=5, embeds=embeds)
        (per_row * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in [*embedding.named_parameters(prefix="e"),
                                               *head.named_parameters(prefix="h")] if p.grad is not None}
        return per_row.detach(), grads

    ours, our_grads = run(False)
    theirs, their_grads = run(True)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert our_grads.keys() == their_grads.keys() and our_grads
    for name in our_grads:
        assert torch.allclose(our_grads[name], their_grads[name], atol=1e-5), name


def test_sequence_logps_under_bf16_autocast_stay_near_fp32_with_fp32_gradients():
    """The precision policy bf16-autocast: the chunks' matmuls in bf16, log-softmax and sums in fp32; gradients come
    back in the parameters' fp32 (bf16 rounding: within 2e-2 of fp32 here)."""
    torch.manual_seed(0)
    head = nn.Linear(16, 97)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    labels = torch.randint(0, 97, (3, 11))
    labels[:, :4] = -100

    def run(autocast: bool):
        head.zero_grad()
        hidden.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            states, targets, rows = supervised_rows(hidden, labels)
            logps, _ = sequence_logps(states, head, targets, rows, 3, chunk=5)
        logps.sum().backward()
        return logps.detach(), head.weight.grad.clone(), hidden.grad.clone()

    exact, low = run(False), run(True)
    assert low[0].dtype == low[1].dtype == low[2].dtype == torch.float32
    for a, b in zip(exact, low, strict=True):
        assert float((a - b).abs().max()) <= 2e-2


def test_the_kl_to_the_reference_is_zero_for_itself_and_the_full_vocabulary_kl_otherwise():
    torch.manual_seed(0)
    head, other = nn.Linear(8, 31), nn.Linear(8, 31)
    states = torch.randn(6, 8)
    targets, rows = torch.randint(0, 31, (6,)), torch.tensor([0, 0, 1, 1, 1, 2])
    _, kl = sequence_logps(states, head, targets, rows, 3, reference=(states, head))
    assert torch.allclose(kl, torch.zeros(3), atol=1e-6)
    _, kl = sequence_logps(states, head, targets, rows, 3, reference=(states, other))
    p, q = torch.log_softmax(head(states), -1), torch.log_softmax(other(states), -1)
    expected = torch.zeros(3).index_add(0, rows, (p.exp() * (p - q)).sum(-1))
    assert torch.allclose(kl, expected.detach(), atol=1e-6)
    wrapped = nn.Sequential(head)  # any other head (a LoRA-wrapped lm_head): checkpointed chunks and `token_kl`
    _, kl = sequence_logps(states, wrapped, targets, rows, 3, chunk=4, reference=(states, other))
    assert torch.allclose(kl, expected.detach(), atol=1e-6)


# ---- the losses, from their papers -----------------------------------------------------------------------------------
def test_the_losses_follow_their_papers_formulas():
    g = torch.Generator().manual_seed(0)
    pc, pr = -torch.rand(5, generator=g) * 20 - 1, -torch.rand(5, generator=g) * 20 - 1  # summed log-probs (< 0)
    rc, rr = pc + torch.randn(5, generator=g), pr + torch.randn(5, generator=g)
    nc, nr = torch.randint(1, 9, (5,), generator=g), torch.randint(1, 9, (5,), generator=g)
    beta, eps, gamma = 0.3, 0.1, 0.7
    sig = torch.sigmoid

    # DPO (Rafailov et al. 2023, eq. 7), conservative with label smoothing eps (cDPO)
    h = beta * ((pc - rc) - (pr - rr))
    dpo = -(1 - eps) * torch.log(sig(h)) - eps * torch.log(sig(-h))
    got = preference_losses("sigmoid", pc, pr, rc, rr, nc, nr, beta=beta, label_smoothing=eps)
    assert torch.allclose(got.losses, dpo, atol=1e-6)
    assert torch.allclose(got.chosen_rewards, beta * (pc - rc)) and torch.allclose(got.rejected_rewards,
                                                                                    beta * (pr - rr))
    # IPO (Azar et al. 2023, eq. 17; per token, as trl and the authors normalise it): (h - 1/(2 tau))^2
    h = (pc - rc) / nc - (pr - rr) / nr
    assert torch.allclose(preference_losses("ipo", pc, pr, rc, rr, nc, nr, beta=beta).losses,
                          (h - 1 / (2 * beta)) ** 2, atol=1e-6)
    # SimPO (Meng et al. 2024, eq. 6): -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)
    simpo = -torch.log(sig(beta / nc * pc - beta / nr * pr - gamma))
    got = preference_losses("simpo", pc, pr, None, None, nc, nr, beta=beta, simpo_gamma=gamma)
    assert torch.allclose(got.losses, simpo, atol=1e-6)
    # ORPO (Hong et al. 2024, eqs. 4-7): L_SFT + lambda L_OR, odds(y|x) = P / (1 - P), P = exp(mean token log-prob)
    pw, pl = torch.exp(pc / nc), torch.exp(pr / nr)
    odds_ratio = (pw / (1 - pw)) / (pl / (1 - pl))
    orpo = -(pc / nc) + beta * -torch.log(sig(torch.log(odds_ratio)))
    got = preference_losses("orpo", pc.double(), pr.double(), None, None, nc, nr, beta=beta)
    assert torch.allclose(got.losses, orpo.double(), atol=1e-6)
    with pytest.raises(ValueError, match="needs the reference"):
        preference_losses("sigmoid", pc, pr, None, None, nc, nr, beta=beta)


# ---- the reference ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # trains a few steps
def test_the_lora_reference_is_the_base_model_with_no_second_copy_of_the_weights(tmp_path):
    path = colour_pairs(tmp_path, "train", 16, 0)
    cfg = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=dpo",
                                f"data.train={path}", f"data.image_root={tmp_path}", "data.batch_size=4",
                                "train.steps=2", "stages.backbone=lora", "stages.projector=frozen"])
    parts = build_run(cfg)
    base = copy.deepcopy(parts.model).eval()
    embedding = parts.model.backbone.get_input_embeddings().weight
    shape = tuple(embedding.shape)

    def copies() -> int:  # tensors the size of the (V, D) embedding anywhere in the process
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == shape)

    before = copies()
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate)
    assert trainer.objective.reference == "adapters"
    trainer.fit()
    assert copies() == before  # no copy of the frozen weights was made for the reference
    batch = parts.collate([parts.train_data[i] for i in range(4)])
    with torch.no_grad(), adapters_disabled(parts.model):
        off = parts.model.eval()(**inputs_of(batch), head=SequenceLogps()).logps
    on = parts.model(**inputs_of(batch), head=SequenceLogps()).logps
    start = base(**inputs_of(batch), head=SequenceLogps()).logps
    assert torch.equal(off, start) and not torch.allclose(on, start)


@pytest.mark.slow  # trains a few steps
def test_the_precomputed_reference_is_cached_with_checksums_and_read_back_on_resume(tmp_path):
    path = colour_pairs(tmp_path, "train", 16, 0)
    overrides = [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=dpo", f"data.train={path}",
                 f"data.image_root={tmp_path}", "data.batch_size=4", "stages.encoder=full", "checkpoint.every=2"]
    whole = run_steps(overrides, 3)
    table = ReferenceTable.load(tmp_path / "out")
    assert table.tables["train"].shape == (16, 2) and torch.isfinite(table.tables["train"]).all()
    assert {"model", "data.train"} <= set(table.checksums)
    shutil.rmtree(latest_checkpoint(tmp_path / "out"))  # back to step 2: step 3 is redone by a resumed run
    resumed = run_steps([*overrides, "checkpoint.resume=true"], 3)  # the weights moved: the file is the reference
    assert resumed[-1]["step"] == 3 and abs(resumed[-1]["loss"] - whole[-1]["loss"]) <= 1e-6
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "chosen": [{"role": "assistant", "content": "pink"}]}) + "\n"
                            for r in records))
    with pytest.raises(ValueError, match="computed on other data"):
        run_steps([*overrides, "checkpoint.resume=true"], 4)
    RunDirectory(tmp_path / "out").reference_file.unlink()
    with pytest.raises(ValueError, match="is missing"):
        run_steps([*overrides, "checkpoint.resume=true"], 4)


def run_steps(overrides, steps):
    cfg = RunConfig.load(None, [*overrides, f"train.steps={steps}"])
    parts = build_run(cfg)
    return Trainer(parts.model, cfg, parts.train_data, parts.collate).fit()["history"]


def test_reference_settings_are_checked(model):
    lora = copy.deepcopy(model)
    apply_stages(lora, RunConfig.load(None, ["stages.backbone=lora"]).stages)
    assert reference_kind("auto", "sigmoid", {"encoder": "frozen", "projector": "frozen", "backbone": "lora"},
                          lora) == "adapters"
    assert reference_kind("auto", "sigmoid", {"encoder": "frozen", "projector": "full", "backbone": "lora"},
                          lora) == "precomputed"
    assert reference_kind("auto", "simpo", {"backbone": "full"}, lora) is None
    with pytest.raises(ValueError, match="precomputed"):
        reference_kind("adapters", "sigmoid", {"projector": "full", "backbone": "lora"}, lora)
    with pytest.raises(ValueError, match="label_smoothing"):  # a section is parsed by its objective, when built
        objective_for(RunConfig.load(None, ["dpo.label_smoothing=0.5"]))
    with pytest.raises(ValueError, match=r"unknown config key 'dpo.betta'. Did you mean 'dpo.beta'\?"):
        objective_for(RunConfig.load(None, ["train.objective=dpo", "dpo.betta=0.5"]))
    with pytest.raises(ValueError, match=r"unknown config key 'dpoo'. Did you mean 'dpo'\?"):
        objective_for(RunConfig.load(None, ["dpoo.beta=0.5"]))
    with pytest.raises(ValueError, match="packing"):
        build_run(RunConfig.load(None, ["train.objective=dpo", "data.train=x.jsonl", "data.packing=true"]))


# ---- the preference view and a model that learns a preference from its image -----------------------------------------
def test_the_preference_view_reports_real_blanked_and_shuffled_margins(model, tmp_path):
    path = colour_pairs(tmp_path, "eval", 8, 3)
    encoder = SampleEncoder.for_model(copy.deepcopy(model), char_tokenizer(), image_root=str(tmp_path))
    dataset = PreferenceDataset(str(path), PairEncoder(encoder))
    collate = PairCollator.for_model(model, encoder.pad_token_id)
    view = preference_view(model, [collate([dataset[i] for i in range(8)])])
    assert view.pairs == 8 and view.moved == 8 and set(view.margin) == {"real", "blanked", "shuffled"}
    assert "preference view: 8 pairs" in str(view) and "chosen wins" in str(view)
    same = preference_view(model, [collate([dataset[i] for i in range(8)])], reference=model)
    assert all(abs(v) < 1e-6 for v in same.margin.values()) and not same.ok


@pytest.mark.slow
@pytest.mark.parametrize("seed, stages", [(0, "full"), (1, "full"), (2, "full"), (0, "lora")])
def test_dpo_learns_a_preference_that_needs_the_image(tmp_path, capsys, seed, stages):
    train, held_out = colour_pairs(tmp_path, "train", 64, 0), colour_pairs(tmp_path, "eval", 32, 1)
    extra = ["stages.backbone=lora", "stages.projector=frozen", "train.lr=5e-3"] if stages == "lora" else []
    cfg = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=dpo",
                                f"data.train={train}", f"data.eval={held_out}", f"data.image_root={tmp_path}",
                                "data.batch_size=8", "train.steps=30", "train.lr=2e-3", f"train.seed={seed}",
                                "train.warmup_steps=2", "dpo.beta=0.5", *extra])
    parts = build_run(cfg)
    start = copy.deepcopy(parts.model).eval()
    batches = [parts.collate([parts.eval_data[i] for i in range(s, s + 8)]) for s in range(0, 32, 8)]
    before = preference_view(start, batches)
    assert 0.25 <= before.accuracy["real"] <= 0.75  # the untrained model's own preference: chance
    summary = Trainer(parts.model, cfg, parts.train_data, parts.collate, eval_data=parts.eval_data).fit()
    assert summary["eval_rewards/accuracy"] >= 0.9
    assert ("kl" in summary["history"][-1]) == (stages == "lora")
    after = preference_view(parts.model, batches, reference=start)
    real, blanked, shuffled = after.margin["real"], after.margin["blanked"], after.margin["shuffled"]
    assert after.accuracy["real"] >= 0.9 and real > 2.0, after
    assert blanked <= 0.2 * real and after.accuracy["blanked"] <= 0.75, after  # without the image: no preference
    assert shuffled <= 0.2 * real and after.ok, after
    if (seed, stages) == (0, "full"):  # the same view from the command line, on the saved models
        from mmadapt.cli import main

        parts.model.save_pretrained(tmp_path / "dpo", tokenizer=parts.tokenizer)
        start.save_pretrained(tmp_path / "start", tokenizer=parts.tokenizer)
        argv = ["sees", str(tmp_path / "dpo"), str(held_out), "--image-root", str(tmp_path), "--batches", "4"]
        assert main([*argv, "--reference", str(tmp_path / "start")]) == 0
        printed = capsys.readouterr().out
        assert "reward margin / beta" in printed and "the preference rests on the images" in printed
        assert main(["sees", str(tmp_path / "start"), str(held_out), "--image-root", str(tmp_path)]) == 1
        assert "does NOT rest on the images" in capsys.readouterr().out


def test_data_check_and_show_read_pairs(tmp_path, capsys):
    from mmadapt.cli import main

    path = colour_pairs(tmp_path, "pairs", 4, 0)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[1]["rejected"] = records[1]["chosen"]  # nothing to prefer: a counted problem
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["data", "check", str(path), "--image-root", str(tmp_path), "--json", str(tmp_path / "r.json")]
    assert main(argv) == 1  # 1 bad pair of 4: above the default 5%
    assert main([*argv, "--max-bad-fraction", "0.3"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] == 3 and report["problems_by_reason"] == {"bad_pair": 1}
    assert main(["data", "show", str(path), "--image-root", str(tmp_path), "--n", "1", "--colour", "never"]) == 0
    printed = capsys.readouterr().out
    assert "chosen:" in printed and "rejected (the prompt's images, shared):" in printed and "[[red" in printed


def test_a_pair_read_as_a_conversation_says_to_train_it_with_dpo():
    from mmadapt.data import parse_record

    with pytest.raises(DataProblem, match=r"train it with train\.objective: dpo"):
        parse_record(trl_record(), 0)
    assert parse_preference(trl_record(), 0).chosen == "A square."
