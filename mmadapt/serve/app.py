"""`create_app(model, processor, settings)`: the OpenAI-compatible API as a FastAPI app (testable without a socket).

    GET  /health                 {"status": "ok", "model", "running", "waiting", "max_queue", "answered", ...} (no key)
    GET  /v1/models              the one served model (`settings.name`)
    GET  /v1/models/{name}
    POST /v1/chat/completions    a conversation with images / videos -> one answer, whole or streamed (SSE)

Each request is answered by `mmadapt.answering.respond` (the code `mmadapt chat` runs: the model's chat template and
`template_kwargs`, the same decoding), on the model's one worker thread (`ModelWorker`: one generation at a time, at
most `max_queue` waiting, a full queue a 429 with `Retry-After`). A request's images are fetched and decoded before
it queues, in a thread of its own (`mmadapt.serve.media`), so a bad image fails that request alone and costs the
model nothing. A streamed answer whose client disconnects - and a whole answer whose client does - sets the job's
cancel flag: generation ends at the next token and the next request gets the model. Every error is OpenAI's shape
(`mmadapt.serve.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import secrets
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mmadapt.answering import Answer, PromptInputs, Sampling, TokenLogprob, respond
from mmadapt.serve import protocol
from mmadapt.serve.budget import RequestBudget, Tally
from mmadapt.serve.errors import APIError, bad_request
from mmadapt.serve.guard import Guard, HostRules
from mmadapt.serve.media import MediaPolicy, decode_image, image_header, stage_image, video_file
from mmadapt.serve.protocol import ChatCompletionRequest
from mmadapt.serve.worker import Cancelled, ModelWorker, QueueFull

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """How the server answers: the model's `name` (what requests must ask for), an `api_key` (None: no key), what
    requests may point at (`media`; its `max_pixels` None takes the processor's `max_image_pixels`), the queue
    (`max_queue` requests wait behind the running one), `default_max_tokens` for a request that sets none, the most
    one may ask for (`max_tokens_limit`), the largest request body (`max_request_bytes`; images are inside) and how
    long it may take to arrive (`body_timeout` seconds; its head, `header_timeout` seconds: `mmadapt.serve.runner`),
    what one request may hold (`budget`: images, pixels, videos,
    frames, text; `mmadapt.serve.budget`), the open connections (`max_connections`, uvicorn's 503 beyond) and the
    `Host` names it answers to besides localhost and its bound address (`allowed_hosts`; `mmadapt.serve.guard`)."""

    name: str = "mmadapt"
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_queue: int = 16
    default_max_tokens: int = 512
    max_tokens_limit: int = 8192
    max_request_bytes: int = 64 * 1024 * 1024
    budget: RequestBudget = field(default_factory=RequestBudget)
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    max_connections: int = 64
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("default_max_tokens", "max_tokens_limit", "max_request_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} > max_tokens_limit {self.max_tokens_limit}")
        for name in ("body_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.api_key == "":
            raise ValueError("api_key is empty: give a key, or None for a server without one")


def create_app(model: Any, processor: Any, settings: ServeSettings = ServeSettings()) -> FastAPI:
    """The API over `model` and its `processor` (`mmadapt.Processor`); `mmadapt.serve.runner` runs it with uvicorn."""
    service = Service(model, processor, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        service.close()

    app = FastAPI(title="mmadapt serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(Guard, rules=service.hosts)  # Host, Origin and JSON bodies, for the API and the page

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        log.info("%s %s: the client went away before its request was read (nothing answered)", request.method,
                 request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        error = APIError(500, f"the server failed: {type(exc).__name__}: {exc}", code="server_error")
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.name, **service.worker.state()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        service.authorize(request)
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str, request: Request) -> dict[str, Any]:
        service.authorize(request)
        service.check_model(name, param=None)
        return service.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.chat_completion(request)

    return app


class Service:
    """The model, its processor and worker, and what a request goes through (`chat_completion`)."""

    def __init__(self, model: Any, processor: Any, settings: ServeSettings) -> None:
        self.model, self.processor, self.settings = model, processor, settings
        data = processor.encoder.config
        self.media = dataclasses.replace(settings.media, max_pixels=settings.media.max_pixels or data.max_image_pixels)
        self.budget = settings.budget.resolved(data)
        self.decoding = threading.BoundedSemaphore(self.budget.decode_slots)
        self.hosts = HostRules(allowed=settings.allowed_hosts)  # the runner adds the address it binds
        self.worker = ModelWorker(settings.max_queue)
        self.created = protocol.now()
        self.active: set[threading.Event] = set()  # the cancel flags of the requests in progress

    def close(self) -> None:
        """Cancel what runs and waits (each ends at its next token), then stop the worker."""
        for cancel in list(self.active):
            cancel.set()
        self.worker.shutdown()

    def model_card(self) -> dict[str, Any]:
        return {"id": self.settings.name, "object": "model", "created": self.created, "owned_by": "mmadapt"}

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "incorrect or missing API key: send 'Authorization: Bearer KEY' with the server's key "
                           "(--api-key / MMADAPT_API_KEY)", code="invalid_api_key")

    def check_model(self, name: str, *, param: str | None = "model") -> None:
        if name != self.settings.name:
            raise APIError(404, f"the model {name!r} is not served here; this server serves {self.settings.name!r} "
                           "(GET /v1/models)", param=param, code="model_not_found")

    # ---- a chat completion ---------------------------------------------------------------------------------------
    async def chat_completion(self, request: Request) -> Response:
        self.authorize(request)
        body = protocol.parse_request(await self.read_json(request))
        self.check_model(body.model)
        settings = self.settings
        sampling = protocol.request_sampling(body, default_max_tokens=settings.default_max_tokens,
                                        max_tokens_limit=settings.max_tokens_limit, seed=secrets.randbits(63))
        if body.user:
            log.info("request from user %r", body.user)
        self.check_counts(body)
        try:
            place = self.worker.reserve()  # before anything is fetched or decoded: a full queue costs nothing
        except QueueFull as e:
            raise APIError(429, f"{e}; or raise the server's --max-queue", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None
        scratch = tempfile.TemporaryDirectory(prefix="mmadapt-serve-")
        cancel, queued = threading.Event(), False
        try:
            messages = await run_in_threadpool(self.conversation, body, Path(scratch.name))
            job = Job(self, messages, sampling, cancel, scratch, asyncio.get_running_loop(), body)
            self.active.add(cancel)
            future = asyncio.wrap_future(place.submit(job.run))
            queued = True
        except (ValueError, TypeError) as e:  # a part the checks above let through but the decoding refused
            raise protocol.error_from(e) from None
        finally:
            if not queued:  # the job cleans up after itself; a request that never queued does it here
                place.release()
                self.active.discard(cancel)
                scratch.cleanup()
        future.add_done_callback(lambda done: self.active.discard(cancel) or done.cancelled() or done.exception())
        if body.stream:
            kind, *payload = await self.until_done_or_gone(job.events.get(), request, cancel)
            if kind == "error":
                raise self.failure(payload[0])
            return StreamingResponse(job.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            answer = await self.until_done_or_gone(future, request, cancel)
        except Exception as e:
            raise self.failure(e) from None
        return JSONResponse(protocol.completion_body(answer, name=settings.name, cid=job.cid, created=job.created,
                                                     token_ids=bool(body.return_token_ids)))

    @staticmethod
    def failure(exc: BaseException) -> APIError:
        """What a failed job tells its client (a client that left gets a 499 it never reads)."""
        if isinstance(exc, Cancelled):
            return APIError(499, "the client closed the request before it was answered", code="cancelled")
        error = protocol.error_from(exc)
        if error.status >= 500:
            log.error("answering failed", exc_info=exc)
        return error

    @staticmethod
    async def until_done_or_gone(awaitable: Awaitable[Any], request: Request, cancel: threading.Event) -> Any:
        """`awaitable`'s result; while it is pending, a client that disconnects sets `cancel` (the job then ends
        at its next token, or does not start), and the result is still awaited so the worker is free after."""
        task = asyncio.ensure_future(awaitable)
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and not cancel.is_set() and await request.is_disconnected():
                cancel.set()
        return task.result()

    async def read_json(self, request: Request) -> Any:
        """The body as JSON, at most `max_request_bytes` (413 beyond, counted as it arrives), whole within
        `body_timeout` seconds (408 after)."""
        limit = self.settings.max_request_bytes
        length = request.headers.get("content-length", "")
        too_large = APIError(413, f"the request body is over the server's limit of {limit} bytes: send smaller images "
                             "(or raise --max-request-bytes)", code="request_too_large")
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(self.settings.body_timeout):  # a slow body holds a connection, not forever
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise too_large
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.settings.body_timeout:g} s "
                           "(--body-timeout)", code="request_timeout") from None
        try:
            return json.loads(body)
        except ValueError as e:
            raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None

    def check_counts(self, body: ChatCompletionRequest) -> None:
        """The budget's first step, from the request alone: its images, videos and characters of text."""
        images = videos = chars = 0
        for message in body.messages:
            for part in [message.content] if isinstance(message.content, str) else message.content:
                if isinstance(part, str):
                    chars += len(part)
                elif part.type == "text":
                    chars += len(part.text)
                else:
                    images += part.type == "image_url"
                    videos += part.type == "video_url"
        self.budget.check_counts(images=images, videos=videos, text_chars=chars)

    def conversation(self, body: ChatCompletionRequest, scratch: Path) -> list[dict[str, Any]]:
        """The request's messages as `respond` takes them; any part that cannot be used is a 400 naming it. Runs in a
        thread of the request's own, after it holds its queue place: every image and video is staged (fetched,
        nothing decoded) and its header added to the request's `Tally`; only then are the images decoded, at most
        `decode_slots` requests at once (videos are decoded by the model's processor, on the worker)."""
        tally = Tally(self.budget)
        messages = []
        for i, message in enumerate(body.messages):
            role = "system" if message.role == "developer" else message.role
            parts = ([protocol.TextPart(type="text", text=message.content)] if isinstance(message.content, str)
                     else message.content)
            content = [self.part(role, part, f"messages[{i}].content" + (
                "" if isinstance(message.content, str) else f"[{j}]"), scratch, tally) for j, part in enumerate(parts)]
            messages.append({"role": role, "content": content})
        with self.decoding:
            for content in (m["content"] for m in messages):
                for part in content:
                    if part["type"] == "image":
                        part["image"] = decode_image(part["image"], self.media, part.pop("param"))
        return messages

    def part(self, role: str, part: Any, where: str, scratch: Path, tally: Tally) -> dict[str, Any]:
        """One content part as `respond` takes it (an image staged, not yet decoded: `param` says where it was)."""
        if part.type == "text":
            held = [p for p in self.processor.placeholder_texts if p in part.text]
            if held and role != "assistant":  # an assistant's placeholder text is removed by respond (logged)
                raise bad_request(f"the text holds {', '.join(map(repr, held))}, which this model reads as visual "
                                  "input: send images as image_url parts (and videos as video_url parts), and remove "
                                  "the placeholder text", param=where, code="placeholder_in_text")
            return {"type": "text", "text": part.text}
        if role != "user":
            raise bad_request(f"{part.type} parts go in user messages, not {role} messages", param=where)
        media = part.image_url if part.type == "image_url" else part.video_url
        if media.detail not in (None, "auto"):
            raise bad_request(f"detail {media.detail!r} is not supported: images are seen at the model's own "
                              "resolution (its processor's pixel budget); leave detail out or 'auto'",
                              param=f"{where}.{part.type}.detail", code="unsupported_parameter")
        if part.type == "image_url":
            param = f"{where}.image_url"
            source = stage_image(media.url, self.media, param)
            tally.image(*image_header(source, self.media, param), param=param)
            return {"type": "image", "image": source, "param": param}
        encoder = self.processor.encoder
        if encoder.video_processor is None:
            raise bad_request(f"this model takes no video: {encoder.video_refusal}", param=where,
                              code="video_unsupported")
        param = f"{where}.video_url"
        path = video_file(media.url, self.media, param, scratch)
        plan = encoder.video_header(path, param)  # the header alone: frames kept, their decoded bytes
        tally.video(plan.frames, plan.bytes, param=param)
        return {"type": "video", "video": path}


class Job:
    """One request on the worker: `run` answers it there; `stream` turns its events into server-sent events."""

    def __init__(self, service: Service, messages: list[dict[str, Any]], sampling: Sampling, cancel: threading.Event,
                 scratch: tempfile.TemporaryDirectory, loop: asyncio.AbstractEventLoop,
                 body: ChatCompletionRequest) -> None:
        self.service, self.messages, self.sampling, self.cancel = service, messages, sampling, cancel
        self.scratch, self.loop, self.body = scratch, loop, body
        self.events: asyncio.Queue = asyncio.Queue()  # filled from the worker thread (`emit`)
        self.cid, self.created = protocol.completion_id(), protocol.now()
        self.tokens: list[int] = []  # since the last chunk
        self.logprobs: list[TokenLogprob] = []

    def emit(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def run(self) -> Answer:
        """On the worker thread: the prompt (event "prompt"), then the answer (events "text" ..., then "done"); a
        failure is event "error" and raised."""
        service, worker = self.service, self.service.worker
        try:
            if self.cancel.is_set():
                raise Cancelled()
            prompt = PromptInputs.build(service.model, service.processor, self.messages)
            self.emit("prompt", prompt.usage)
            answer = respond(service.model, service.processor, prompt, sampling=self.sampling,
                             on_token=self.token, on_text=self.text, cancelled=self.cancel.is_set)
        except BaseException as e:
            worker.count("cancelled" if isinstance(e, Cancelled) else "failed")
            self.emit("error", e)
            raise
        finally:
            self.scratch.cleanup()
        worker.count("cancelled" if answer.finish_reason == "cancelled" else "answered")
        self.emit("done", answer, self.take())
        return answer

    def token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.tokens.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def text(self, piece: str) -> None:
        self.emit("text", piece, self.take())

    def take(self) -> tuple[list[int], list[TokenLogprob]]:
        """The tokens (and log-probs) since the last chunk."""
        taken = (self.tokens, self.logprobs)
        self.tokens, self.logprobs = [], []
        return taken

    async def stream(self) -> AsyncIterator[str]:
        """`data: {chunk}` events: the role, the answer's pieces, the finish reason, the usage if asked, `[DONE]`.
        However it ends (a client that disconnects included), the job's cancel flag is set: the model is freed."""
        body, name = self.body, self.service.settings.name
        usage = bool(body.stream_options and body.stream_options.include_usage)
        logprobs, ids = bool(body.logprobs), bool(body.return_token_ids)

        def chunk(**fields: Any) -> str:
            data = protocol.chunk_body(name=name, cid=self.cid, created=self.created, include_usage=usage, **fields)
            return f"data: {json.dumps(data)}\n\n"

        def tokens(taken: tuple[list[int], list[TokenLogprob]]) -> dict[str, Any]:
            return {"logprobs": taken[1] if logprobs else None, "token_ids": taken[0] if ids else None}

        try:
            yield chunk(delta={"role": "assistant", "content": ""}, token_ids=[] if ids else None)
            while True:
                kind, *payload = await self.events.get()
                if kind == "text":
                    yield chunk(delta={"content": payload[0]}, **tokens(payload[1]))
                elif kind == "done":
                    answer = payload[0]
                    yield chunk(finish_reason=answer.finish_reason, **tokens(payload[1]))
                    if usage:
                        yield chunk(usage=answer.usage)
                    break
                elif kind == "error":
                    yield f"data: {json.dumps(Service.failure(payload[0]).body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.cancel.set()
