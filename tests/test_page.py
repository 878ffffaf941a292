"""`mmadapt serve --ui`'s page, without a browser: its handlers on a tiny model (streaming, the conversation, stop,
the queue, bad uploads, the evidence view, the model card, the examples). The page in a real browser:
tests/test_page_browser.py."""

from __future__ import annotations

import io
import json
import struct
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import grey_clip, noise_image, write_jsonl
from PIL import Image
from real_tokenizers import real_tokenizer

pytest.importorskip("gradio")

import itertools

import mmadapt
from mmadapt import Processor
from mmadapt.evidence import explain
from mmadapt.inference import Chat, Sampling
from mmadapt.serve import ServeSettings, create_app
from mmadapt.serve.card import ModelCard
from mmadapt.serve.examples import Example, examples_from
from mmadapt.serve.page import AUTO, Page

PROMPT = "Describe the picture."
GREEDY = (12, 0.0, 1.0, 0, 1.0)  # max new tokens, temperature, top p, seed, repetition penalty: the page's controls


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("page")
    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()
    processor = Processor.for_model(model, real_tokenizer("qwen3"), chat_template="qwen3_5")
    app = create_app(model, processor, ServeSettings(name="tiny", max_queue=1))
    service = app.state.service
    examples = [Example(f"noise-{k}", noise_image(root / f"example-{k}.png", seed=10 + k, size=64), PROMPT)
                for k in range(2)]
    page = Page(service, ModelCard.read(None, model, processor, name="tiny"), examples, upload_folders=[root])
    said: list[str] = []
    page.say = said.append  # the page's toasts, read by the tests
    yield SimpleNamespace(root=root, model=model, processor=processor, service=service, page=page, said=said,
                          png=str(noise_image(root / "noise.png", seed=0, size=64)))
    service.close()


def request(name: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=name)


def chat_answer(tiny, *turns: tuple[str, list]) -> list[str]:
    """`mmadapt chat`'s answers (`Chat.ask`, greedy, 12 new tokens) to `turns` of (text, images)."""
    chat = Chat(tiny.model, tiny.processor, sampling=Sampling(max_new_tokens=12))
    return [chat.ask(text, images=images) for text, images in turns]


def last_answer(yielded: tuple) -> str:
    return yielded[0][-1]["content"]


def test_the_page_streams_the_answer_mmadapt_chat_gives_and_keeps_the_conversation(tiny):
    page, who = tiny.page, request("stream")
    steps = list(page.send({"text": PROMPT, "files": [tiny.png]}, [], *GREEDY, request=who))
    expected = chat_answer(tiny, (PROMPT, [tiny.png]), ("And the colours?", []))
    pieces = [last_answer(s) for s in steps[1:-1]]  # after the placeholder, before the final message
    assert len(pieces) >= 3 and all(b.startswith(a) for a, b in itertools.pairwise(pieces))
    assert last_answer(steps[-1]) == expected[0] and "12 tokens, cut at max new tokens" in steps[-1][2]
    shown = steps[-1][0]
    assert [m["role"] for m in shown] == ["user", "assistant"] and shown[0]["content"][-1] == PROMPT

    second = list(page.send({"text": "And the colours?", "files": []}, shown, *GREEDY, request=who))
    assert last_answer(second[-1]) == expected[1]  # the second turn sees the first turn's image and answer
    again = list(page.regenerate(second[-1][0], *GREEDY, request=who))
    assert last_answer(again[-1]) == expected[1] and len(again[-1][0]) == 4  # greedy: the same, in place

    other = list(page.send({"text": PROMPT, "files": [tiny.png]}, [], *GREEDY, request=request("another page")))
    assert last_answer(other[-1]) == expected[0]  # each page has its own conversation
    before = page.session(who).chat
    page.clear(who)
    assert page.session(who).chat.turns == [] and len(before.turns) == 4  # a new conversation; the old one intact


def test_a_video_reaches_a_qwen_model_through_the_page(tiny):
    path = grey_clip(tiny.root / "clip.mp4")
    steps = list(tiny.page.send({"text": "What moves?", "files": [str(path)]}, [], *GREEDY, request=request("video")))
    chat = Chat(tiny.model, tiny.processor, sampling=Sampling(max_new_tokens=12))
    assert last_answer(steps[-1]) == chat.ask("What moves?", videos=[str(path)])
    assert chat.last.usage.video_tokens > 0 and "of them visual" in steps[-1][2]


def test_stop_ends_the_answer_where_it_is_and_frees_the_model(tiny):
    page, who = tiny.page, request("stop")
    steps = []
    for step in page.send({"text": PROMPT, "files": [tiny.png]}, [], 64, 0.0, 1.0, 0, 1.0, request=who):
        steps.append(step)
        if len(steps) == 3:
            page.stop(who)  # the Stop button, while the answer streams
    assert "stopped" in steps[-1][2] and page.session(who).chat.last.finish_reason == "cancelled"
    assert page.session(who).chat.last.usage.completion_tokens < 64
    assert tiny.service.worker.state()["running"] == 0
    after = list(page.send({"text": PROMPT, "files": [tiny.png]}, [], *GREEDY, request=request("after stop")))
    assert last_answer(after[-1]) == chat_answer(tiny, (PROMPT, [tiny.png]))[0]


def test_while_the_model_answers_another_request_the_page_says_it_waits(tiny):
    release = threading.Event()
    busy = tiny.service.worker.submit(lambda: release.wait(30))  # an API request holding the model
    steps = tiny.page.send({"text": PROMPT, "files": [tiny.png]}, [], *GREEDY, request=request("wait"))
    shown = [next(steps) for _ in range(3)]
    assert any("waiting for the model" in last_answer(s) for s in shown)
    release.set()
    busy.result(timeout=30)
    final = list(steps)[-1]
    assert last_answer(final) == chat_answer(tiny, (PROMPT, [tiny.png]))[0]


def png_bomb(path: Path, side: int = 30_000) -> Path:
    """A tiny PNG whose header claims side x side pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                     + chunk(b"IEND", b""))
    return path


def test_a_bad_upload_is_a_message_the_conversation_is_unchanged_and_the_next_question_works(tiny, tmp_path):
    page, who, said = tiny.page, request("bad"), tiny.said
    text_file = tiny.root / "notes.png"
    text_file.write_text("not an image at all")
    large = tiny.root / "large.png"
    large.write_bytes(Path(tiny.png).read_bytes() + b"\0" * tiny.service.media.max_image_bytes)  # over by the PNG
    cases = {text_file: "not a PNG, JPEG, WebP or GIF image", png_bomb(tiny.root / "bomb.png"): "image_too_large",
             large: "over the server's limit",
             noise_image(tmp_path / "outside.png"): "not a file uploaded to this page"}
    for bad, message in cases.items():
        said.clear()
        (step,) = list(page.send({"text": PROMPT, "files": [str(bad), tiny.png]}, [], *GREEDY, request=who))
        assert len(said) == 1 and message in said[0] and bad.name in said[0], said
        assert step[0] == [] and step[1]["value"] == {"text": PROMPT, "files": [tiny.png]}  # the good file stays
    said.clear()
    (step,) = list(page.send({"text": "what is <|image_pad|> here?", "files": [tiny.png]}, [], *GREEDY,
                             request=who))
    assert "reads as visual input" in said[0] and step[0] == []
    assert page.session(who).chat.turns == []
    answered = list(page.send({"text": PROMPT, "files": [tiny.png]}, [], *GREEDY, request=who))
    assert last_answer(answered[-1]) == chat_answer(tiny, (PROMPT, [tiny.png]))[0]


def bloated_png(path: Path, seed: int, padding: int = 2 * 2**20) -> str:
    """A 16 x 16 noise PNG padded with `padding` bytes in a private ancillary chunk (decoders skip it)."""
    data = noise_image(path, seed=seed, size=16).read_bytes()
    pad = bytes(padding)
    chunk = struct.pack(">I", len(pad)) + b"prVt" + pad + struct.pack(">I", zlib.crc32(b"prVt" + pad))
    path.write_bytes(data[:-12] + chunk + data[-12:])  # before IEND, the last 12 bytes
    return str(path)


def test_a_conversation_keeps_its_images_within_a_decoded_size_bound_and_the_page_a_bounded_number(tiny, tmp_path):
    from mmadapt.serve.page import PageLimits

    limits = PageLimits(sessions=2, session_bytes=4 * 1024)  # four 16 x 16 images (768 bytes each, decoded)
    page = Page(tiny.service, ModelCard.read(None, tiny.model, tiny.processor, name="tiny"), [],
                upload_folders=[tmp_path], limits=limits)
    said: list[str] = []
    page.say = said.append
    who, history = request("bloated"), []
    uploads = [bloated_png(tmp_path / f"bloated-{k}.png", seed=k) for k in range(8)]  # 2 MiB each
    for upload in uploads:
        steps = list(page.send({"text": PROMPT, "files": [upload]}, history, 1, 0.0, 1.0, 0, 1.0, request=who))
        history = steps[-1][0]
        assert page.session(who).held_bytes() <= limits.session_bytes
    kept = [image for turn in page.session(who).chat.turns for image in turn.images]
    assert len(kept) == 4 and len(said) == 4 and all("--page-session-bytes" in s for s in said), said
    for image, upload in zip(kept, uploads, strict=False):  # the same pixels, in their own few hundred bytes
        assert len(image.data) < 1024 and np.array_equal(np.asarray(Image.open(io.BytesIO(image.data))),
                                                         np.asarray(Image.open(upload).convert("RGB")))
    with pytest.raises(ValueError, match="session_bytes must be >= 1"):
        PageLimits(session_bytes=0)

    for other in ("second", "third"):  # the least recently used conversation is forgotten, its uploads removed
        list(page.send({"text": PROMPT, "files": []}, [], 1, 0.0, 1.0, 0, 1.0, request=request(other)))
    assert list(page.sessions) == ["second", "third"]
    assert not any(Path(upload).exists() for upload in uploads[:4])


def test_the_evidence_view_explains_the_answer_shown_and_says_what_the_model_answers_without_the_image(tiny):
    page, who = tiny.page, request("evidence")
    list(page.send({"text": PROMPT, "files": [tiny.png]}, [], 4, 0.0, 1.0, 0, 1.0, request=who))
    shown = []  # the progress bar: (fraction, what is running)
    steps = page.evidence("occlusion", 8, AUTO, request=who, progress=lambda done, desc: shown.append((done, desc)))
    *_, (picture, words, _cancel) = list(steps)
    fractions = [f for f, desc in shown if desc.startswith(("map:", "faithfulness:", "image effect:"))]
    assert len(fractions) >= 3 and fractions == sorted(fractions) and 0 <= fractions[0] and fractions[-1] <= 1
    assert picture.size[0] > 600 and "Answer explained" in words and "Image effect" in words
    assert "image blanked" in words and "another image (noise-0)" in words
    assert ("Trusted map" in words) or ("Do not" in words)

    # the map is `mmadapt explain`'s for the same conversation and answer
    chat = page.session(who).chat
    messages, images, _ = chat.prompt()
    given = explain(tiny.model, tiny.processor, images[0], messages, answer_ids=chat.last.token_ids, curve_steps=0)
    greedy = explain(tiny.model, tiny.processor, tiny.png, PROMPT, max_new_tokens=4, curve_steps=0)
    assert given.answer_ids == greedy.answer_ids
    torch.testing.assert_close(given.map.scores, greedy.map.scores, rtol=0, atol=0)


def test_the_evidence_can_be_cancelled_and_refuses_what_it_cannot_map(tiny):
    import gradio as gr

    page, who = tiny.page, request("cancel")
    with pytest.raises(gr.Error, match="Ask a question about an image first"):
        list(page.evidence("occlusion", 4, AUTO, request=who))
    list(page.send({"text": PROMPT, "files": [tiny.png]}, [], 4, 0.0, 1.0, 0, 1.0, request=who))
    steps = page.evidence("occlusion", 8, AUTO, request=who)
    assert next(steps)[1] == "Working…"
    page.stop(who)  # the Cancel button: the work stops at its next batch of forwards
    assert list(steps)[-1][1] == "Cancelled: no map was drawn."
    assert tiny.service.worker.state()["running"] == 0

    list(page.send({"text": "and this one?", "files": [tiny.png]}, page_history(page, who), 4, 0.0, 1.0, 0, 1.0,
                   request=who))
    with pytest.raises(gr.Error, match="this conversation has 2 image"):
        list(page.evidence("occlusion", 4, AUTO, request=who))


def page_history(page: Page, who: SimpleNamespace) -> list[dict]:
    return [{"role": t.role, "content": t.content} for t in page.session(who).chat.turns]


def test_the_model_card_names_parts_provenance_template_and_the_runs_final_numbers(tiny, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000010").mkdir(parents=True)
    (run / "checkpoints" / "step-0000010" / "COMPLETE").write_text("")
    (run / "checkpoints" / "step-0000020").mkdir()
    write_jsonl(run / "log.jsonl", [{"step": 5, "loss": 2.0}, {"step": 10, "eval_loss": 1.5},
                                    {"step": 20, "eval_loss": 1.25, "lmms/mme/score": 0.5}])
    (run / "log.jsonl").open("a").write('{"step": 21, "lo')  # a line being written
    (run / "report.json").write_text(json.dumps({"accuracy_images": 0.9, "accuracy_blank": 0.1, "steps": 20}))
    (run / "config.yaml").write_text("model:\n  encoder: qwen3_5_vit\n  projector: qwen_merger\n"
                                     "  backbone: {name: qwen3_5, preset: small}\n  preset: tiny\n")
    processor = Processor.for_model(tiny.model, tiny.processor.tokenizer, chat_template="qwen3_5",
                                    template_kwargs={"enable_thinking": False})
    card = ModelCard.read(run / "model", tiny.model, processor, name="tiny")
    text = card.markdown()
    assert [(c["name"], c["preset"]) for c in card.components] == [
        ("qwen3_5_vit", "tiny"), ("qwen_merger", None), ("qwen3_5", "small")]  # as the run's config named them
    assert all(c["parameters"] > 0 and c["started_from"] == "random initialisation" for c in card.components)
    assert card.checkpoints == [{"name": "step-0000010", "step": 10, "complete": True},
                                {"name": "step-0000020", "step": 20, "complete": False}]
    assert card.evaluation == {"log.jsonl, step 20": {"eval_loss": 1.25, "lmms/mme/score": 0.5},
                               "report.json (held-out answers: real / blanked / shuffled images)":
                                   {"accuracy_real": 0.9, "accuracy_blanked": 0.1}}  # an older report's keys, renamed
    assert card.chat_template == "qwen3_5" and '{"enable_thinking": false}' in text
    assert "incomplete" in text and "eval_loss 1.25" in text
    prompt = card.example_prompt  # a 64 px image: 8 x 8 patches of 8 px, merged 2 x 2 -> 16 visual tokens
    assert "<|vision_start|><|image_pad|> x 16<|vision_end|>" in prompt and "<think>\n\n</think>" in prompt


def test_examples_come_from_single_image_questions_copied_into_the_pages_directory(tmp_path):
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    noise_image(data / "images" / "a.png", seed=1)
    records = [{"id": "two", "images": ["images/a.png", "images/a.png"], "conversations": [
                   {"from": "human", "value": "<image><image>\nCompare."}, {"from": "gpt", "value": "same"}]},
               {"id": "missing", "image": "images/none.png", "conversations": [
                   {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "x"}]},
               {"id": "good", "image": "images/a.png", "conversations": [
                   {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "red"}]}]
    out = tmp_path / "examples"
    out.mkdir()
    (found,) = examples_from(write_jsonl(data / "eval.jsonl", records), out)
    assert found.name == "good" and found.question == "What colour?" and found.image == out / "example-0.png"
    with Image.open(found.image) as copy, Image.open(data / "images" / "a.png") as original:
        assert np.array_equal(np.asarray(copy), np.asarray(original))  # decoded and written again by the page


def test_a_server_with_an_api_key_asks_for_it_on_the_page(tiny):
    import httpx

    from mmadapt.serve import BackgroundServer
    from mmadapt.serve.page import mount_page

    app = create_app(tiny.model, tiny.processor, ServeSettings(name="tiny", api_key="secret"))
    mount_page(app, src=None)
    with BackgroundServer(app) as server, httpx.Client(base_url=f"{server.url}/ui", timeout=30) as client:
        assert client.get("/config").status_code == 401  # the page's events and files need the login
        assert client.post("/login", data={"username": "colleague", "password": "wrong"}).status_code == 400
        assert client.post("/login", data={"username": "colleague", "password": "secret"}).status_code == 200
        config = client.get("/config")
        assert config.status_code == 200 and "Model card" in config.text
    app.state.service.close()
