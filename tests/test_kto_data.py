"""KTO's data (`mmadapt.train.objectives.kto.data`): trl's unpaired layout and preference pairs unpaired as trl does,
one row per record never cut, bad records counted, and batches of the rows then the KL rows, each prompt's images
encoded once; the KL pairing and the unpaired order equal trl 1.16's (`KTOTrainer._prepare_dataset`,
`maybe_unpair_preference_dataset`).

Tolerance: a KL row's log-prob through the shared images vs the same row with its own copy of the images, 1e-6.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

import mmadapt
from mmadapt.data import Collator, DataProblem, SampleEncoder, char_tokenizer
from mmadapt.data.preference import PairEncoder
from mmadapt.heads import SequenceLogps
from mmadapt.train.objectives.kto import (
    KtoCollator,
    KtoDataset,
    KtoEncoder,
    kl_partners,
    unpaired_row,
)

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
NOT_INPUTS = ("meta", "rows", "desirable")


def inputs(batch):
    return {k: v for k, v in batch.items() if k not in NOT_INPUTS}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return mmadapt.build_model(*QWEN)


@pytest.fixture(scope="module")
def encoder(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    for k, side in enumerate((32, 64, 32)):
        Image.new("RGB", (side, 32), (40 * k, 90, 200)).save(root / f"{k}.png")
    return SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root), max_length=256)


def kto(**changes):
    return {"id": "k", "images": ["0.png"], "prompt": "<image>\nWhat is it?", "completion": "A square.",
            "label": True, **changes}


def trl_pair(**changes):
    return {"id": "p", "images": ["0.png"], "prompt": "<image>\nWhat is it?", "chosen": "A square.",
            "rejected": "A circle.", **changes}


def answer(encoder, row):
    return encoder.tokenizer.decode(row.sample.labels[row.sample.labels != -100].tolist())


def with_config(encoder, **changes):
    copied = copy.copy(encoder)
    copied.config = dataclasses.replace(encoder.config, **changes)
    return copied


def unpadded(batch, r):
    return batch["input_ids"][r][batch["attention_mask"][r]].tolist()


# ---- the layouts -----------------------------------------------------------------------------------------------------
def test_trls_unpaired_layout_as_text_and_as_messages_encodes_one_row_with_the_completion_labelled(encoder):
    parts = [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]
    messages = kto(prompt=[{"role": "user", "content": parts}],
                   completion=[{"role": "assistant", "content": [{"type": "text", "text": "A square."}]}])
    single_image = {**kto(), "image": "0.png"}
    single_image.pop("images")
    encoded = [KtoEncoder(encoder).encode(r, i) for i, r in enumerate((kto(), messages, single_image))]
    for row in encoded:
        assert row.desirable and row.sample.num_images == 1
        assert row.sample.input_ids.tolist() == encoded[0].sample.input_ids.tolist()
    row = encoded[0]
    assert answer(encoder, row).startswith("A square.")
    assert (row.sample.labels[: row.prompt_length] == -100).all() and row.sample.labels[row.prompt_length] != -100
    assert not KtoEncoder(encoder).encode(kto(label=False), 0).desirable


def test_an_unpaired_jsonl_file_reads_one_row_per_record(encoder, tmp_path):
    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps(kto(id="a")) + "\n" + "not json\n" + json.dumps(kto(id="c", label=False)) + "\n")
    dataset = KtoDataset(path, encoder)
    assert not dataset.paired and len(dataset) == 3 and dataset.ids()[::2] == ["a", "c"]
    first, bad, last = (dataset[i] for i in range(3))
    assert first.sample.input_ids.tolist() == KtoEncoder(encoder).encode(kto(), 0).sample.input_ids.tolist()
    assert isinstance(bad, DataProblem) and bad.reason == "bad_format"
    assert (first.desirable, last.desirable, last.index) == (True, False, 2)


@pytest.mark.parametrize("layout", ["trl", "llama_factory", "ms_swift"])
def test_a_file_of_pairs_is_unpaired_chosen_desirable_and_rejected_undesirable(encoder, tmp_path, layout):
    pair = {"trl": trl_pair(),
            "llama_factory": {"id": "p", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}],
                              "images": ["0.png"], "chosen": {"from": "gpt", "value": "A square."},
                              "rejected": {"from": "gpt", "value": "A circle."}},
            "ms_swift": {"id": "p", "messages": [{"role": "user", "content": "<image>\nWhat is it?"},
                                                 {"role": "assistant", "content": "A square."}],
                         "rejected_response": "A circle.", "images": ["0.png"]}}[layout]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(pair) + "\n" + json.dumps({**trl_pair(), "id": "q"}) + "\n")
    dataset = KtoDataset(path, encoder)
    assert dataset.paired and len(dataset) == 4
    assert dataset.ids() == ["p/chosen", "q/chosen", "p/rejected", "q/rejected"]  # trl's order
    rows = [dataset[i] for i in range(4)]
    assert [r.id for r in rows] == dataset.ids() and [r.index for r in rows] == [0, 1, 2, 3]
    assert [r.desirable for r in rows] == [True, True, False, False]
    expected = PairEncoder(encoder).encode(trl_pair(), 0)
    assert rows[0].sample.input_ids.tolist() == expected.chosen.input_ids.tolist()
    assert rows[2].sample.input_ids.tolist() == expected.rejected.input_ids.tolist()
    unpaired = KtoEncoder(encoder)
    assert rows[0].sample.input_ids.tolist() == unpaired.encode(kto(), 0).sample.input_ids.tolist()
    rejected = unpaired.encode(kto(completion="A circle.", label=False), 0)
    assert rows[2].sample.input_ids.tolist() == rejected.sample.input_ids.tolist()


def test_the_unpaired_order_and_rows_equal_trls_maybe_unpair_preference_dataset(encoder):
    """trl unpairs with a batched `map` (1000 pairs a block): 1003 pairs check the block boundary."""
    from datasets import Dataset
    from trl.data_utils import maybe_unpair_preference_dataset

    pairs = [trl_pair(id=f"p{k}", chosen=f"yes {k}", rejected=f"no {k}") for k in range(1003)]
    theirs = maybe_unpair_preference_dataset(Dataset.from_list(pairs))
    dataset = KtoDataset(pairs, encoder)
    assert len(dataset) == len(theirs) == 2006
    ours = [unpaired_row(i, len(pairs)) for i in range(len(dataset))]
    assert [(pairs[k]["id"], chosen) for k, chosen in ours] == list(zip(theirs["id"], theirs["label"], strict=True))
    for i in (0, 999, 1000, 1999, 2000, 2003, 2005):  # the rows themselves, around the boundaries
        row = dataset[i]
        text = answer(encoder, row)
        assert row.id == f"{theirs['id'][i]}/{'chosen' if theirs['label'][i] else 'rejected'}"
        assert row.desirable == theirs["label"][i] and text.startswith(theirs["completion"][i])
    assert dataset.ids()[1000] == "p0/rejected" and dataset.ids()[2000] == "p1000/chosen"


# ---- problems ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("record, reason, words", [
    (kto(label="yes"), "bad_format", "field 'label'"),
    (kto(label=1), "bad_format", "field 'label'"),
    ({k: v for k, v in kto().items() if k != "label"}, "bad_format", "field 'label'"),
    (kto(completion=None), "bad_format", "'completion'"),
    (kto(completion=""), "empty_answer", "completion"),
    (kto(completion="<image> here"), "bad_format", "belong to the prompt"),
    (kto(images=["missing.png"]), "missing_image", "missing.png"),
    (kto(images=["0.png", "1.png"]), "placeholder_mismatch", "placeholder"),
    (kto(prompt=[{"role": "user", "content": "<image>\nHi"}, {"role": "assistant", "content": "Hello"}]),
     "bad_format", "user turn"),
    (kto(completion="A square " * 40), "too_long", "never cut"),
    (trl_pair(), "bad_format", "preference pair in an unpaired"),
])
def test_bad_records_are_counted_problems_naming_the_record(encoder, record, reason, words):
    dataset = KtoDataset([kto(id="good"), {**record, "id": "bad"}], encoder, paired=False)
    problem = dataset[1]
    assert isinstance(problem, DataProblem) and problem.reason == reason and problem.sample_id == "bad", problem
    assert words in str(problem)
    batch = KtoCollator(base=Collator(pad_token_id=encoder.pad_token_id, image_token_id=encoder.image_token_id))(
        [dataset[0], problem])
    assert batch["rows"] == 1 and batch["input_ids"].shape[0] == 2 and batch["meta"]["row_ids"] == ["good"]
    assert [p["id"] for p in batch["meta"]["problems"]] == ["bad"] and batch["meta"]["problems"][0]["reason"] == reason


def test_a_row_over_max_length_is_dropped_never_cut_and_fatal_with_truncation_raise(encoder):
    long = kto(completion="A square " * 40)
    for truncation, fatal in (("text", False), ("drop", False), ("raise", True)):
        small = KtoEncoder(with_config(encoder, max_length=120, truncation=truncation))
        with pytest.raises(DataProblem, match="never cut") as caught:
            small.encode(long, 0)
        assert caught.value.reason == "too_long" and caught.value.fatal is fatal
        assert len(small.encode(kto(), 0)) <= 120
    with pytest.raises(DataProblem, match="never cut"):
        KtoDataset([long], KtoEncoder(with_config(encoder, max_length=120, truncation="raise")))[0]


def test_a_pairs_problem_is_its_rows_own(encoder):
    dataset = KtoDataset([trl_pair(rejected="A square."), trl_pair(id="q")], encoder)  # nothing to prefer
    problems = [dataset[i] for i in range(4)]
    assert [getattr(p, "sample_id", None) for p in problems[::2]] == ["p/chosen", "p/rejected"]
    assert all(isinstance(p, DataProblem) and p.reason == "bad_pair" for p in problems[::2])
    assert dataset[1].id == "q/chosen" and dataset[3].id == "q/rejected"


def test_a_batch_of_problems_only_has_no_rows(encoder):
    collate = KtoCollator(base=Collator(pad_token_id=encoder.pad_token_id, image_token_id=encoder.image_token_id))
    batch = collate([DataProblem("bad_format", "x", sample_id="a"), DataProblem("too_long", "y", sample_id="b")])
    assert batch["input_ids"].shape[0] == 0 and batch["rows"] == 0 and batch["desirable"].shape == (0,)
    assert [p["id"] for p in batch["meta"]["problems"]] == ["a", "b"] and "image_index" not in batch


# ---- batches ---------------------------------------------------------------------------------------------------------
def three(encoder):
    records = [kto(id="a"), kto(id="b", images=["1.png"], prompt="<image>\nHow wide?", completion="Wide.",
                                label=False),
               kto(id="c", images=["2.png", "0.png"], prompt="<image>\n<image>\nSame?", completion="No, not at all.")]
    return records, [KtoEncoder(encoder).encode(r, i) for i, r in enumerate(records)]


def test_a_kl_row_is_the_real_row_of_its_prompt_with_its_partners_completion(encoder, model):
    records, rows = three(encoder)
    batch = KtoCollator.for_model(model, encoder.pad_token_id)(rows)
    assert batch["rows"] == 3 and batch["input_ids"].shape[0] == 6
    assert batch["desirable"].tolist() == [True, False, True] and batch["desirable"].dtype == torch.bool
    assert batch["meta"]["kl_partners"] == [2, 0, 1] == kl_partners(3, 3).tolist()
    assert batch["meta"]["sample_ids"] == [["a"], ["b"], ["c"]]
    for i, j in enumerate(batch["meta"]["kl_partners"]):
        assert unpadded(batch, i) == rows[i].sample.input_ids.tolist()
        real = KtoEncoder(encoder).encode({**records[i], "completion": records[j]["completion"]}, i)
        assert unpadded(batch, 3 + i) == real.sample.input_ids.tolist()
        labels = batch["labels"][3 + i][batch["attention_mask"][3 + i]]
        assert labels.tolist() == real.sample.labels.tolist()
        text = encoder.tokenizer.decode(labels[labels != -100].tolist())
        assert text.startswith(records[j]["completion"])
    assert batch["images_per_sample"].tolist() == [1, 1, 2, 1, 1, 2]


def test_each_prompts_images_are_encoded_once_for_its_row_and_its_kl_row(encoder, model, monkeypatch):
    import mmadapt.data.pipeline as pipeline

    loads = []
    real = pipeline.load_image
    monkeypatch.setattr(pipeline, "load_image", lambda path, **kw: loads.append(path) or real(path, **kw))
    _, rows = three(encoder)
    assert len(loads) == 4  # one read per image of the records
    batch = KtoCollator.for_model(model, encoder.pad_token_id)(rows)
    assert batch["image_grid_thw"].shape[0] == 4  # the 8 images of the 6 rows, 4 encoded
    assert batch["pixel_values"].shape[0] == sum(r.sample.pixel_values.shape[0] for r in rows)
    assert batch["image_index"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    check_shared_images(model, encoder, rows, batch)


def check_shared_images(model, encoder, rows, batch):
    """The vision side runs once on the batch's encoded images, and the KL rows' log-probs equal those of the same
    rows collated alone, each with its own copy of its prompt's images."""
    seen, b = [], len(rows)
    handle = model.encoder.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            out = model(**inputs(batch), head=SequenceLogps())
    finally:
        handle.remove()
    assert seen == [batch["pixel_values"].shape[0]]
    kl_rows = [dataclasses.replace(rows[i].sample, input_ids=batch["input_ids"][b + i][batch["attention_mask"][b + i]],
                                   labels=batch["labels"][b + i][batch["attention_mask"][b + i]]) for i in range(b)]
    with torch.no_grad():
        alone = model(**Collator.for_model(model, encoder.pad_token_id)(kl_rows), head=SequenceLogps())
    assert torch.allclose(alone.logps, out.logps[b:], atol=1e-6)
    assert out.tokens[b:].tolist() == alone.tokens.tolist()  # the loss's per-row token counts come with the log-probs


def test_a_fixed_size_encoders_images_are_shared_the_same_way(tmp_path):
    torch.manual_seed(0)
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    for k in range(3):
        Image.new("RGB", (32 + 16 * k, 32), (60 * k, 90, 200)).save(tmp_path / f"{k}.png")
    fixed = SampleEncoder.for_model(model, char_tokenizer(), image_root=str(tmp_path), max_length=512)
    rows = three(fixed)[1]
    batch = KtoCollator.for_model(model, fixed.pad_token_id)(rows)
    assert batch["pixel_values"].shape[0] == 4 and batch["image_index"].tolist() == [0, 1, 2, 3] * 2
    check_shared_images(model, fixed, rows, batch)


def test_ms_swift_rejected_images_are_the_rejected_rows_own(encoder):
    pair = {"id": "s", "messages": [{"role": "user", "content": "<image>\nWhat is it?"},
                                    {"role": "assistant", "content": "A square."}], "images": ["0.png"],
            "rejected_images": ["2.png"]}  # the same answer, read with another image
    chosen, rejected = (KtoDataset([pair], encoder)[i] for i in range(2))
    assert (chosen.id, rejected.id) == ("s/chosen", "s/rejected")
    assert chosen.sample.input_ids.tolist() == rejected.sample.input_ids.tolist()
    assert not torch.equal(chosen.sample.pixel_values, rejected.sample.pixel_values)
    own = KtoEncoder(encoder).encode(kto(images=["2.png"], label=False), 0)
    assert torch.equal(rejected.sample.pixel_values, own.sample.pixel_values)


def test_without_kl_rows_the_batch_is_the_rows_alone(encoder, model):
    _, rows = three(encoder)
    batch = KtoCollator.for_model(model, encoder.pad_token_id, kl=False)(rows)
    plain = Collator.for_model(model, encoder.pad_token_id)([r.sample for r in rows])
    assert torch.equal(batch["input_ids"], plain["input_ids"]) and torch.equal(batch["labels"], plain["labels"])
    assert torch.equal(batch["pixel_values"], plain["pixel_values"]) and "image_index" not in batch
    assert batch["meta"]["kl_partners"] == [] and batch["rows"] == 3


def test_packing_is_refused(encoder, model):
    _, rows = three(encoder)
    with pytest.raises(ValueError, match="not packed"):
        KtoCollator.for_model(model, encoder.pad_token_id, max_tokens=512)(rows)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_the_kl_pairing_of_sequential_batches_equals_trls_prepared_dataset(encoder, batch_size):
    """trl's `_prepare_dataset` rotates the completions by one within each group of `per_device_train_batch_size`
    rows (the last group shorter); its `KTOTrainer` refuses a per-device batch of 1 for `kto` (`kl_partners` does
    too), and its rotation of a group of one pairs the row with itself, as the collator does for a batch of one."""
    from datasets import Dataset
    from real_tokenizers import real_tokenizer
    from trl import KTOTrainer

    words = ["apple", "river", "stone", "cloud", "green", "seven", "table"]
    records = [{"id": w, "prompt": f"Say {w}:", "completion": w, "label": k % 2 == 0} for k, w in enumerate(words)]
    tokenizer = real_tokenizer("qwen3")
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, calculate_KL=True, desirable_weight=1.0,
                                    undesirable_weight=1.0)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, per_device_train_batch_size=batch_size)
    prepared = KTOTrainer._prepare_dataset(trainer, Dataset.from_list(records), tokenizer, args, "train")
    completions = [tuple(c) for c in prepared["completion_ids"]]
    theirs = [completions.index(tuple(c)) for c in prepared["KL_completion_ids"]]
    if batch_size == 1:
        with pytest.raises(ValueError, match="at least 2 rows per batch"):
            kl_partners(len(words), 1)
    dataset = KtoDataset(records, encoder)
    collate = KtoCollator(base=Collator(pad_token_id=encoder.pad_token_id, image_token_id=encoder.image_token_id))
    ours = []
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        ours += [start + j for j in batch["meta"]["kl_partners"]]
        for i, j in enumerate(batch["meta"]["kl_partners"]):
            labels = batch["labels"][batch["rows"] + i]
            assert encoder.tokenizer.decode(labels[labels != -100].tolist()).startswith(words[start + j])
    assert ours == theirs


def test_a_prompts_video_is_laid_out_for_its_row_and_its_kl_row(encoder, model):
    from helpers import grey_clip

    grey_clip(Path(encoder.config.image_root) / "clip.mp4")
    video = kto(id="v", images=[], videos=["clip.mp4"], prompt="<video>\nWhat happens?", completion="It brightens.")
    rows = [KtoEncoder(encoder).encode(r, i) for i, r in enumerate((video, kto(id="i", label=False)))]
    real = KtoEncoder(encoder).encode({**video, "completion": "A square."}, 0)
    batch = KtoCollator.for_model(model, encoder.pad_token_id)(rows)
    assert unpadded(batch, 2) == real.sample.input_ids.tolist()  # the video prompt with the image row's completion
    assert batch["videos_per_sample"].tolist() == [1, 0, 1, 0] and batch["image_index"].tolist() == [0, 0]
    assert batch["pixel_values_videos"].shape[0] == 2 * rows[0].sample.pixel_values_videos.shape[0]
    with torch.no_grad():
        out = model(**inputs(batch), head=SequenceLogps())
    assert torch.isfinite(out.logps).all() and out.logps.shape == (4,)
