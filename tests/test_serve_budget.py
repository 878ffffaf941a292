"""Hostile requests against a real uvicorn server (the `openai` client, raw HTTP, and the page through gradio's own
client): each is refused in under a second with a message naming the limit, the server's peak memory grows by less
than `PEAK_GROWTH` while it does, and the next ordinary request is answered.

Peak memory is the process's high-water mark (`VmHWM`), reset before each request (`/proc/self/clear_refs`), so a
refusal that decoded anything shows: one of the four 8192 x 8192 PNGs decodes to 192 MiB. The refused requests'
own bytes (a 1.2 MB body, the JSON parsed) are a few megabytes.
"""

from __future__ import annotations

import base64
import functools
import json
import socket
import struct
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from helpers import grey_clip, noise_image
from real_tokenizers import real_tokenizer

import mmadapt
from mmadapt import Processor
from mmadapt.serve import BackgroundServer, MediaPolicy, RequestBudget, ServeSettings, create_app
from mmadapt.serve.budget import DEFAULT_MAX_TEXT_CHARS
from mmadapt.serve.errors import APIError

PEAK_GROWTH = 64 * 2**20  # bytes; a decoded 8192 x 8192 image alone is 192 MiB
PROMPT = "Describe the picture."
BODY_TIMEOUT = 0.5


@functools.cache
def huge_png(side: int = 8192) -> bytes:
    """A side x side black RGB PNG (about 200 KB) written row by row: it never exists decoded in this process."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row = zlib.compressobj(9), b"\x00" * (1 + 3 * side)
    pixels = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def peak_growth(action):
    """(what `action()` returned or raised, the growth of this process's peak resident memory while it ran)."""
    def high_water() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark restarts from the current resident size
    before = high_water()
    try:
        result = action()
    except Exception as e:  # the refusal is the result
        result = e
    return result, high_water() - before


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from mmadapt.serve.page import mount_page

    root = tmp_path_factory.mktemp("budget")
    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()
    processor = Processor.for_model(model, real_tokenizer("qwen3"), chat_template="qwen3_5")
    settings = ServeSettings(name="tiny", max_queue=1, body_timeout=BODY_TIMEOUT,
                             media=MediaPolicy(allow_remote=True))
    app = create_app(model, processor, settings)
    mount_page(app, src=None)
    with BackgroundServer(app) as server:
        served = SimpleNamespace(url=server.url, service=app.state.service, root=root,
                                 png=noise_image(root / "noise.png", seed=0, size=48).read_bytes(),
                                 clip=grey_clip(root / "clip.mp4").read_bytes())
        ordinary(served)  # warm: the clients' and the model's first calls are not what the tests time
        yield served
    app.state.service.close()


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="-", max_retries=0, timeout=30)


def ordinary(served) -> str:
    """An ordinary request, answered."""
    answer = client(served).chat.completions.create(
        model="tiny", temperature=0, max_tokens=2,
        messages=[{"role": "user", "content": [image_part(data_url(served.png)), {"type": "text", "text": PROMPT}]}])
    assert answer.choices[0].finish_reason in ("stop", "length")
    return answer.choices[0].message.content


def chat(served, content: list | str, **params) -> openai.BadRequestError:
    return client(served).chat.completions.create(model="tiny", max_tokens=2,
                                                  messages=[{"role": "user", "content": content}], **params)


def raw_post(served, body: bytes, headers: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/chat/completions", content=body, headers=headers, timeout=10)


def slow_body(served) -> tuple[int, dict]:
    """Headers that promise 1000 bytes of body, then 10 bytes, then nothing: (status, error body)."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n{\"model\":".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            more = sock.recv(65536)
            if not more:
                break
            reply += more
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


ORDINARY_JSON = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}
CASES = {  # case: (the request, as a function of `served`) -> (status, code, the words the message must hold)
    "four 8192 x 8192 PNGs": (lambda s: chat(s, [image_part(data_url(huge_png())) for _ in range(4)]),
                              400, "too_many_pixels", "--max-request-pixels"),
    "65 images": (lambda s: chat(s, [image_part(data_url(s.png)) for _ in range(65)]), 400, "too_many_images",
                  "--max-images"),
    "5 videos": (lambda s: chat(s, [{"type": "video_url", "video_url": {"url": data_url(s.clip, "video/mp4")}}
                                    for _ in range(5)]), 400, "too_many_videos", "--max-videos"),
    "a long text": (lambda s: chat(s, "a" * (DEFAULT_MAX_TEXT_CHARS + 1)), 400, "text_too_long", "--max-text-chars"),
    "long stop strings": (lambda s: chat(s, PROMPT, stop=["x" * 100_000] * 4), 400, None, "stop"),
    "a text/plain body": (lambda s: raw_post(s, json.dumps(ORDINARY_JSON).encode(), {"Content-Type": "text/plain"}),
                          415, "unsupported_media_type", "application/json"),
    "a text/plain body to the page": (lambda s: httpx.post(f"{s.url}/ui/gradio_api/queue/join", content=json.dumps(
        {"data": [None], "fn_index": 0, "session_hash": "x"}).encode(), headers={"Content-Type": "text/plain"},
        timeout=10), 415, "unsupported_media_type", "application/json"),
    "a foreign Host": (lambda s: raw_post(s, json.dumps(ORDINARY_JSON).encode(), {
        "Content-Type": "application/json", "Host": "rebound.example"}), 403, "host_not_allowed", "--allowed-hosts"),
    "a foreign Origin": (lambda s: raw_post(s, json.dumps(ORDINARY_JSON).encode(), {
        "Content-Type": "application/json", "Origin": "https://evil.example"}), 403, "origin_not_allowed",
        "--allowed-hosts"),
    "a slow body": (slow_body, 408, "request_timeout", "--body-timeout"),
    "a remote URL to 127.0.0.1": (lambda s: chat(s, [image_part(f"{s.url}/health")]), 400, "invalid_image_url",
                                  "only public"),
}


def status_and_error(result) -> tuple[int, dict]:
    if isinstance(result, openai.APIStatusError):
        return result.status_code, result.response.json()["error"]
    if isinstance(result, httpx.Response):
        return result.status_code, result.json()["error"]
    if isinstance(result, tuple):
        return result[0], result[1]["error"]
    raise AssertionError(f"not refused: {result!r}")


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_request_is_refused_at_once_naming_its_limit_and_the_next_is_answered(served, case):
    request, status, code, words = CASES[case]
    huge_png()  # built before the measurement: the client's own bytes are not the server's
    start = time.monotonic()
    result, growth = peak_growth(lambda: request(served))
    took = time.monotonic() - start
    got, error = status_and_error(result)
    assert (got, error["code"] if code else None) == (status, code), error
    assert words in error["message"], error["message"]
    assert took < (BODY_TIMEOUT + 1.0 if case == "a slow body" else 1.0), f"refused after {took:.2f} s"
    assert growth < PEAK_GROWTH, f"the server's peak memory grew by {growth / 2**20:.0f} MiB"
    assert ordinary(served) is not None


def test_a_full_queue_refuses_a_costly_request_before_fetching_or_decoding_it(served):
    gate, worker = threading.Event(), served.service.worker
    busy = [worker.submit(lambda: gate.wait(30)) for _ in range(2)]  # running + one waiting: max_queue 1 is full
    try:
        start = time.monotonic()
        result, growth = peak_growth(lambda: chat(served, [image_part(data_url(huge_png()))]))
        assert isinstance(result, openai.RateLimitError) and time.monotonic() - start < 1.0
        assert growth < PEAK_GROWTH
    finally:
        gate.set()
        for job in busy:
            job.result(timeout=30)
    assert ordinary(served) is not None


def test_at_most_decode_slots_requests_decode_at_once_and_only_after_their_headers_fit(served, monkeypatch):
    import mmadapt.serve.app as app_module
    from mmadapt.serve.protocol import parse_request

    service, lock, state = served.service, threading.Lock(), {"now": 0, "most": 0, "decoded": 0}
    real = app_module.decode_image

    def decode(*args):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.1)
        with lock:
            state["now"] -= 1
            state["decoded"] += 1
        return real(*args)

    monkeypatch.setattr(app_module, "decode_image", decode)
    body = parse_request({"model": "tiny", "messages": [{"role": "user", "content": [
        image_part(data_url(served.png)), {"type": "text", "text": PROMPT}]}]})
    threads = [threading.Thread(target=service.conversation, args=(body, served.root)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert state == {"now": 0, "most": service.budget.decode_slots, "decoded": 6}
    too_big = parse_request({"model": "tiny", "messages": [{"role": "user", "content": [
        image_part(data_url(huge_png())) for _ in range(4)]}]})
    with pytest.raises(APIError, match="max-request-pixels"):
        service.conversation(too_big, served.root)
    assert state["decoded"] == 6  # refused from the headers: nothing decoded


def test_the_budget_is_the_models_data_settings_unless_a_flag_changes_it(served):
    data = served.service.processor.encoder.config
    budget = served.service.budget
    assert (budget.max_images, budget.max_pixels, budget.max_frames, budget.max_video_bytes) == (
        data.max_images, data.max_sample_pixels, data.max_sample_frames, data.max_video_bytes)
    assert RequestBudget(max_images=2, max_frames=8).resolved(data).max_images == 2
    with pytest.raises(ValueError, match="max_videos"):
        RequestBudget(max_videos=-1)


def test_a_video_over_the_frame_budget_is_refused_from_its_header(served, monkeypatch):
    import dataclasses

    monkeypatch.setattr(served.service, "budget", dataclasses.replace(served.service.budget, max_frames=1))
    result, growth = peak_growth(lambda: chat(served, [
        {"type": "video_url", "video_url": {"url": data_url(served.clip, "video/mp4")}},
        {"type": "text", "text": "What moves?"}]))
    status, error = status_and_error(result)
    assert (status, error["code"]) == (400, "too_many_frames") and "--max-frames" in error["message"]
    assert growth < PEAK_GROWTH and ordinary(served) is not None


def test_seventy_images_on_the_page_are_refused_with_the_limit_and_the_next_turn_is_answered(served):
    from gradio_client import Client, handle_file

    folder = served.root / "uploads"
    folder.mkdir(exist_ok=True)
    files = []
    for k in range(70):
        (folder / f"image-{k}.png").write_bytes(served.png)
        files.append(handle_file(str(folder / f"image-{k}.png")))
    page = Client(f"{served.url}/ui/", verbose=False)
    try:
        greedy = (4, 0.0, 1.0, 0, 1.0)  # the sampling controls: max new tokens, temperature, top p, seed, penalty
        job = page.submit({"text": PROMPT, "files": files}, [], *greedy, api_name="/call")
        shown = job.result(timeout=120)[0]
        updates = []
        while not job.communicator.updates.empty():
            updates.append(job.communicator.updates.get_nowait())
        said = [u.log[0] for u in updates if getattr(u, "log", None)]
        assert shown == [] and len(said) == 1 and "70 images" in said[0] and "--max-images" in said[0], said
        times = [u.time for u in updates if getattr(u, "time", None) is not None]
        assert (max(times) - min(times)).total_seconds() < 1.0  # the event, from its place in the queue to its end
        answered = page.predict({"text": PROMPT, "files": files[:1]}, [], *greedy, api_name="/call")[0]
        assert [m["role"] for m in answered] == ["user", "assistant"]
    finally:
        page.close()


def test_a_closed_page_forgets_its_conversation_and_removes_its_uploads(served):
    from mmadapt.serve.page import Page

    folder = served.root / "page-uploads"
    folder.mkdir()
    upload = folder / "photo.png"
    upload.write_bytes(served.png)
    page = Page(served.service, SimpleNamespace(name="tiny"), [], upload_folders=[folder])
    page.say = lambda text: None
    who = SimpleNamespace(session_hash="closing")
    steps = list(page.send({"text": PROMPT, "files": [str(upload)]}, [], 2, 0.0, 1.0, 0, 1.0, request=who))
    assert steps[-1][0][-1]["role"] == "assistant"
    held = page.session(who).chat.turns[0].images[0]
    assert type(held).__name__ == "EmbeddedImage"  # kept encoded, never decoded pixels
    page.end(who)
    assert not upload.exists() and "closing" not in page.sessions
    assert Path(served.root).exists()


def test_half_sent_request_heads_are_closed_after_the_header_timeout(served):
    def receive_answer(sock) -> bytes:
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        head, _, body = reply.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
        return head

    settings = ServeSettings(name="tiny", header_timeout=1.0, max_connections=6)
    app = create_app(served.service.model, served.service.processor, settings)
    try:
        with BackgroundServer(app) as server:
            address = server.host, server.port
            health = f"GET /health HTTP/1.1\r\nHost: {server.host}\r\n".encode()
            held = [socket.create_connection(address, timeout=10) for _ in range(4)]
            for sock in held[:3]:
                sock.sendall(health + b"X-Slow: ")  # half a head; the fourth sends nothing at all
            kept = socket.create_connection(address, timeout=10)  # a keep-alive connection, then half a head
            kept.sendall(health + b"\r\n")
            assert b" 200 " in receive_answer(kept).split(b"\r\n")[0]
            kept.sendall(health)
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503  # full: 5 held, and this one
            start = time.monotonic()
            for sock in [*held, kept]:
                assert sock.recv(1) == b""  # closed by the server
                sock.close()
            assert time.monotonic() - start < 1.5  # 1 s from each connection's start (or its last answer)
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            slow = socket.create_connection(address, timeout=10)  # a whole head in time, in pieces, is answered
            slow.sendall(health[:10])
            time.sleep(0.5)
            slow.sendall(health[10:] + b"\r\n")
            assert b" 200 " in receive_answer(slow).split(b"\r\n")[0]
            slow.close()
    finally:
        app.state.service.close()
    with pytest.raises(ValueError, match="header_timeout must be > 0"):
        ServeSettings(header_timeout=0)


def test_a_client_that_leaves_mid_body_is_one_log_line_and_errors_name_no_server_path(served, caplog):
    import logging

    host, port = served.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO, logger="mmadapt.serve"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: "
                         "application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while not any("went away" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
    records = [r for r in caplog.records if r.name.startswith("mmadapt.serve")]
    assert [r.levelname for r in records] == ["INFO"] and records[0].exc_info is None
    assert "went away" in records[0].getMessage()

    not_a_video = data_url(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, "video/mp4")
    broken, _ = peak_growth(lambda: chat(served, [{"type": "video_url", "video_url": {"url": not_a_video}}]))
    status, error = status_and_error(broken)
    assert status == 400 and "/tmp" not in error["message"] and "mmadapt-serve-" not in error["message"], error
    assert ordinary(served) is not None


def test_docs_serving_lists_every_limit_and_flag_of_mmadapt_serve():
    import argparse

    from mmadapt.cli import build_parser
    from mmadapt.serve.budget import FLAGS

    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {option for action in serve._actions for option in action.option_strings if option.startswith("--")}
    text = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    missing = sorted(f for f in flags - {"--help"} if f"`{f}" not in text)
    assert not missing, f"docs/serving.md does not list {missing}"
    assert all(f"`{flag}`" in text for flag, _ in FLAGS.values())
