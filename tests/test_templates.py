"""Chat templates with real tokenizers: the token stream a checkpoint was trained on, exactly.

- `vicuna_v1` against LLaVA-1.5's own preprocessing, re-implemented below from haotian-liu/LLaVA at
  c121f0432da27facab705978f83c4ada465e46fd: `conv_vicuna_v1` + `Conversation.get_prompt` (SeparatorStyle.TWO,
  llava/conversation.py 54-63, 242-252), `tokenizer_image_token` (llava/mm_utils.py 185-204) and the label masking
  of `preprocess_v1` (llava/train/train.py 414-497), with a SentencePiece Llama-family tokenizer.
- jinja mode against transformers' `apply_chat_template` with Qwen's BPE tokenizer and the official Qwen3.5 and
  Qwen3-VL templates (mmadapt/data/chat_templates/NOTICE names their sources), thinking and non-thinking.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import supervised_text
from real_tokenizers import real_tokenizer

import mmadapt
from mmadapt.data import SampleEncoder
from mmadapt.data.pipeline import ChatTemplateMismatch
from mmadapt.data.samples import Turn
from mmadapt.data.templates import IGNORE, TEMPLATES, ChatTemplateError, resolve_template
from mmadapt.directory import save_tokenizer

LLAVA = ("clip", "mlp2x_gelu", "llama")
QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
QWEN_VL = ("qwen3_vl_vit", "qwen_merger", "qwen3_vl")


@pytest.fixture(scope="module")
def llava_model():
    torch.manual_seed(0)
    return mmadapt.build_model(*LLAVA)


@pytest.fixture(scope="module")
def qwen_model():
    torch.manual_seed(0)
    return mmadapt.build_model(*QWEN)


# ---- LLaVA-1.5's preprocessing, from its code --------------------------------------------------------------------
LLAVA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
                "detailed, and polite answers to the user's questions.")
IMAGE_TOKEN_INDEX = -200


def llava_prompt(turns: list[tuple[str, str]]) -> str:
    """conv_vicuna_v1.get_prompt(): system + sep, then role + ": " + message + (sep, sep2) alternately."""
    seps, ret = [" ", "</s>"], LLAVA_SYSTEM + " "
    for i, (role, message) in enumerate(turns):
        ret += ("USER" if role == "user" else "ASSISTANT") + ": " + message + seps[i % 2]
    return ret


def tokenizer_image_token(prompt: str, tokenizer) -> list[int]:
    chunks = [tokenizer(chunk).input_ids for chunk in prompt.split("<image>")]
    input_ids, offset = [], 0
    if chunks and chunks[0] and chunks[0][0] == tokenizer.bos_token_id:
        offset = 1
        input_ids.append(chunks[0][0])
    separated = [x for pair in zip(chunks, [[IMAGE_TOKEN_INDEX] * (offset + 1)] * len(chunks), strict=True)
                 for x in pair][:-1]
    for x in separated:
        input_ids.extend(x[offset:])
    return input_ids


def preprocess_v1(turns: list[tuple[str, str]], tokenizer, has_image: bool) -> tuple[list[int], list[int]]:
    conversation = llava_prompt(turns)
    ids = tokenizer_image_token(conversation, tokenizer) if has_image else tokenizer(conversation).input_ids
    target = list(ids)
    sep = " " + "ASSISTANT" + ": "
    total_len = sum(1 for t in target if t != tokenizer.unk_token_id)  # LLaVA pads with unk
    rounds = conversation.split("</s>")
    cur_len = 1
    target[:cur_len] = [IGNORE] * cur_len
    for i, rou in enumerate(rounds):
        if rou == "":
            break
        parts = rou.split(sep)
        if len(parts) != 2:
            break
        parts[0] += sep
        if has_image:
            round_len = len(tokenizer_image_token(rou, tokenizer))
            instruction_len = len(tokenizer_image_token(parts[0], tokenizer)) - 2
        else:
            round_len = len(tokenizer(rou).input_ids)
            instruction_len = len(tokenizer(parts[0]).input_ids) - 2
        if i != 0 and not tokenizer.legacy:  # tokenizers >= 0.14
            round_len -= 1
            instruction_len -= 1
        target[cur_len : cur_len + instruction_len] = [IGNORE] * instruction_len
        cur_len += round_len
    target[cur_len:] = [IGNORE] * (len(target) - cur_len)
    assert cur_len == total_len, "LLaVA would have dropped this sample (tokenization mismatch)"
    return ids, target


def expand_llava(ids: list[int], labels: list[int], image_id: int, n: int) -> tuple[list[int], list[int]]:
    out_ids, out_labels = [], []
    for token, label in zip(ids, labels, strict=True):
        out_ids += [image_id] * n if token == IMAGE_TOKEN_INDEX else [token]
        out_labels += [IGNORE] * n if token == IMAGE_TOKEN_INDEX else [label]
    return out_ids, out_labels


CONVERSATIONS = {
    "one turn, image": [("user", "<image>\nWhat is shown in this image?"), ("assistant", "A red square on white.")],
    "two turns, image": [("user", "<image>\nWhat is it?"), ("assistant", "A cat."),
                         ("user", "What colour is it?"), ("assistant", "It is black, with a white spot.")],
    "one turn, text": [("user", "Name a primary colour."), ("assistant", "Blue.")],
    "three turns, text": [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Count to three."),
                          ("assistant", "1, 2, 3."), ("user", "Thanks."), ("assistant", "You're welcome.")],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_vicuna_v1_equals_llava_1_5_preprocess_v1_with_a_sentencepiece_tokenizer(llava_model, name):
    tokenizer = real_tokenizer("llama2")
    encoder = SampleEncoder.for_model(llava_model, tokenizer)
    assert encoder.template.name == "vicuna_v1"  # the tokenizer has no template: the backbone's built-in
    turns = CONVERSATIONS[name]
    has_image = "<image>" in turns[0][1]
    n = 5
    expected = preprocess_v1(turns, tokenizer, has_image)
    expected = expand_llava(*expected, llava_model.tokens.image_token_id, n)
    ids, labels = TEMPLATES.get("vicuna_v1").encode(
        [Turn(r, t) for r, t in turns], tokenizer, image_token_id=llava_model.tokens.image_token_id,
        image_span=encoder.image_span, image_text=encoder.image_text, tokens_per_image=[n] * has_image)
    assert ids == expected[0]
    assert labels == expected[1]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    if has_image:  # LLaVA tokenizes the text after <image> as its own string: a "▁" stands before the "\n"
        after = ids.index(llava_model.tokens.image_token_id) + n
        assert pieces[after : after + 2] == ["▁", "<0x0A>"]
    if len(turns) > 2:  # after </s>, "USER" is "▁US" "ER", as LLaVA-1.5 saw it
        eos = ids.index(tokenizer.eos_token_id)
        assert pieces[eos + 1 : eos + 3] == ["▁US", "ER"]


# ---- jinja: the tokenizer's own template, exactly apply_chat_template ---------------------------------------------
# A Qwen2-VL-style template (a default system prompt, then Qwen3-VL's): a template mmadapt does not ship, so it is
# used as the tokenizer's own, through apply_chat_template.
QWEN2_VL_STYLE = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant."
                  "<|im_end|>\\n' }}{%- endif %}")


def qwen_tokenizer(template: str | None = "qwen3_5"):
    """Qwen's BPE tokenizer carrying an official template as its own (as a Qwen3.5 / Qwen3-VL checkpoint ships)."""
    tokenizer = real_tokenizer("qwen3")
    if template == "qwen2_vl_style":
        tokenizer.chat_template = QWEN2_VL_STYLE + TEMPLATES.get("qwen3_vl").jinja(tokenizer)
    elif template is not None:
        tokenizer.chat_template = TEMPLATES.get(template).jinja(tokenizer)
    return tokenizer


def messages_of(turns: list[tuple[str, str]], system: str | None = None) -> list[dict]:
    out = [{"role": "system", "content": system}] if system else []
    for role, text in turns:
        if "<image>" not in text:
            out.append({"role": role, "content": text})
            continue
        parts = []
        for k, chunk in enumerate(text.split("<image>")):
            if k:
                parts.append({"type": "image"})
            if chunk:
                parts.append({"type": "text", "text": chunk})
        out.append({"role": role, "content": parts})
    return out


QWEN_CONVERSATIONS = {
    "0 images": [("user", "Hello there."), ("assistant", "Hi! How can I help?"),
                 ("user", "Say a colour."), ("assistant", "Green.")],
    "1 image": [("user", "<image>\nWhat is in the picture?"), ("assistant", "A red square."),
                ("user", "And the background?"), ("assistant", "White.")],
    "2 images": [("user", "Compare <image> and <image>."), ("assistant", "The first is larger."),
                 ("user", "Which is red?"), ("assistant", "The second one.")],
}


def chat_ids(result) -> list[int]:
    """`apply_chat_template(tokenize=True)`'s ids (a BatchEncoding in transformers 5, a list before)."""
    return list(result["input_ids"]) if hasattr(result, "keys") else list(result)


def encode_jinja(encoder, turns, tokens_per_image, **kwargs):
    return encoder.template.encode([Turn(r, t) for r, t in turns], encoder.tokenizer,
                                   image_token_id=encoder.image_token_id, image_span=encoder.image_span,
                                   image_text=encoder.image_text, tokens_per_image=tokens_per_image, **kwargs)


@pytest.mark.parametrize("template", ["qwen3_5", "qwen3_vl", "qwen2_vl_style"])
def test_jinja_mode_equals_apply_chat_template_with_qwens_tokenizer(qwen_model, template):
    tokenizer = qwen_tokenizer(template)  # one load per template (0.6 s each): the conversations run in a loop
    encoder = SampleEncoder.for_model(qwen_model, tokenizer)
    # auto: the tokenizer's own (an official one mmadapt ships is recognised as that built-in)
    assert encoder.template.name == ("tokenizer" if template == "qwen2_vl_style" else template)
    for system in (None, "You are a careful assistant."):
        for name, conversation in QWEN_CONVERSATIONS.items():
            check_jinja_mode(tokenizer, encoder, template, conversation, system, case=f"{name}, system {system!r}")


def check_jinja_mode(tokenizer, encoder, template, conversation, system, case):
    turns = ([("system", system)] if system else []) + conversation
    images = sum(t.count("<image>") for _, t in turns)
    expected = chat_ids(tokenizer.apply_chat_template(messages_of(conversation, system), tokenize=True))
    ids, labels = encode_jinja(encoder, turns, [1] * images)
    assert ids == expected, case  # token for token, one <|image_pad|> per image
    ids4, labels4 = encode_jinja(encoder, turns, [4] * images)  # and each expanded in place to its visual tokens
    assert len(ids4) == len(ids) + 3 * images and ids4.count(encoder.image_token_id) == 4 * images, case
    # labels: every assistant content and its <|im_end|>, nothing else. Qwen3.5's thinking mode: the template's
    # "\n</think>\n\n" after the generation prompt's "<think>\n" is part of the last answer; in the token stream the
    # prompt's "\n" and the answer's first "\n" are one token "\n\n", which is supervised (a label is per token)
    answers = [t for r, t in turns if r == "assistant"]
    expected_supervised = [f"{a}<|im_end|>" for a in answers]
    if template == "qwen3_5":
        expected_supervised[-1] = f"\n\n</think>\n\n{answers[-1]}<|im_end|>"
    assert supervised_text(tokenizer, ids, labels) == expected_supervised, case
    assert supervised_text(tokenizer, ids4, labels4) == expected_supervised, case


def test_qwen3_5_non_thinking_form_is_the_official_rendering_and_its_think_block_is_prompt(qwen_model):
    tokenizer = qwen_tokenizer("qwen3_5")
    encoder = SampleEncoder.for_model(qwen_model, tokenizer, template_kwargs={"enable_thinking": False})
    turns = QWEN_CONVERSATIONS["1 image"]
    ids, labels = encode_jinja(encoder, turns, [1], enable_thinking=False)
    expected = tokenizer.apply_chat_template(messages_of(turns), tokenize=True, enable_thinking=False)
    assert ids == chat_ids(expected)
    assert supervised_text(tokenizer, ids, labels) == ["A red square.<|im_end|>", "White.<|im_end|>"]
    # the generation prompt is what serving gives the model: the empty think block in non-thinking mode
    prompt, _ = encode_jinja(encoder, turns[:3], [1], add_generation_prompt=True, enable_thinking=False)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking, _ = encode_jinja(encoder, turns[:3], [1], add_generation_prompt=True)
    assert tokenizer.decode(thinking).endswith("<|im_start|>assistant\n<think>\n")


def test_a_template_that_writes_no_image_either_way_is_refused_for_images_naming_it(qwen_model):
    """Neither as a part nor as placeholder text in string content (tests/test_ports.py: text templates that do)."""
    tokenizer = real_tokenizer("qwen3")
    tokenizer.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content if m.role == "
                               "'assistant' else 'redacted') + '<|im_end|>\\n' }}{%- endfor %}")
    with pytest.raises(ChatTemplateError, match=r"chat template 'tokenizer' cannot take images"):
        SampleEncoder.for_model(qwen_model, tokenizer)


def test_a_built_in_that_differs_from_the_tokenizers_own_is_an_error_unless_accepted(qwen_model, caplog):
    tokenizer = qwen_tokenizer("qwen3_5")  # its own template opens each last answer with a think block
    with pytest.raises(ChatTemplateMismatch, match=r"'chatml' renders a conversation differently.*first difference "
                       r"at token \d+.*chat_template: auto.*chat_template_mismatch: warn"):
        SampleEncoder.for_model(qwen_model, tokenizer, chat_template="chatml")
    with caplog.at_level(logging.WARNING, logger="mmadapt.data.pipeline"):
        encoder = SampleEncoder.for_model(qwen_model, qwen_tokenizer("qwen3_5"), chat_template="chatml",
                                          chat_template_mismatch="warn")
    assert encoder.template.name == "chatml" and "accepted: chat_template_mismatch: warn" in caplog.text
    # the same official template named as a built-in agrees with the tokenizer's own: no error
    assert SampleEncoder.for_model(qwen_model, qwen_tokenizer("qwen3_5"), chat_template="qwen3_5").template.name \
        == "qwen3_5"


@pytest.mark.parametrize("builtin", ["chatml", "qwen3_5"])
@pytest.mark.slow
def test_the_trained_template_is_saved_with_the_tokenizer_and_serves_the_training_prompt(qwen_model, tmp_path,
                                                                                       builtin):
    from transformers import AutoTokenizer

    tokenizer = qwen_tokenizer(None)
    tokenizer.chat_template = None  # a tokenizer without a template: the built-in is used and written into it
    encoder = SampleEncoder.for_model(qwen_model, tokenizer, chat_template=builtin)
    turns = QWEN_CONVERSATIONS["1 image"]
    trained, _ = encode_jinja(encoder, turns, [1])
    save_tokenizer(tokenizer, tmp_path)  # as every model directory and checkpoint writes it
    saved = AutoTokenizer.from_pretrained(tmp_path)
    served = saved.apply_chat_template(messages_of(turns), tokenize=True)
    assert chat_ids(served) == trained
    assert resolve_template("auto", saved, "chatml").name == builtin  # mmadapt's export is its built-in again


def test_vicuna_v1_export_serves_the_training_prompt(llava_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = real_tokenizer("llama2")
    encoder = SampleEncoder.for_model(llava_model, tokenizer)
    turns = CONVERSATIONS["three turns, text"]
    trained, _ = encoder.template.encode([Turn(r, t) for r, t in turns], tokenizer, image_token_id=None,
                                         image_span=encoder.image_span, image_text="", tokens_per_image=[])
    save_tokenizer(tokenizer, tmp_path)  # as every model directory and checkpoint writes it
    saved = AutoTokenizer.from_pretrained(tmp_path)
    served = saved.apply_chat_template([{"role": r, "content": t} for r, t in turns], tokenize=True)
    assert chat_ids(served) == trained


@pytest.mark.slow
def test_a_saved_model_directory_serves_the_prompt_it_was_trained_with_template_kwargs_included(qwen_model, tmp_path):
    from mmadapt import Processor

    tokenizer = qwen_tokenizer(None)
    tokenizer.chat_template = None
    encoder = SampleEncoder.for_model(qwen_model, tokenizer, chat_template="qwen3_5",
                                      template_kwargs={"enable_thinking": False})
    turns = [Turn("user", "<image>\nWhat is in the picture?")]
    image = __import__("PIL.Image", fromlist=["Image"]).new("RGB", (64, 64), (200, 30, 30))
    trained = encoder.prompt_for("p", turns, [image]).input_ids.tolist()
    assert tokenizer.decode(trained).endswith("<think>\n\n</think>\n\n")  # the non-thinking generation prompt
    qwen_model.save_pretrained(tmp_path, tokenizer=tokenizer)
    served = Processor.from_pretrained(tmp_path)("<image>\nWhat is in the picture?", images=[image])
    assert served["input_ids"][0].tolist() == trained  # no template_kwargs given again: they were saved


def test_data_show_prints_the_samples_with_supervised_tokens_marked(tmp_path, capsys):
    import json

    from PIL import Image
    from real_tokenizers import unpacked

    from mmadapt.cli import main

    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "red.png")
    records = [{"id": "a", "image": "red.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour is this?"}, {"from": "gpt", "value": "Red."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    code = main(["data", "show", str(tmp_path / "d.jsonl"), "--encoder", "clip", "--projector", "mlp2x_gelu",
                 "--backbone", "llama", "--tokenizer", str(unpacked("llama2")), "--n", "2", "--colour", "never",
                 "--image-root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "chat template 'vicuna_v1'" in out
    assert "USER: <image x 16>\nWhat colour is this? ASSISTANT:[[Red.</s>]]" in out
    assert "-- a: " in out and "16 visual (1 image)" in out and "-- b: " in out and "0 visual (0 images)" in out
    assert "USER: Hi ASSISTANT:[[Hello!</s>]]" in out


def test_chatml_is_qwen3_vls_official_rendering(qwen_model):
    official = SampleEncoder.for_model(qwen_model, qwen_tokenizer("qwen3_vl"))
    chatml = SampleEncoder.for_model(qwen_model, qwen_tokenizer("qwen3_vl"), chat_template="chatml")  # no mismatch
    for system in (None, "You are a careful assistant."):
        for name, conversation in QWEN_CONVERSATIONS.items():
            turns = ([("system", system)] if system else []) + conversation
            images = [3] * sum(t.count("<image>") for _, t in turns)
            case = f"{name}, system {system!r}"
            assert encode_jinja(chatml, turns, images) == encode_jinja(official, turns, images), case
            assert encode_jinja(chatml, turns[:-1], images, add_generation_prompt=True) == \
                encode_jinja(official, turns[:-1], images, add_generation_prompt=True), case


def test_llava_hf_template_with_a_sentencepiece_tokenizer(llava_model):
    tokenizer = real_tokenizer("llama2")
    encoder = SampleEncoder.for_model(llava_model, tokenizer, chat_template="llava_hf")
    turns = CONVERSATIONS["two turns, image"]
    ids, labels = encode_jinja(encoder, turns, [1])
    # OpenAI-style parts, as mmadapt passes them to a template that reads parts: the text around each <image> as is
    messages = [{"role": r, "content": [{"type": "image"}, {"type": "text", "text": t.replace("<image>", "")}]
                 if "<image>" in t else [{"type": "text", "text": t}]} for r, t in turns]
    assert tokenizer.decode(ids).startswith("USER: <image> \n\nWhat is it? ASSISTANT: A cat. USER:")
    expected = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES.get("llava_hf").jinja(tokenizer),
                                             tokenize=True)
    assert ids == chat_ids(expected)
    # llava-hf writes no end token after an answer: each answer's own tokens are its labels
    assert [s.strip() for s in supervised_text(tokenizer, ids, labels)] == ["A cat.", "It is black, with a white spot."]
