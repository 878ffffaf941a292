"""Nothing from outside is trusted: placeholders are never generated nor re-read, no code or weights from elsewhere.

- Generation (mmadapt's `generate`, and transformers' through the exported `generation_config.json`) never emits a
  placeholder token, even from a head that favours them; an answer's placeholder text never becomes visual input
  (the chat's next turn, the evidence prompt).
- A tokenizer directory's own code never runs (no prompt either); a timm checkpoint naming another source of weights
  (`hf-hub:`, `local-dir:`) is refused; evidence map file names never come from record ids; a numerics dump is read
  with a bounded decompressed size.
"""

from __future__ import annotations

import builtins
import gzip
import json
import tracemalloc

import pytest
import torch
from helpers import noise_image

import mmadapt
from mmadapt import Processor
from mmadapt.contract import ImageTokenContractError
from mmadapt.data import char_tokenizer
from mmadapt.generation import next_token, placeholder_ids
from mmadapt.processor import export_processor

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
LLAVA = ("clip", "mlp2x_gelu", "llama")
QWEN3_VL = ("qwen3_vl_vit", "qwen_merger", "qwen3_vl")  # Qwen's spans without Gated DeltaNet: fast on a CPU


def tiny(names):
    """A tiny random model of `names` and its processor (char tokenizer, span tokens added)."""
    torch.manual_seed(0)
    model = mmadapt.build_model(*names).eval()
    return model, Processor.for_model(model, char_tokenizer())


def head(model):
    return model.backbone.get_output_embeddings()


def favour(head, ids_by_call):
    """Make the LM `head` favour the ids `ids_by_call(k)` in its k-th forward (+1e4, then +1e4 - 1, ...): a hook on
    the head's output, as a trained bias towards those tokens would be."""
    calls = []

    def hook(_module, _inputs, logits):
        bias = torch.zeros(logits.shape[-1])
        for rank, token in enumerate(ids_by_call(len(calls))):
            bias[token] = 1e4 - rank
        calls.append(1)
        return logits + bias.to(logits)

    return head.register_forward_hook(hook)


# ---- generation never emits a placeholder ---------------------------------------------------------------------
@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_generate_never_emits_a_placeholder_from_a_head_that_favours_them(names, tmp_path):
    model, processor = tiny(names)
    placeholders = placeholder_ids(model.tokens)
    expected = [model.tokens.image_token_id] + ([model.tokens.vision_start_token_id, model.tokens.vision_end_token_id,
                                                 model.tokens.video_token_id] if names == QWEN else [])
    assert placeholders == sorted(expected)
    inputs = processor("<image>\nWhat is it?", images=[noise_image(tmp_path / "a.png")])
    handle = favour(head(model), lambda _: placeholders)
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1]
    assert next_token(logits, 0.0, 1.0).item() in placeholders  # the head does favour them
    runs = [model.generate(**inputs, max_new_tokens=5),
            model.generate(**inputs, max_new_tokens=5, temperature=1.0, generator=torch.Generator().manual_seed(0)),
            model.generate(**inputs, max_new_tokens=5, temperature=2.0, top_p=0.5,
                           generator=torch.Generator().manual_seed(1))]
    handle.remove()
    for run in runs:
        assert run.shape == (1, 5) and not torch.isin(run, torch.tensor(placeholders)).any(), run
    suppressed = torch.tensor(placeholders)
    assert next_token(logits, 0.0, 1.0, suppress=suppressed).item() == logits[0].topk(len(placeholders) + 1)[1][-1]


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_the_exported_generation_config_suppresses_placeholders_in_transformers(names, tmp_path):
    from transformers import AutoModelForImageTextToText, GenerationConfig

    model, _ = tiny(names)
    model.save_pretrained(tmp_path, format="transformers", processor_export=export_processor)
    placeholders = placeholder_ids(model.tokens)
    saved = GenerationConfig.from_pretrained(tmp_path)
    assert set(placeholders) <= set(saved.suppress_tokens)
    theirs = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    favour(theirs.lm_head, lambda _: placeholders)
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                          pad_token_id=0)[:, 4:]
    assert out.shape == (1, 4) and not torch.isin(out, torch.tensor(placeholders)).any(), out
    unsuppressed = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                                   pad_token_id=0, suppress_tokens=None)[:, 4:]
    assert torch.isin(unsuppressed, torch.tensor(placeholders)).all()  # it is the exported config that suppresses


# ---- an answer is never read as visual input ----------------------------------------------------------------------
@pytest.mark.parametrize(("names", "spelled"), [(QWEN, "<|video_pad|>"), (LLAVA, "<image>"), (QWEN, "<video>")],
                         ids=["qwen-video-pad", "llava-image", "qwen-video"])
def test_a_chat_never_reads_placeholder_text_in_an_answer_as_visual_input(names, spelled, tmp_path, caplog):
    from mmadapt.inference import Chat, Sampling

    model, processor = tiny(names)
    vocab = processor.tokenizer.get_vocab()
    text = "ok " + spelled  # written character by character: ordinary tokens, not the placeholder token
    handle = favour(head(model), lambda k: [vocab[text[k]] if k < len(text) else processor.eos_token_ids[0]])
    chat = Chat(model, processor, sampling=Sampling(max_new_tokens=len(text) + 1))
    assert chat.ask("What is it?", images=[noise_image(tmp_path / "a.png")]) == text
    handle.remove()
    assert chat.turns[-1].content == "ok " and "placeholder text" in caplog.text
    assert isinstance(chat.ask("And now?"), str)  # the history still holds one image for one placeholder
    assert processor.inert("<im<image>age> <vi<video>deo>x") == " x"  # removed until none is left


def test_the_evidence_prompt_refuses_an_answer_holding_a_placeholder(tmp_path):
    from mmadapt.evidence.prompt import Prompt

    model, processor = tiny(QWEN)
    inputs = processor("<image>\nWhat is it?", images=[noise_image(tmp_path / "a.png")])
    for token in placeholder_ids(model.tokens):
        with pytest.raises(ImageTokenContractError, match=rf"placeholder token\(s\) \[{token}\].*never read as "
                                                          "visual input"):
            Prompt.of(model, inputs, torch.tensor([5, token, 6]))
    assert Prompt.of(model, inputs, torch.tensor([5, 6])).answer.tolist() == [5, 6]


def test_explain_answers_a_model_that_favours_the_video_pad(tmp_path):
    """The reported failure: a Qwen model answered with `<|video_pad|>`, and the evidence map's prompt built from that
    answer stopped with "1 video frame span(s) but no video frames were given"."""
    from mmadapt.evidence import Occlusion, explain

    model, processor = tiny(QWEN)
    favour(head(model), lambda k: [model.tokens.video_token_id, *placeholder_ids(model.tokens),
                                   *([processor.eos_token_ids[0]] if k >= 2 else [])])
    result = explain(model, processor, noise_image(tmp_path / "a.png"), "Colour?", method=Occlusion(windows=(1,)),
                     max_new_tokens=4, curve_steps=0, out=tmp_path / "map.png")
    assert len(result.answer_ids) == 2 and not set(result.answer_ids) & set(placeholder_ids(model.tokens))
    assert result.png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # two maps with their faithfulness curves (about 260 forwards)
def test_eval_evidence_never_explains_a_placeholder_and_names_files_by_a_counter(tmp_path):
    """`mmadapt eval --evidence`'s path (`explain_records`) on a model whose head favours the placeholders, with
    record ids that would escape --evidence-dir: the maps are NNN.png inside it, the ids in its index.json."""
    from mmadapt.evidence import explain_records

    model, processor = tiny(LLAVA)
    ends = processor.eos_token_ids  # after the placeholders, the end: short answers keep the test fast
    favour(head(model), lambda _: [*placeholder_ids(model.tokens), ends[0]])
    root, out = tmp_path / "data", tmp_path / "deep" / "maps"
    root.mkdir()
    ids = ["../../escape", "/abs/x"]
    records = [{"id": i, "image": f"{k}.png", "conversations": [{"from": "human", "value": "<image>\nColour?"},
                                                                 {"from": "gpt", "value": "red"}]}
               for k, i in enumerate(ids)]
    for k in range(len(ids)):
        noise_image(root / f"{k}.png", k)
    before = {p for p in tmp_path.rglob("*")}
    report = explain_records(model, processor, records, out, limit=2, image_root=root)
    assert [item.id for item in report.items] == ids
    assert all(item.explanation.answer_ids == () for item in report.items)  # the end token, not a placeholder
    created = {p for p in tmp_path.rglob("*")} - before
    assert created == {tmp_path / "deep", out, out / "000.png", out / "001.png", out / "index.json"}
    index = json.loads((out / "index.json").read_text())
    assert [(e["id"], e["png"]) for e in index] == [(i, str(out / f"{k:03d}.png")) for k, i in enumerate(ids)]


# ---- no code and no weights from elsewhere ------------------------------------------------------------------------
def remote_code_tokenizer(directory, marker):
    """A tokenizer directory whose class exists only as its own Python file, which writes `marker` when run."""
    directory.mkdir()
    (directory / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}}))
    return directory


def test_a_tokenizer_directorys_own_code_never_runs_and_nobody_is_asked(tmp_path, monkeypatch):
    from mmadapt.data.tokenizer import RemoteCodeError, saved_tokenizer, tokenizer_for

    marker = tmp_path / "MARKER"
    directory = remote_code_tokenizer(tmp_path / "tok", marker)
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")  # a user who says yes
    for load in (saved_tokenizer, tokenizer_for, Processor.from_pretrained):
        with pytest.raises(RemoteCodeError, match=r"custom code in that directory.*never runs a checkpoint's own "
                                                  r"code\. Fix: "):
            load(str(directory))
    assert not marker.exists() and not asked


AUTO_MAPS = {"config.json": {"AutoConfig": "configuration_evil.EvilConfig"},
             "tokenizer_config.json": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}


def plant_auto_maps(directory):
    """Add an `auto_map` to `directory`'s config.json (at the top and in its text_config) and tokenizer_config.json,
    the classes themselves staying transformers' own: what a hub checkpoint may carry."""
    for name, auto_map in AUTO_MAPS.items():
        path = directory / name
        config = json.loads(path.read_text())
        config["auto_map"] = auto_map
        if "text_config" in config:
            config["text_config"]["auto_map"] = auto_map
        path.write_text(json.dumps(config))


def jsons_with_auto_map(root):
    from mmadapt.remote_code import auto_map_keys

    return {str(p.relative_to(root)): auto_map_keys(json.loads(p.read_text())) for p in sorted(root.rglob("*.json"))
            if auto_map_keys(json.loads(p.read_text()))}


def test_no_directory_mmadapt_writes_carries_an_auto_map_and_a_loaded_one_is_warned_about(tmp_path, caplog,
                                                                                           monkeypatch):
    """A source (a transformers export) whose config.json and tokenizer_config.json carry `auto_map` beside standard
    classes: loading warns, naming each file; then its mmadapt directory, its transformers export, a run's checkpoint
    and OUT/model, and the run's export hold no `auto_map` in any JSON file - even with a tokenizer that still carries
    one (read by transformers directly, not through mmadapt)."""
    from transformers import AutoTokenizer

    from mmadapt import VisionLanguageModel
    from mmadapt.data.tokenizer import saved_tokenizer
    from mmadapt.synthetic import synthetic_samples
    from mmadapt.train import RunConfig, Trainer
    from mmadapt.train.export import export

    model, processor = tiny(LLAVA)
    source = tmp_path / "source"
    model.save_pretrained(source, format="transformers", tokenizer=processor.tokenizer,
                          processor_export=export_processor)
    plant_auto_maps(source)
    with caplog.at_level("WARNING", logger="mmadapt.remote_code"):
        loaded, tokenizer = VisionLanguageModel.from_pretrained(source), saved_tokenizer(source)
    for name in AUTO_MAPS:
        assert any(str(source / name) in r.getMessage() and "dropped, because mmadapt never runs code from a model "
                   "directory" in r.getMessage() for r in caplog.records), name
    assert "text_config.auto_map" in caplog.text
    raw = AutoTokenizer.from_pretrained(source)  # transformers keeps the auto_map: the write must drop it
    assert raw.init_kwargs.get("auto_map") == AUTO_MAPS["tokenizer_config.json"]
    out = tmp_path / "out"
    loaded.save_pretrained(out / "mmadapt", tokenizer=tokenizer)
    loaded.save_pretrained(out / "export", format="transformers", processor_export=export_processor, tokenizer=raw)
    loaded.save_pretrained(out / "raw", tokenizer=raw)
    monkeypatch.setattr("mmadapt.train.trainer.plot_history", lambda *_: None)
    config = RunConfig.load(None, [f"train.out={out / 'run'}", "train.progress=false", "train.steps=1",
                                   "data.batch_size=2"])
    samples = synthetic_samples(loaded, [1, 1], text_lengths=[5, 6], seed=0)
    Trainer(loaded, config, samples, processor.collator, tokenizer=raw).fit()
    export(out / "run", out / "run-export", format="transformers")
    written = {p.parent.relative_to(out).as_posix() for p in out.rglob("tokenizer_config.json")}
    assert {"mmadapt", "export", "raw", "run/model", "run-export"} <= written and any(
        w.startswith("run/checkpoints/step-") for w in written)
    assert jsons_with_auto_map(out) == {}
    assert set(jsons_with_auto_map(source)) == set(AUTO_MAPS)  # the source itself is left as it was


@pytest.mark.parametrize("field", ["architecture", "options", "pretrained_cfg"])
@pytest.mark.parametrize("name", ["hf-hub:timm/vit_tiny_patch16_224", "local-dir:/elsewhere/vit"])
def test_a_timm_checkpoint_naming_another_source_is_refused_before_timm_runs(field, name, tmp_path, monkeypatch):
    import timm
    from safetensors.torch import save_file

    from mmadapt.encoders import ENCODERS

    options = ENCODERS.get("timm").options("tiny")
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    config = {"architecture": name if field == "architecture" else "vit_tiny_patch16_224"}
    if field == "pretrained_cfg":
        config["pretrained_cfg"] = {"hf_hub_id": name, "tag": "x"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(timm, "create_model", lambda *a, **k: pytest.fail("timm.create_model ran"))
    if field == "options":
        options["model_name"] = name
    else:
        options.pop("model_name")
    shown = "options.model_name" if field == "options" else "pretrained_cfg.hf_hub_id" if field == "pretrained_cfg" \
        else "architecture"
    with pytest.raises(ValueError, match=rf"names {shown} '{name}', another source of weights than the local file"):
        ENCODERS.get("timm").from_pretrained(str(tmp_path), **options)


def test_a_numerics_dump_decompresses_within_a_stated_bound(tmp_path):
    from mmadapt.numerics import MAX_DUMP_BYTES, DumpTooLargeError, load_dump

    bomb = tmp_path / "bomb.json.gz"
    body = b'{"format": "mmadapt.numerics.dump", "forward": [], "grads": [], "meta": {"x": "'
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # ~65 KB on disk, MAX_DUMP_BYTES + 1 MiB of JSON
        f.write(body)
        chunk = b" " * (1 << 20)
        for _ in range(MAX_DUMP_BYTES // len(chunk) + 1):
            f.write(chunk)
        f.write(b'"}}')
    assert bomb.stat().st_size < 200_000
    with pytest.raises(DumpTooLargeError, match=rf"more than {MAX_DUMP_BYTES} bytes of JSON \(after decompression\)"):
        load_dump(bomb)
    tracemalloc.start()
    with pytest.raises(DumpTooLargeError, match="more than 1048576 bytes"):
        load_dump(bomb, max_bytes=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, f"reading a capped dump peaked at {peak} bytes"
    small = tmp_path / "small.json.gz"
    small.write_bytes(gzip.compress(body + b'ok"}}'))
    assert load_dump(small).meta == {"x": "ok"} and load_dump(small, max_bytes=len(body) + 5).meta == {"x": "ok"}
    with pytest.raises(DumpTooLargeError):
        load_dump(small, max_bytes=len(body) + 4)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="is not JSON"):
        load_dump(deep)
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(body)[:-12])
    with pytest.raises(ValueError, match="truncated or corrupt gzip stream"):
        load_dump(tmp_path / "cut.json.gz")
