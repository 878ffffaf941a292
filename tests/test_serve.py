"""`mmadapt serve` through the official `openai` client against a real uvicorn server on 127.0.0.1 (a free port, on a
thread, stopped at the end): a tiny Qwen3.5 model saved with Qwen's real tokenizer and its template answers as `mmadapt
chat` does, token for token; the parameters behave as OpenAI documents; every refusal has OpenAI's error shape and the
server goes on answering; a full queue is a 429; a client that leaves mid-stream frees the model."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.server
import socket
import threading
import time
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
from mmadapt.cli import main
from mmadapt.inference import Chat
from mmadapt.serve import BackgroundServer, MediaPolicy, ServeSettings, load_app
from mmadapt.serve.errors import APIError
from mmadapt.serve.media import load_image_url

KEY = "test-key"
PROMPT = "Describe the picture."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()
    tokenizer = real_tokenizer("qwen3")
    Processor.for_model(model, tokenizer, chat_template="qwen3_5")  # Qwen3.5's official template, thinking on
    model.save_pretrained(root / "model", tokenizer=tokenizer)
    images = root / "images"
    images.mkdir()
    (images / "link.png").symlink_to(noise_image(root / "outside.png", seed=1))
    settings = ServeSettings(name="tiny", api_key=KEY, media=MediaPolicy(image_root=images), max_queue=1)
    app = load_app(root / "model", settings=settings)
    with BackgroundServer(app) as server:
        yield SimpleNamespace(url=server.url, service=app.state.service, model_dir=root / "model", root=root,
                              png=noise_image(images / "noise.png", seed=0, size=48))


def client(served, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=60)


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def question(url: str, text: str = PROMPT) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def create(served, messages=None, **params):
    params = {"temperature": 0, "max_tokens": 2, **params}
    return client(served).chat.completions.create(model="tiny", messages=messages or question(
        data_url(served.png.read_bytes())), **params)


def health(served) -> dict:
    return httpx.get(f"{served.url}/health", timeout=10).json()


# ---- the answer ----------------------------------------------------------------------------------------------------
def test_whole_and_streamed_answers_equal_mmadapt_chat_token_for_token(served, capsys, monkeypatch):
    chats = []

    def load(src, adapters=None, *, sampling):  # `mmadapt chat`'s own code, on the model the server loaded
        assert Path(src) == served.model_dir and adapters is None
        chats.append(Chat(served.service.model, served.service.processor, sampling=sampling))
        return chats[-1]

    monkeypatch.setattr(Chat, "load", load)
    assert main(["chat", str(served.model_dir), "--image", str(served.png), "--max-new-tokens", "12",
                 f"<image>{PROMPT}"]) == 0
    printed = capsys.readouterr().out
    expected = chats[0].last
    assert expected.text + "\n" == printed
    assert len(expected.token_ids) == 12 and expected.usage.image_tokens > 0

    whole = create(served, max_tokens=12, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.message.content + "\n" == printed and choice.token_ids == list(expected.token_ids)
    assert choice.finish_reason == "length" and choice.logprobs is None and whole.model == "tiny"
    usage = whole.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        expected.usage.prompt_tokens, 12, expected.usage.prompt_tokens + 12)
    assert usage.prompt_tokens_details.image_tokens == expected.usage.image_tokens

    chunks = list(create(served, max_tokens=12, stream=True, stream_options={"include_usage": True},
                         extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == usage.model_dump()
    body = [c.choices[0] for c in chunks[:-1]]
    assert "".join(c.delta.content or "" for c in body) + "\n" == printed
    assert [t for c in body for t in (c.token_ids or [])] == list(expected.token_ids)
    assert body[-1].finish_reason == "length" and all(c.finish_reason is None for c in body[:-1])
    assert len({c.id for c in chunks}) == 1 and all(c.usage is None for c in chunks[:-1])


def test_an_image_under_the_image_root_answers_as_its_data_url(served):
    by_url = create(served, max_tokens=4, extra_body={"return_token_ids": True})
    for path in ("noise.png", f"file://{served.png}"):
        by_path = create(served, question(path), max_tokens=4, extra_body={"return_token_ids": True})
        assert by_path.choices[0].token_ids == by_url.choices[0].token_ids


def test_max_tokens_stop_logprobs_and_seed_behave_as_openai_documents(served):
    assert create(served, max_tokens=5).usage.completion_tokens == 5
    assert create(served, max_completion_tokens=3, max_tokens=None).usage.completion_tokens == 3

    full = create(served, max_tokens=12).choices[0].message.content
    start, stop = next((k, full[k:k + n]) for n in (2, 1) for k in range(1, len(full) - n)  # first seen at k, whole
                       if full.find(full[k:k + n]) == k and "\ufffd" not in full[k:k + n])
    stop = [stop, "never there"]
    cut = create(served, max_tokens=12, stop=stop)
    assert cut.choices[0].message.content == full[:start] and cut.choices[0].finish_reason == "stop"
    streamed = list(create(served, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[:start]
    assert streamed[-1].choices[0].finish_reason == "stop"

    scored = create(served, max_tokens=6, logprobs=True, top_logprobs=3)
    entries = scored.choices[0].logprobs.content
    assert len(entries) == scored.usage.completion_tokens == 6 and scored.choices[0].finish_reason == "length"
    for entry in entries:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, tops[0])  # greedy takes the likeliest
    text = bytes(b for entry in entries for b in entry.bytes).decode("utf-8", errors="replace")
    assert text.strip() == scored.choices[0].message.content  # the tokens' bytes make the answer

    def sampled(seed: int) -> list[int]:
        answer = create(served, max_tokens=8, temperature=1.0, seed=seed, extra_body={"return_token_ids": True})
        return answer.choices[0].token_ids

    assert sampled(11) == sampled(11) and sampled(11) != sampled(12)


def test_a_video_url_reaches_a_qwen_model(served, tmp_path):
    path = grey_clip(tmp_path / "clip.mp4")
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(
        path.read_bytes(), "video/mp4")}}, {"type": "text", "text": "What moves?"}]}]
    answer = create(served, messages)
    details = answer.usage.prompt_tokens_details
    assert details.video_tokens > 0 and details.image_tokens == 0 and answer.usage.completion_tokens == 2


# ---- refusals ------------------------------------------------------------------------------------------------------
def refusals(served) -> dict:
    png = served.png.read_bytes()
    return {  # case: (request, expected exception, status, code)
        "not an image": (dict(messages=question(data_url(b"GIF? no: plain text"))), openai.BadRequestError, 400,
                         "invalid_image_format"),
        "truncated image": (dict(messages=question(data_url(png[: len(png) // 2]))), openai.BadRequestError, 400,
                            "invalid_image"),
        "path outside the root": (dict(messages=question("../outside.png")), openai.BadRequestError, 400,
                                  "path_outside_root"),
        "symlink out of the root": (dict(messages=question("link.png")), openai.BadRequestError, 400,
                                    "path_outside_root"),
        "http url": (dict(messages=question("http://127.0.0.1:9/cat.png")), openai.BadRequestError, 400,
                     "remote_media_disabled"),
        "unsupported parameter": (dict(tools=[{"type": "function", "function": {"name": "f"}}]),
                                  openai.BadRequestError, 400, "unsupported_parameter"),
        "unimplemented penalty": (dict(frequency_penalty=0.5), openai.BadRequestError, 400, "unsupported_parameter"),
        "n > 1": (dict(n=2), openai.BadRequestError, 400, "invalid_value"),
        "placeholder text": (dict(messages=[{"role": "user", "content": "<|image_pad|> hi"}]), openai.BadRequestError,
                             400, "placeholder_in_text"),
        "unknown model": (dict(model="gpt-4o"), openai.NotFoundError, 404, "model_not_found"),
        "wrong key": (dict(api_key="wrong"), openai.AuthenticationError, 401, "invalid_api_key"),
    }


@pytest.mark.parametrize("case", ["not an image", "truncated image", "path outside the root",
                                  "symlink out of the root", "http url", "unsupported parameter",
                                  "unimplemented penalty", "n > 1", "placeholder text", "unknown model", "wrong key"])
def test_a_refused_request_gets_openais_error_shape_and_the_server_answers_the_next(served, case):
    request, error, status, code = refusals(served)[case]
    request = {"model": "tiny", "messages": question(data_url(served.png.read_bytes())), "max_tokens": 2, **request}
    api = client(served, request.pop("api_key", KEY))
    with pytest.raises(error) as raised:
        api.chat.completions.create(**request)
    body = raised.value.response.json()["error"]
    assert raised.value.status_code == status and body["code"] == code and body["message"]
    assert set(body) == {"message", "type", "param", "code"}
    assert create(served).choices[0].message.content is not None  # the next request is answered


def test_a_full_queue_answers_429_with_retry_after_then_serves_again(served):
    gate, worker = threading.Event(), served.service.worker
    busy = [worker.submit(lambda: gate.wait(30)) for _ in range(2)]  # a long generation and one waiting (max_queue 1)
    try:
        with pytest.raises(openai.RateLimitError) as raised:
            create(served)
        assert int(raised.value.response.headers["retry-after"]) >= 1
        assert raised.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        assert health(served)["waiting"] == 1
    finally:
        gate.set()
        for job in busy:
            job.result(timeout=30)
    assert create(served).usage.completion_tokens == 2


def test_a_client_that_disconnects_mid_stream_frees_the_model(served):
    before = health(served)["cancelled"]
    stream = create(served, max_tokens=4000, stream=True)  # minutes of generation if nobody stopped it
    pieces = [next(stream) for _ in range(3)]
    assert pieces[0].choices[0].delta.role == "assistant"
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 20
    while (state := health(served))["running"] or state["waiting"]:
        assert time.monotonic() < deadline, f"the model is still busy 20 s after the client left: {state}"
        time.sleep(0.1)
    assert state["cancelled"] == before + 1
    assert create(served).usage.completion_tokens == 2


# ---- the rest of the surface ---------------------------------------------------------------------------------------
def test_models_and_health(served):
    assert [m.id for m in client(served).models.list().data] == ["tiny"]
    assert client(served).models.retrieve("tiny").owned_by == "mmadapt"
    assert health(served)["status"] == "ok" and health(served)["model"] == "tiny"
    missing = httpx.get(f"{served.url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_remote_images_load_only_when_allowed(served):
    png = served.png.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server calls it by this name
            if self.path == "/moved":  # a redirect to the cloud metadata address: checked again, refused
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/latest/meta-data")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/noise.png"
    internal = MediaPolicy(allow_remote=True, remote_networks=("127.0.0.0/8",))  # an image store the operator names
    try:
        image = load_image_url(url, internal, "p")
        assert image.size == (48, 48) and image.tobytes() == load_image_url(data_url(png), MediaPolicy(), "p").tobytes()
        with pytest.raises(APIError, match="over the limit"):
            load_image_url(url, dataclasses.replace(internal, max_image_bytes=100), "p")
        with pytest.raises(APIError, match="remote image URLs are off"):
            load_image_url(url, MediaPolicy(), "p")
        with pytest.raises(APIError, match="only public"):
            load_image_url(url.replace("noise.png", "moved"), internal, "p")
        for refused in (url, f"http://localhost:{server.server_address[1]}/x.png", "http://127.0.0.1:9/closed.png",
                        "http://[::1]:9/x.png", "http://10.0.0.1:9/x.png", "http://169.254.169.254/latest/meta-data"):
            start = time.monotonic()
            with pytest.raises(APIError) as raised:  # loopback, private, link-local: never connected to
                load_image_url(refused, MediaPolicy(allow_remote=True), "p")
            assert time.monotonic() - start < 1.0
            assert raised.value.message == ("could not fetch the image at that URL: this server fetches only public "
                                            "http(s) addresses, within 10 s in total (connecting, headers and body; "
                                            "--remote-timeout)")  # one message: no port scanner
    finally:
        server.shutdown()


@contextlib.contextmanager
def local_server(respond):
    """An http server on 127.0.0.1 in a thread whose GETs `respond(handler)` answers; yields its base URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server calls it by this name
            with contextlib.suppress(OSError):  # the fetcher cut the connection
                respond(self)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_redirect_to_another_scheme_is_refused_as_the_same_address_over_http_is(tmp_path):
    listener = socket.create_server(("127.0.0.2", 0))  # what an ftp: redirect would reach: nothing may connect
    listener.settimeout(0.5)
    target = f"127.0.0.2:{listener.getsockname()[1]}"
    png = noise_image(tmp_path / "noise.png", seed=0).read_bytes()
    locations = {"/ftp": f"ftp://{target}/x", "/file": "file:///etc/passwd", "/data": data_url(png),
                 "/http": f"http://{target}/x", "/relative": "/noise.png"}

    def respond(handler):
        if handler.path in locations:
            handler.send_response(302)
            handler.send_header("Location", locations[handler.path])
            handler.end_headers()
        else:
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(png)))
            handler.end_headers()
            handler.wfile.write(png)

    only_this_host = MediaPolicy(allow_remote=True, remote_networks=("127.0.0.1/32",))
    with local_server(respond) as url, listener:
        assert load_image_url(f"{url}/relative", only_this_host, "p").size == (32, 32)  # http redirects are followed
        for path, scheme in (("/ftp", "ftp"), ("/file", "file"), ("/data", "data")):
            with pytest.raises(APIError, match=f"redirects to a {scheme}: URL; this server fetches http"):
                load_image_url(f"{url}{path}", only_this_host, "p")
        with pytest.raises(APIError, match="fetches only public http"):
            load_image_url(f"{url}/http", only_this_host, "p")
        with pytest.raises(TimeoutError):
            listener.accept()


def test_a_slow_server_is_cut_at_the_total_deadline(tmp_path):
    png = noise_image(tmp_path / "noise.png", seed=0).read_bytes()

    def respond(handler):
        if handler.path == "/slow-head":  # a header line every 0.2 s
            handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for _ in range(50):
                handler.wfile.write(b"X-Padding: 1\r\n")
                time.sleep(0.2)
            return
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(png)))
        handler.end_headers()
        if handler.path == "/slow-body":  # a byte every 0.2 s
            for k in range(len(png)):
                handler.wfile.write(png[k:k + 1])
                time.sleep(0.2)
        else:
            handler.wfile.write(png)

    policy = MediaPolicy(allow_remote=True, remote_networks=("127.0.0.0/8",), remote_timeout=1.0)
    with pytest.raises(ValueError, match="remote_timeout must be > 0"):
        MediaPolicy(remote_timeout=0)
    with local_server(respond) as url:
        for path in ("/slow-body", "/slow-head"):
            start = time.monotonic()
            with pytest.raises(APIError, match=r"within 1 s in total \(connecting, headers and body"):
                load_image_url(f"{url}{path}", policy, "p")
            assert 0.9 < time.monotonic() - start < 2.0, path  # each read was short; their sum is what is bounded
        assert load_image_url(f"{url}/fast.png", policy, "p").size == (32, 32)


def test_mmadapt_serve_builds_its_settings_from_the_command_line(served, monkeypatch):
    import mmadapt.serve as serve

    seen = {}
    monkeypatch.setattr(serve, "load_app", lambda src, adapters, *, settings, device: seen.update(
        src=src, settings=settings) or "app")
    monkeypatch.setattr(serve, "run", lambda app, **options: seen.update(app=app, **options))
    monkeypatch.setenv("MMADAPT_API_KEY", "from-env")
    images = str(Path(served.png).parent)
    assert main(["serve", str(served.model_dir), "--image-root", images, "--port", "8123", "--max-queue", "3"]) == 0
    settings = seen["settings"]
    assert (seen["app"], seen["host"], seen["port"]) == ("app", "127.0.0.1", 8123)
    assert (settings.name, settings.api_key, settings.max_queue) == ("model", "from-env", 3)
    assert settings.media.image_root == Path(images) and not settings.media.allow_remote
    assert (settings.header_timeout, settings.media.remote_timeout) == (10.0, 10.0)  # the defaults the docs state

    assert main(["serve", str(served.model_dir), "--header-timeout", "2.5", "--remote-timeout", "4"]) == 0
    assert (seen["settings"].header_timeout, seen["settings"].media.remote_timeout) == (2.5, 4.0)
