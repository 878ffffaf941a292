"""What generation gives a server: a repetition penalty equal to transformers', log-probs that are the model's own,
text-level stop strings, seeds, and `respond` (the one entry `mmadapt chat` and `mmadapt serve` share)."""

from __future__ import annotations

import pytest
import torch
from helpers import noise_image
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import mmadapt
from mmadapt import Processor
from mmadapt.answering import Decoding, Sampling, TextStream, respond
from mmadapt.data import char_tokenizer
from mmadapt.generation import GenerationStep, penalize_repetition, placeholder_ids, seen_tokens

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen model, its processor (char tokenizer) and one image."""
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).eval()
    return model, Processor.for_model(model, char_tokenizer()), noise_image(tmp_path_factory.mktemp("gen") / "a.png")


def ask(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]


# ---- the repetition penalty ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [1.7, 0.6])
def test_the_repetition_penalty_equals_transformers_logits_processor(penalty):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=generator) * 4  # positive and negative logits
    ids = torch.randint(0, 40, (3, 9), generator=generator)
    ids[0, :4] = 5  # repeats
    seen = seen_tokens(ids, torch.ones_like(ids, dtype=torch.bool), 40)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.equal(penalize_repetition(logits, seen, penalty), expected)
    assert not torch.equal(expected, logits)


def test_padding_is_not_a_seen_token():
    ids = torch.tensor([[7, 7, 3, 4]])
    seen = seen_tokens(ids, torch.tensor([[False, False, True, True]]), 10)
    assert seen[0].nonzero().flatten().tolist() == [3, 4]


def test_generate_with_a_repetition_penalty_equals_transformers_generate(tiny):
    """Text only, so transformers' own causal LM (the backbone) decodes the same prompt: greedy with the penalty,
    the placeholders suppressed in both (mmadapt never generates them)."""
    model = tiny[0]
    prompt = torch.tensor([[5, 9, 5, 11, 12, 13, 5, 9]])
    placeholders = placeholder_ids(model.tokens)
    ours = model.generate(prompt, max_new_tokens=10, repetition_penalty=1.5)
    theirs = model.backbone.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                     do_sample=False, repetition_penalty=1.5, suppress_tokens=placeholders,
                                     pad_token_id=0, eos_token_id=None)[:, prompt.shape[1]:]
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, model.generate(prompt, max_new_tokens=10))  # the penalty changed the answer


# ---- log-probs -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 2.0], ids=["greedy", "sampled"])
def test_logprobs_are_the_log_softmax_of_the_models_logits(tiny, temperature):
    """Each step's log-probs (chosen and top 4) equal log_softmax of the logits of a full forward over the prompt and
    the answer (placeholders removed: they can never be generated), whatever the temperature (the model's
    distribution, not the sampled one). Tolerance 1e-4: cached decoding against one full forward, fp32."""
    model, processor, image = tiny
    inputs = processor("<image>\nWhat is it?", images=[image])
    steps: list[GenerationStep] = []
    out = model.generate(**inputs, max_new_tokens=6, temperature=temperature, logprobs=4, on_step=steps.append,
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = torch.cat([inputs["input_ids"], out[:, :-1]], dim=1)
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=inputs["pixel_values"],
                       image_grid_thw=inputs["image_grid_thw"]).logits[0, inputs["input_ids"].shape[1] - 1:]
    logits[:, placeholder_ids(model.tokens)] = float("-inf")
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert [int(s.tokens[0]) for s in steps] == out[0].tolist()
    for k, step in enumerate(steps):
        torch.testing.assert_close(step.logprobs[0], expected[k, out[0, k]], atol=1e-4, rtol=0)
        top = expected[k].topk(4)
        assert step.top_ids[0].tolist() == top.indices.tolist()
        torch.testing.assert_close(step.top_logprobs[0], top.values, atol=1e-4, rtol=0)
        if temperature == 0:
            assert int(step.top_ids[0, 0]) == int(out[0, k])  # greedy chooses the most likely


def test_asking_for_logprobs_changes_no_token(tiny):
    model, processor, image = tiny
    inputs = processor("<image>\nWhat is it?", images=[image])
    assert torch.equal(model.generate(**inputs, max_new_tokens=6, logprobs=3, on_step=lambda step: None),
                       model.generate(**inputs, max_new_tokens=6))


def test_on_step_ends_generation_early(tiny):
    model, processor, image = tiny
    inputs = processor("<image>\nWhat is it?", images=[image])
    out = model.generate(**inputs, max_new_tokens=8, on_step=lambda step: step.index == 2)
    assert out.shape == (1, 3) and torch.equal(out, model.generate(**inputs, max_new_tokens=3))


# ---- stop strings and streamed text --------------------------------------------------------------------------------
def by_bytes(ids: list[int]) -> str:  # one token per byte
    return bytes(ids).decode("utf-8", errors="replace")


def stream_bytes(text: str, stop: tuple[str, ...]) -> tuple[list[str], str, int | None]:
    """Feed `text` byte by byte: (the pieces sent, the final text, the byte count at which a stop string ended it)."""
    pieces: list[str] = []
    stream = TextStream(by_bytes, pieces.append, stop=stop)
    ids: list[int] = []
    for byte in text.encode():
        ids.append(byte)
        if stream.update(ids):
            return pieces, stream.finish(ids), len(ids)
    return pieces, stream.finish(ids), None


def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed():
    pieces, final, at = stream_bytes("héllo wörld 😀 STOP and more", ("STOP", "zzz"))
    assert final == "héllo wörld 😀" and at == len("héllo wörld 😀 STOP".encode())  # stripped, as decode strips
    assert "".join(pieces) == final and not any("S" in p for p in pieces)


def test_split_characters_and_overlapping_stop_prefixes_are_held_back_until_known():
    pieces, final, at = stream_bytes("x😀aab", ("ab",))
    assert final == "x😀a" and at is not None and "".join(pieces) == final
    assert not any("\ufffd" in p for p in pieces)  # the emoji's four bytes went out as one character
    pieces, final, at = stream_bytes("ab😀a", ("abc",))  # a held-back prefix that never completes is sent at the end
    assert at is None and final == "ab😀a" and "".join(pieces) == final


def test_whitespace_stop_strings_are_found_and_the_answer_is_stripped_as_decode_strips_it():
    pieces, final, at = stream_bytes("  Line one.\n\nLine two", ("\n\n",))
    assert final == "Line one." and at == len("  Line one.\n\n") and "".join(pieces) == final
    pieces, final, at = stream_bytes(" Ends with spaces   ", ())
    assert final == "Ends with spaces" and "".join(pieces) == final  # trailing whitespace never went out


def test_respond_stops_at_a_stop_string_and_streams_what_it_returns(tiny):
    model, processor, image = tiny
    full = respond(model, processor, ask(image), sampling=Sampling(max_new_tokens=16))
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    start = next(k for k in range(2, len(full.text) - 2) if full.text.find(full.text[k:k + 2]) == k)
    stop = full.text[start:start + 2]
    pieces: list[str] = []
    cut = respond(model, processor, ask(image), sampling=Sampling(max_new_tokens=16, stop=(stop,)),
                  on_text=pieces.append)
    assert cut.text == full.text[:start] and cut.finish_reason == "stop" and "".join(pieces) == cut.text
    n = len(cut.token_ids)
    assert cut.token_ids == full.token_ids[:n] and n < 16  # generation stopped at the token completing the stop
    assert stop in processor.decode(list(cut.token_ids)) and stop not in processor.decode(list(cut.token_ids[:-1]))
    assert cut.usage.completion_tokens == n and cut.usage.prompt_tokens == full.usage.prompt_tokens


def test_an_end_token_finishes_with_stop(tiny):
    processor = tiny[1]
    decoding = Decoding(processor, Sampling(), None, None, None)
    assert not decoding.step(GenerationStep(0, torch.tensor([40])))
    assert decoding.step(GenerationStep(1, torch.tensor([processor.eos_token_ids[0]])))
    assert decoding.reason == "stop"


# ---- seeds, usage and the conversation ----------------------------------------------------------------------------
def test_a_seed_reproduces_a_sampled_answer(tiny):
    model, processor, image = tiny

    def sampled(seed: int) -> tuple[int, ...]:
        return respond(model, processor, ask(image), sampling=Sampling(max_new_tokens=8, temperature=1.0,
                                                                       seed=seed)).token_ids

    assert sampled(3) == sampled(3) and sampled(3) != sampled(4)


def test_usage_states_the_visual_tokens_and_logprobs_follow_the_tokens(tiny):
    model, processor, image = tiny
    inputs = processor("<image>What is it?", images=[image])  # what ask(image) renders
    answer = respond(model, processor, ask(image), sampling=Sampling(max_new_tokens=5, logprobs=2))
    visual = int((inputs["input_ids"] == model.tokens.image_token_id).sum())
    assert visual > 0 and answer.usage.image_tokens == visual and answer.usage.video_tokens == 0
    assert answer.usage.prompt_tokens == inputs["input_ids"].shape[1] and answer.usage.completion_tokens == 5
    assert [e.token_id for e in answer.logprobs] == list(answer.token_ids)
    assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in answer.logprobs)


def test_inline_images_and_placeholders_give_the_same_answer(tiny):
    model, processor, image = tiny
    inline = respond(model, processor, ask(image), sampling=Sampling(max_new_tokens=6))
    placeholder = respond(model, processor, [{"role": "user", "content": "<image>What is it?"}], images=[image],
                          sampling=Sampling(max_new_tokens=6))
    assert inline.token_ids == placeholder.token_ids


@pytest.mark.parametrize(("messages", "error"), [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}], "must end with the user's turn"),
    ([{"role": "tool", "content": "Hi"}], "needs a role of"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"content\[0\] is not a part mmadapt reads"),
    ([], "non-empty list"),
])
def test_a_conversation_respond_cannot_take_is_refused_clearly(tiny, messages, error):
    model, processor, _ = tiny
    with pytest.raises(ValueError, match=error):
        respond(model, processor, messages)


@pytest.mark.parametrize(("settings", "error"), [
    (dict(temperature=-1.0), "temperature must be >= 0"), (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"), (dict(stop=("",)), "non-empty strings"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"), (dict(logprobs=-1), "logprobs must be"),
])
def test_sampling_settings_are_checked(settings, error):
    with pytest.raises(ValueError, match=error):
        Sampling(**settings)
    with pytest.raises(TypeError, match="sequence of strings"):
        Sampling(stop="x")
