"""The data pipeline end to end: formats, templates and labels, bad samples, truncation, loaders, `data check`.

Real images come from scikit-image (offline). Every bad input kind gives its stated problem,
by sample id, and leaves the other samples' encodings unchanged.
"""

import json
import logging
import struct
import zlib

import pytest
import torch
from PIL import Image
from skimage import data as skdata

from mmadapt import build_model, check_batch
from mmadapt.cli import main
from mmadapt.data import (
    Collator,
    DataProblem,
    SampleEncoder,
    VLMDataset,
    char_tokenizer,
    check_dataset,
    length_grouped_sampler,
    parse_record,
    prepare_tokenizer,
)
from mmadapt.data.templates import IGNORE


def llava(sample_id, images, question, answer="A photo."):
    record = {"id": sample_id, "conversations": [{"from": "human", "value": question},
                                                 {"from": "gpt", "value": answer}]}
    if images is not None:
        record["image"] = images
    return record


def bomb_png(path, side=40_000):
    """A PNG whose header claims side x side pixels (the data is not even there): must be refused unread."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    Image.fromarray(skdata.astronaut()).resize((80, 64)).save(root / "astronaut.png")
    Image.fromarray(skdata.coffee()).resize((48, 96)).save(root / "coffee.jpg")
    Image.fromarray(skdata.chelsea()).convert("CMYK").resize((64, 64)).save(root / "cmyk.jpg")
    palette = Image.fromarray(skdata.camera()).resize((40, 40)).convert("P")
    palette.save(root / "palette.png", transparency=0)
    Image.fromarray(skdata.camera().astype("uint16") * 257).resize((64, 32)).save(root / "gray16.png")
    Image.fromarray(skdata.astronaut()).convert("RGBA").resize((32, 64)).save(root / "rgba.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    Image.fromarray(skdata.coffee()).resize((96, 64)).save(root / "exif.jpg", exif=exif)
    Image.new("RGB", (1, 1), (200, 10, 10)).save(root / "one_pixel.png")
    Image.new("RGB", (2, 700), (10, 200, 10)).save(root / "sliver.png")
    (root / "corrupt.png").write_bytes(b"this is not an image at all")
    whole = (root / "astronaut.png").read_bytes()
    (root / "truncated.png").write_bytes(whole[: len(whole) // 2])
    bomb_png(root / "bomb.png")
    (root.parent / "outside.png").write_bytes(whole)
    return root


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    model = build_model("qwen3_5_vit", "qwen_merger", "qwen3_5")
    return model, prepare_tokenizer(model, char_tokenizer())


GOOD = {
    "photo": llava("photo", "astronaut.png", "<image>\nWho is this?", "An astronaut."),
    "two": llava("two", ["astronaut.png", "coffee.jpg"], "<image> and <image>: same?", "No."),
    "text": llava("text", None, "What is 2+2?", "4"),
    "cmyk": llava("cmyk", "cmyk.jpg", "<image>\nAnimal?", "A cat."),
    "palette": llava("palette", "palette.png", "<image>\nWhat?", "A man."),
    "gray16": llava("gray16", "gray16.png", "<image>\nWhat?", "A man."),
    "rgba": llava("rgba", "rgba.png", "<image>\nWhat?", "A woman."),
    "exif": llava("exif", "exif.jpg", "<image>\nWhat?", "Coffee."),
    "one_pixel": llava("one_pixel", "one_pixel.png", "<image>\nColour?", "Red."),
    "sliver": llava("sliver", "sliver.png", "<image>\nColour?", "Green."),
    "messages": {"id": "messages", "images": ["coffee.jpg"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "Coffee."}]},
}
BAD = {
    "corrupt": (llava("corrupt", "corrupt.png", "<image>\nWhat?"), "unreadable_image"),
    "truncated": (llava("truncated", "truncated.png", "<image>\nWhat?"), "unreadable_image"),
    "bomb": (llava("bomb", "bomb.png", "<image>\nWhat?"), "image_too_large"),
    "missing": (llava("missing", "nowhere.png", "<image>\nWhat?"), "missing_image"),
    "escape": (llava("escape", "../outside.png", "<image>\nWhat?"), "path_outside_root"),
    "absolute": (llava("absolute", "/etc/passwd", "<image>\nWhat?"), "path_outside_root"),
    "extra_placeholder": (llava("extra_placeholder", "astronaut.png", "<image><image>\nWhat?"),
                          "placeholder_mismatch"),
    "missing_placeholder": (llava("missing_placeholder", ["astronaut.png", "coffee.jpg"], "<image>\nWhat?"),
                            "placeholder_mismatch"),
    "no_placeholder": (llava("no_placeholder", "astronaut.png", "What is this?"), "image_without_placeholder"),
    "empty_answer": (llava("empty_answer", "astronaut.png", "<image>\nWhat?", "  "), "empty_answer"),
    "too_long": (llava("too_long", "astronaut.png", "<image>\n" + "tell me more " * 40), "too_long"),
    "no_assistant": ({"id": "no_assistant", "conversations": [{"from": "human", "value": "hi"}]},
                     "no_supervised_tokens"),
    "bad_role": ({"id": "bad_role", "conversations": [{"from": "robot", "value": "hi"}]}, "bad_format"),
}
MAX_LENGTH = 200


def encoder_for(qwen, image_dir, max_length=MAX_LENGTH, **kw):
    model, tokenizer = qwen
    return SampleEncoder.for_model(model, tokenizer, image_root=str(image_dir), max_length=max_length, **kw)


def test_every_bad_kind_is_its_stated_problem_and_good_samples_are_unaffected(qwen, image_dir):
    encoder = encoder_for(qwen, image_dir)
    for sample_id, (record, reason) in BAD.items():
        with pytest.raises(DataProblem) as info:
            encoder.encode(record, 0)
        assert (info.value.reason, info.value.sample_id) == (reason, sample_id), str(info.value)
        assert sample_id in str(info.value)
    alone = {k: encoder.encode(r, 0) for k, r in GOOD.items()}
    mixed = [r for pair in zip(GOOD.values(), [b for b, _ in BAD.values()], strict=False) for r in pair]
    dataset = VLMDataset(mixed + [b for b, _ in list(BAD.values())[len(GOOD):]], encoder)
    seen = {item.id if not isinstance(item, DataProblem) else item.sample_id: item for item in dataset}
    for sample_id, sample in alone.items():
        assert torch.equal(seen[sample_id].input_ids, sample.input_ids)
        if sample.num_images:
            assert torch.equal(seen[sample_id].pixel_values, sample.pixel_values)
    assert {k for k, v in seen.items() if isinstance(v, DataProblem)} == set(BAD)


def test_bad_image_problems_name_the_file(qwen, image_dir):
    encoder = encoder_for(qwen, image_dir)
    for sample_id in ("corrupt", "truncated", "bomb", "missing"):
        with pytest.raises(DataProblem) as info:
            encoder.encode(BAD[sample_id][0], 0)
        assert info.value.path and info.value.path.endswith(BAD[sample_id][0]["image"])


def test_llava_and_messages_formats_give_the_same_sample(qwen, image_dir):
    encoder = encoder_for(qwen, image_dir)
    as_llava = llava("same", ["coffee.jpg"], "<image>What is this?", "Coffee.")
    a, b = encoder.encode(as_llava, 0), encoder.encode({**GOOD["messages"], "id": "same"}, 0)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.pixel_values, b.pixel_values)
    as_string = {"id": "same", "images": ["coffee.jpg"], "messages": [
        {"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "Coffee."}]}
    assert torch.equal(encoder.encode(as_string, 0).input_ids, a.input_ids)


def test_paths_outside_the_root_only_when_allowed(qwen, image_dir):
    sample = encoder_for(qwen, image_dir, allow_outside_root=True).encode(BAD["escape"][0], 0)
    assert sample.num_images == 1
    parsed = parse_record(llava("x", "sub/../astronaut.png", "<image>"), 0, image_dir)  # `..` inside the root is fine
    assert parsed.images[0] == str(image_dir / "astronaut.png")


def test_missing_placeholder_is_inserted_only_on_request(qwen, image_dir):
    sample = encoder_for(qwen, image_dir, insert_missing_placeholder=True).encode(BAD["no_placeholder"][0], 0)
    reference = encoder_for(qwen, image_dir).encode(llava("p", "astronaut.png", "<image>\nWhat is this?"), 0)
    assert torch.equal(sample.input_ids, reference.input_ids)


def test_qwen_chatml_labels_cover_exactly_the_answers(qwen, image_dir):
    _, tokenizer = qwen
    record = {"id": "chat", "image": "astronaut.png", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "<image>\nWho?"},
        {"from": "gpt", "value": "An astronaut."}, {"from": "human", "value": "Where?"},
        {"from": "gpt", "value": "Space."}]}
    sample = encoder_for(qwen, image_dir).encode(record, 0)
    text = tokenizer.decode(sample.input_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert text.endswith("<|im_start|>assistant\nSpace.<|im_end|>\n")
    assert text.count("<|image_pad|>") == sample.tokens_per_image[0]
    supervised = sample.labels != IGNORE
    assert tokenizer.decode(sample.input_ids[supervised]) == "An astronaut.<|im_end|>Space.<|im_end|>"
    assert torch.equal(sample.labels[supervised], sample.input_ids[supervised])


def test_vicuna_template_for_llava_1_5(image_dir):
    torch.manual_seed(0)
    model = build_model("clip", "mlp2x_gelu", "llama")
    tokenizer = prepare_tokenizer(model, char_tokenizer())
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(image_dir))
    sample = encoder.encode(GOOD["photo"], 0)
    text = tokenizer.decode(sample.input_ids)
    span = "<image>" * sample.tokens_per_image[0]
    # conv_vicuna_v1's system prompt (LLaVA-1.5 trains with --version v1): a curious *user*, the *user*'s questions
    assert text == ("<s>A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                    f"helpful, detailed, and polite answers to the user's questions. USER: {span}\nWho is this? "
                    "ASSISTANT: An astronaut.</s>")
    assert tokenizer.decode(sample.input_ids[sample.labels != IGNORE]) == " An astronaut.</s>"
    assert sample.pixel_values.shape == (1, 3, model.encoder.image_size, model.encoder.image_size)


def test_a_transformers_tokenizer_directory_gets_missing_tokens_and_the_model_is_resized(tmp_path, image_dir, caplog):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["Who is this? An astronaut in a white suit.", "What is in the cup? Coffee.", "user assistant system"]
    backend.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    torch.manual_seed(0)
    model = build_model("qwen3_5_vit", "qwen_merger", "qwen3_5")
    assert "<|image_pad|>" not in tokenizer.get_vocab() and len(tokenizer) > model.backbone.config.vocab_size
    old = model.backbone.get_input_embeddings().weight.detach().clone()
    old_head = model.backbone.lm_head.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="mmadapt"):
        encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(image_dir))
    assert "added special tokens" in caplog.text and f"vocabulary 256 -> {len(tokenizer)} tokens" in caplog.text
    assert model.backbone.get_input_embeddings().num_embeddings == len(tokenizer)
    embed, head = model.backbone.get_input_embeddings().weight, model.backbone.lm_head.weight
    assert torch.equal(embed[:256], old) and torch.equal(head[:256], old_head)  # existing rows untouched
    assert torch.allclose(embed[256:], old.mean(0).expand(len(tokenizer) - 256, -1))  # LLaVA's mean init
    assert torch.allclose(head[256:], old_head.mean(0).expand(len(tokenizer) - 256, -1))
    assert model.tokens.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    sample = encoder.encode(GOOD["photo"], 0)
    assert tokenizer.decode(sample.input_ids[sample.labels != IGNORE]) == "An astronaut.<|im_end|>"
    batch = Collator.for_model(model, encoder.pad_token_id)([sample])
    assert torch.isfinite(model(**batch).loss)


def test_truncation_policies(qwen, image_dir):
    record = llava("long", "astronaut.png", "<image>\nDescribe.", "It is " + "very " * 60 + "nice.")
    with pytest.raises(DataProblem, match="too_long") as info:
        encoder_for(qwen, image_dir).encode(record, 0)
    assert not info.value.fatal
    with pytest.raises(DataProblem) as info:
        encoder_for(qwen, image_dir, truncation="raise").encode(record, 0)
    assert info.value.fatal
    with pytest.raises(DataProblem):
        VLMDataset([record], encoder_for(qwen, image_dir, truncation="raise"))[0]  # fatal: not swallowed
    cut = encoder_for(qwen, image_dir, truncation="text").encode(record, 0)
    model, _ = qwen
    assert len(cut) == MAX_LENGTH and (cut.labels != IGNORE).any()
    assert int((cut.input_ids == model.tokens.image_token_id).sum()) == cut.tokens_per_image[0]  # span intact
    assert int(cut.input_ids.tolist().count(model.tokens.vision_end_token_id)) == 1
    # The answer starts after the limit: cutting would leave nothing to learn -> still a problem.
    late = llava("late", "astronaut.png", "<image>\n" + "why " * 60, "Because.")
    with pytest.raises(DataProblem, match="no supervised token"):
        encoder_for(qwen, image_dir, truncation="text").encode(late, 0)
    # An image span across the limit is never cut.
    split = llava("split", ["astronaut.png"] * 1, "x " * 90 + "<image>", "ok")
    with pytest.raises(DataProblem, match="split it"):
        encoder_for(qwen, image_dir, truncation="text", max_length=190).encode(split, 0)


def test_dataloader_with_workers_and_length_grouping(qwen, image_dir):
    model, _ = qwen
    encoder = encoder_for(qwen, image_dir)
    records = [*list(GOOD.values()), BAD["corrupt"][0], BAD["missing"][0]]
    dataset = VLMDataset(records, encoder)
    lengths = dataset.lengths()
    exact = [len(s) if not isinstance(s, DataProblem) else None for s in dataset]
    assert all(e is None or e == n for e, n in zip(exact, lengths, strict=True))  # header-only estimate is exact
    sampler = length_grouped_sampler(dataset, batch_size=4, seed=0)
    collate = Collator.for_model(model, encoder.pad_token_id, max_tokens=MAX_LENGTH)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate)
    ids, problems = [], []
    for batch in loader:
        ids += [i for row in batch["meta"]["sample_ids"] for i in row]
        problems += [p["id"] for p in batch["meta"]["problems"]]
        assert batch["attention_mask"].dtype == torch.bool
        with torch.no_grad():
            assert torch.isfinite(model(**batch).loss)
    assert sorted(ids) == sorted(GOOD) and sorted(problems) == ["corrupt", "missing"]


def test_check_dataset_reports_exactly_the_bad_samples(qwen, image_dir):
    records = list(GOOD.values()) + [r for r, _ in BAD.values()]
    report = check_dataset(records, encoder_for(qwen, image_dir))
    assert report.total == len(records) and report.ok == len(GOOD)
    assert {p["id"]: p["reason"] for p in report.problems} == {k: reason for k, (_, reason) in BAD.items()}
    assert report.to_dict()["visual_tokens_per_image"]["min"] >= 1
    assert "image_too_large" in report.format()


def test_data_check_cli(tmp_path, image_dir, capsys):
    records = list(GOOD.values()) + [r for r, _ in BAD.values()]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "report.json"
    args = ["data", "check", str(path), "--image-root", str(image_dir), "--json", str(out),
            "--max-length", str(MAX_LENGTH)]
    assert main(args) == 1  # 13 of 24 samples are bad: far above the default 5%
    report = json.loads(out.read_text())
    assert report["total"] == len(records) and report["ok"] == len(GOOD)
    assert sorted(p["id"] for p in report["problems"]) == sorted(BAD)
    assert {"id", "reason", "detail"} <= set(report["problems"][0])
    printed = capsys.readouterr().out
    assert "usable: 11" in printed and "placeholder_mismatch" in printed
    assert main([*args, "--max-bad-fraction", "0.6"]) == 0
    good_only = tmp_path / "good.json"
    good_only.write_text(json.dumps(list(GOOD.values())))
    assert main(["data", "check", str(good_only), "--image-root", str(image_dir)]) == 0


# ---- review findings: each was a sample that passed the check and then broke training ---------------
def test_images_in_a_system_turn_and_literal_span_tokens(qwen, image_dir):
    encoder = encoder_for(qwen, image_dir)
    system_image = {"id": "sys", "image": "astronaut.png", "conversations": [
        {"from": "system", "value": "Reference: <image>"}, {"from": "human", "value": "Who?"},
        {"from": "gpt", "value": "An astronaut."}]}
    sample = encoder.encode(system_image, 0)
    model, _ = qwen
    assert int((sample.input_ids == model.tokens.image_token_id).sum()) == sample.tokens_per_image[0]
    literal = llava("literal", None, "What is <|image_pad|>?", "A token.")
    with pytest.raises(DataProblem, match=r"placeholder_mismatch.*literally"):
        encoder.encode(literal, 0)
    with pytest.raises(DataProblem, match=r"bad_format.*system turn may only come first"):
        encoder.encode({"id": "late", "conversations": [{"from": "human", "value": "hi"},
                                                        {"from": "system", "value": "be nice"},
                                                        {"from": "gpt", "value": "ok"}]}, 0)


def _bpe_tokenizer(tmp_path, specials, eos=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["Who is this? An astronaut.", "user assistant system"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=eos).save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def test_tokenizer_without_eos_and_with_all_tokens_already_present(tmp_path, image_dir):
    torch.manual_seed(0)
    model = build_model("qwen3_5_vit", "qwen_merger", "qwen3_5")
    tokenizer = _bpe_tokenizer(tmp_path / "a", [])
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(image_dir))
    assert tokenizer.eos_token == "<|im_end|>"  # the template's end of turn, never an image token
    assert encoder.pad_token_id not in encoder.span_ids
    text_only = Collator.for_model(model, encoder.pad_token_id)([encoder.encode(GOOD["text"], 0),
                                                               encoder.encode(GOOD["photo"], 1)])
    assert torch.isfinite(model(**text_only).loss)
    # All special tokens present, but at ids the model does not use yet: still aligned and resized.
    torch.manual_seed(0)
    fresh = build_model("qwen3_5_vit", "qwen_merger", "qwen3_5")
    full = _bpe_tokenizer(tmp_path / "b", ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                                           "<|vision_end|>"], eos="<|im_end|>")
    full.add_tokens([f"extra{k}" for k in range(300)])  # a vocabulary larger than the tiny model's 256
    SampleEncoder.for_model(fresh, full, image_root=str(image_dir))
    assert fresh.tokens.image_token_id == full.convert_tokens_to_ids("<|image_pad|>")
    assert fresh.backbone.get_input_embeddings().num_embeddings == len(full)


def test_sentencepiece_style_tokenizer_renders_like_whole_string_tokenization(image_dir):
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    backend = SentencePieceBPETokenizer()
    backend.train_from_iterator(["A chat between a curious human and an assistant. USER: Hi there ASSISTANT: Yes sir"]
                                * 20, vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    torch.manual_seed(0)
    model = build_model("clip", "mlp2x_gelu", "llama")
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(image_dir))
    sample = encoder.encode(llava("t", None, "Hi there", "Yes sir"), 0)
    system = encoder.template.default_system
    whole = tokenizer(f"{system} USER: Hi there ASSISTANT: Yes sir", add_special_tokens=False)["input_ids"]
    assert sample.input_ids.tolist() == [tokenizer.bos_token_id, *whole, tokenizer.eos_token_id]
    assert tokenizer.decode(sample.input_ids[sample.labels != IGNORE]).strip() == "Yes sir</s>"


def test_data_problems_survive_pickling_across_workers():
    import pickle

    problem = DataProblem("too_long", "300 > 200", sample_id="x", path="a.png", fatal=True)
    again = pickle.loads(pickle.dumps(problem))
    assert (again.reason, again.detail, again.sample_id, again.path, again.fatal) == ("too_long", "300 > 200", "x",
                                                                                      "a.png", True)


def test_a_broken_jsonl_line_is_a_counted_problem(tmp_path, image_dir, qwen):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD["photo"]) + "\n{not json\n" + json.dumps(GOOD["text"]) + "\n")
    out = tmp_path / "r.json"
    assert main(["data", "check", str(path), "--image-root", str(image_dir), "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert (report["total"], report["ok"]) == (3, 2)
    assert report["problems"][0]["id"] == "line 2" and report["problems"][0]["reason"] == "bad_format"
    dataset = VLMDataset(path, encoder_for(qwen, image_dir))
    assert isinstance(dataset[1], DataProblem) and not isinstance(dataset[2], DataProblem)


def test_symlinked_directories_inside_the_root_are_allowed(tmp_path, image_dir):
    root = tmp_path / "root"
    root.mkdir()
    (root / "coco").symlink_to(image_dir, target_is_directory=True)
    assert parse_record(llava("s", "coco/astronaut.png", "<image>"), 0, root).images[0].endswith("astronaut.png")
    with pytest.raises(DataProblem, match="path_outside_root"):
        parse_record(llava("s", "coco/../../outside.png", "<image>"), 0, root)


def test_vicuna_multi_turn_matches_llava_conv_vicuna_v1(image_dir):
    torch.manual_seed(0)
    model = build_model("clip", "mlp2x_gelu", "llama")
    tokenizer = char_tokenizer()
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(image_dir))
    record = {"id": "m", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                                           {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Ciao."}]}
    text = tokenizer.decode(encoder.encode(record, 0).input_ids)
    system = encoder.template.default_system
    assert text == f"<s>{system} USER: Hi ASSISTANT: Hello.</s>USER: Bye ASSISTANT: Ciao.</s>"


# ---- the pipeline with real tokenizers (tests/fixtures/tokenizers) -----------------------------------------------
REAL = {
    # (model parts, vendored tokenizer, the template it carries as its own: None = none, the backbone's built-in)
    "llava + SentencePiece llama": (("clip", "mlp2x_gelu", "llama"), "llama2", None),
    "qwen3.5 + Qwen BPE, official template": (("qwen3_5_vit", "qwen_merger", "qwen3_5"), "qwen3", "qwen3_5"),
}


@pytest.mark.parametrize("case", list(REAL))
def test_the_pipeline_with_real_tokenizers_pads_packs_and_supervises_exactly_the_answers(case, image_dir):
    from real_tokenizers import real_tokenizer

    from mmadapt.data.templates import TEMPLATES

    names, tokenizer_name, own = REAL[case]
    torch.manual_seed(0)
    model = build_model(*names)
    tokenizer = real_tokenizer(tokenizer_name)
    if own is not None:
        tokenizer.chat_template = TEMPLATES.get(own).jinja(tokenizer)
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(image_dir))
    records = [GOOD[k] for k in ("photo", "two", "text", "messages", "exif")]
    dataset = VLMDataset(records, encoder)
    samples = [dataset[i] for i in range(len(dataset))]
    assert all(not isinstance(s, DataProblem) for s in samples)
    end = encoder.template.end_of_turn(tokenizer)
    for record, sample in zip(records, samples, strict=True):
        answer = (record.get("conversations") or [{"value": record["messages"][-1]["content"]}])[-1]["value"]
        supervised = [t for t, label in zip(sample.input_ids.tolist(), sample.labels.tolist(), strict=True)
                      if label != -100]
        assert tokenizer.decode(supervised).strip().endswith(f"{answer}{end}")  # the answer and its end token
        assert int((sample.input_ids == model.tokens.image_token_id).sum()) == sum(sample.tokens_per_image)
    padded = Collator.for_model(model, encoder.pad_token_id)(samples)
    packed = Collator.for_model(model, encoder.pad_token_id, max_tokens=2048)(samples)
    assert check_batch(model, padded).ok and check_batch(model, packed).ok
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(**padded).loss, model(**packed).loss, atol=1e-5)
