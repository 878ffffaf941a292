"""LLaVA-style ports onto a text LLM keep the LLM's own chat template (issue 32).

A vision tower put on Qwen3 or a Llama-family text checkpoint meets a tokenizer whose template knows nothing of
images. With `chat_template: auto` mmadapt renders such a template with string content holding the backbone's image
placeholder text where each image is (`<|vision_start|><|image_pad|><|vision_end|>` for Qwen's backbones, LLaVA's
`<image>` for Llama's), then expands the placeholder as for any template. Checked with real tokenizers: Qwen3's
(its own template, with the think block) on `qwen3_vl_vit + qwen_merger + qwen3_vl`, and the vendored SentencePiece
tokenizer with Llama-2-chat's template (written below as the hub ships it) on `clip + mlp2x_gelu + llama`:
- text-only, one-image, two-image and system-message conversations give exactly `apply_chat_template`'s text of the
  same conversation with the placeholders written as text, tokenized whole, each placeholder expanded; each
  placeholder is exactly its own tokens (no merge across its boundary: the offsets cover it and nothing else);
- the supervised text is each answer and its end token (Qwen3's empty think block is part of the last answer in its
  thinking default, as the labelling rule says, and prompt with `enable_thinking: false`);
- `mmadapt train` runs on those records with `chat_template: auto`, `mmadapt data show` says how images entered;
- the trained model's directory and its transformers export render the training prompt for a new question
  (mmadapt's `Processor`; transformers' `AutoProcessor`).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import supervised_text, write_jsonl, write_run
from PIL import Image
from real_tokenizers import real_tokenizer, unpacked

import mmadapt
from mmadapt import Processor
from mmadapt.data import SampleEncoder
from mmadapt.data.pipeline import ChatTemplateMismatch
from mmadapt.processor import export_processor

# Llama-2-chat's template as meta-llama/Llama-2-7b-chat-hf ships it (text only: `content.strip()` fails on parts).
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

PORTS = {  # name: (encoder, projector, backbone), tokenizer, its template (None: its own), image size
    "qwen3": (("qwen3_vl_vit", "qwen_merger", "qwen3_vl"), "qwen3", None, 64),
    "llama2": (("clip", "mlp2x_gelu", "llama"), "llama2", LLAMA2_CHAT, 32),
}
CONVERSATIONS = {
    "text only": ([("user", "Capital of France?"), ("assistant", "Paris.")], 0),
    "one image": ([("user", "<image>\nWhat colour is this?"), ("assistant", "Red.")], 1),
    "two images": ([("user", "Compare <image> and <image>."), ("assistant", "The first is red."),
                    ("user", "And the shapes?"), ("assistant", "Both are squares.")], 2),
    "system": ([("system", "You are a careful assistant."), ("user", "<image>What is it?"),
                ("assistant", "A red square.")], 1),
}


def tokenizer_of(port: str):
    _, name, template, _ = PORTS[port]
    tokenizer = real_tokenizer(name)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module", params=list(PORTS))
def port(request):
    torch.manual_seed(0)
    return request.param, mmadapt.build_model(*PORTS[request.param][0]).eval()


def record(name: str, port: str, sample_id: str = "x") -> dict:
    turns, images = CONVERSATIONS[name]
    out = {"id": sample_id, "messages": [{"role": r, "content": t} for r, t in turns]}
    return {**out, "images": [f"{'red' if k == 0 else 'blue'}.png" for k in range(images)]} if images else out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    for name, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        for side in {size for *_, size in PORTS.values()}:
            Image.new("RGB", (side, side), colour).save(root / f"{name}-{side}.png")
    return root


def with_side(rec: dict, side: int) -> dict:
    return {**rec, "images": [p.replace(".png", f"-{side}.png") for p in rec.get("images", [])]}


def expected_ids(encoder, tokenizer, rec: dict, tokens_per_image, **kwargs) -> list[int]:
    """apply_chat_template of the conversation with each <image> written as the backbone's placeholder text,
    tokenized whole, each image token expanded to its image's visual tokens; also checks that every image token
    is exactly the placeholder's own text (nothing merged across its boundary)."""
    messages = [{"role": m["role"], "content": m["content"].replace("<image>", encoder.image_text)}
                for m in rec["messages"]]
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    image = encoder.image_token_id
    token = tokenizer.convert_ids_to_tokens(image)
    counts, out = iter(tokens_per_image), []
    for k, (t, (a, b)) in enumerate(zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)):
        if t == image:
            assert text[a:b] == token, (text[a - 5: b + 5], token)
            if encoder.brackets:  # Qwen: <|vision_start|><|image_pad|><|vision_end|>, three tokens
                assert (encoded["input_ids"][k - 1], encoded["input_ids"][k + 1]) == encoder.brackets
        out += [t] * next(counts) if t == image else [t]
    assert next(counts, None) is None
    return out


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_a_text_template_renders_the_conversation_as_its_own_text_with_placeholders_expanded(port, name, root):
    port_name, model = port
    tokenizer = tokenizer_of(port_name)
    own = tokenizer.chat_template
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(root))  # chat_template: auto
    assert encoder.template.name == "tokenizer" and tokenizer.chat_template == own  # the checkpoint's own, kept
    assert encoder.image_mode.startswith("text only")
    assert encoder.image_text == model.backbone_spec.image_text  # what the backbone declares
    rec = with_side(record(name, port_name), PORTS[port_name][3])
    sample = encoder.encode(rec, 0)
    ids, labels = sample.input_ids.tolist(), sample.labels.tolist()
    assert ids == expected_ids(encoder, tokenizer, rec, sample.tokens_per_image)
    assert len(sample.tokens_per_image) == CONVERSATIONS[name][1]
    answers = [t for r, t in CONVERSATIONS[name][0] if r == "assistant"]
    runs = supervised_text(tokenizer, ids, labels)
    if port_name == "llama2":  # ' ' + answer + ' ' + eos: the answer, the space before </s>, and </s>
        assert runs == [f"{a} </s>" for a in answers]
    else:  # Qwen3's thinking default writes the empty think block after its generation prompt: part of the answer
        assert runs == [f"{a}<|im_end|>" for a in answers[:-1]] + [f"<think>\n\n</think>\n\n{answers[-1]}<|im_end|>"]


def test_qwen3s_non_thinking_form_supervises_exactly_the_answers(root):
    model = mmadapt.build_model(*PORTS["qwen3"][0]).eval()
    tokenizer = tokenizer_of("qwen3")
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(root),
                                      template_kwargs={"enable_thinking": False})
    rec = with_side(record("two images", "qwen3"), 64)
    sample = encoder.encode(rec, 0)
    ids = sample.input_ids.tolist()
    assert ids == expected_ids(encoder, tokenizer, rec, sample.tokens_per_image, enable_thinking=False)
    assert supervised_text(tokenizer, ids, sample.labels.tolist()) == ["The first is red.<|im_end|>",
                                                                       "Both are squares.<|im_end|>"]
    prompt = encoder.prompt_for("q", [mmadapt.data.samples.Turn("user", "<image>Shape?")],
                                [Image.new("RGB", (64, 64))])
    assert tokenizer.decode(prompt.input_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_built_in_that_differs_from_the_text_template_is_still_refused(port):
    port_name, model = port
    other = "chatml" if port_name == "llama2" else "vicuna_v1"
    with pytest.raises(ChatTemplateMismatch, match=rf"{other!r} renders a conversation differently.*first difference"):
        SampleEncoder.for_model(model, tokenizer_of(port_name), chat_template=other)


@pytest.mark.slow  # two short training runs and an export per port
def test_a_port_trains_with_auto_and_serves_the_training_prompt_after_export(port, root, tmp_path, capsys):
    from transformers import AutoProcessor

    from mmadapt.cli import main

    port_name, _ = port
    (parts, tokenizer_name, template, side) = PORTS[port_name]
    tokenizer_dir = unpacked(tokenizer_name)
    if template is not None:  # the text LLM's directory: its tokenizer with its own (text-only) template
        from mmadapt.directory import save_tokenizer

        save_tokenizer(tokenizer_of(port_name), tmp_path / "tokenizer")  # keeps `legacy: true`, as the hub has it
        tokenizer_dir = tmp_path / "tokenizer"
    records = [with_side(record(name, port_name, f"s{k}"), side) for k, name in enumerate(CONVERSATIONS)]
    data = write_jsonl(tmp_path / "train.jsonl", records)
    model = dict(zip(("encoder", "projector", "backbone"), parts, strict=True))
    run = write_run(tmp_path / "run.yaml", model={**model, "preset": "tiny"},
                    data={"train": data, "image_root": root, "tokenizer": tokenizer_dir, "batch_size": 2,
                          "chat_template": "auto"},
                    train={"steps": 2, "out": tmp_path / "out", "progress": False})
    assert main(["data", "show", str(data), str(run), "--n", "1", "--colour", "never"]) == 0
    shown = capsys.readouterr().out
    assert "chat template 'tokenizer' (the tokenizer's own; text only: each image enters" in shown
    assert main(["train", str(run)]) == 0
    out = tmp_path / "out" / "model"
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    picture = Image.new("RGB", (side, side), (20, 200, 20))
    ours = Processor.from_pretrained(out)(question, images=[picture])
    trained = mmadapt.VisionLanguageModel.from_pretrained(out)
    encoder = SampleEncoder.for_model(trained, tokenizer_of(port_name))
    rec = {"messages": [{"role": "user", "content": "<image>Which colour?"}]}
    expected = expected_ids(encoder, encoder.tokenizer, rec, [ours["input_ids"].eq(encoder.image_token_id).sum()],
                            add_generation_prompt=True)
    assert ours["input_ids"][0].tolist() == expected  # mmadapt's directory: the training prompt
    trained.save_pretrained(tmp_path / "hf", format="transformers", tokenizer=Processor.from_pretrained(out).tokenizer,
                            processor_export=export_processor)
    theirs = AutoProcessor.from_pretrained(tmp_path / "hf").apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Which colour?"}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert theirs["input_ids"][0].tolist() == expected  # the export: transformers builds the same prompt
    notes = json.loads((tmp_path / "hf" / "mmadapt_export.json").read_text())["notes"]
    assert any("prelude" in note for note in notes)
