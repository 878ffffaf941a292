"""The OpenAI chat-completions protocol as `mmadapt serve` speaks it: the request (pydantic), its checks, and the
response and stream-chunk bodies built from an `mmadapt.answering.Answer`.

A request field the server does not implement is refused (400, code `unsupported_parameter`, the field in `param`),
never ignored; so is a value it cannot honour (`n` > 1, a non-zero `frequency_penalty` / `presence_penalty`, a
`response_format` other than text, `detail` other than auto). Accepted:

| field | meaning here |
|---|---|
| `model` | the served model's name (`GET /v1/models`); another name is a 404 |
| `messages` | system, developer (= system), user, assistant; content a string or text / image_url / video_url parts |
| `max_completion_tokens`, `max_tokens` | the most tokens to generate (the first one given; default: the server's) |
| `temperature` (default 1, as OpenAI's), `top_p`, `seed` | sampling; 0 is greedy; no seed: a fresh random one |
| `stop` | up to 4 strings of at most 256 characters each; the answer ends before the first, `finish_reason` "stop" |
| `logprobs`, `top_logprobs` (0-20) | the model's log-probs of each generated token and its alternatives |
| `stream`, `stream_options.include_usage` | server-sent events, then `data: [DONE]` |
| `frequency_penalty`, `presence_penalty` | accepted as 0 only (not implemented: use `repetition_penalty`) |
| `repetition_penalty` | extension: transformers' repetition penalty (1 = off) |
| `return_token_ids` | extension (as vLLM): the generated token ids in each choice / chunk |
| `user` | accepted and logged; it changes nothing |
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mmadapt.answering import Answer, Sampling, TokenLogprob, Usage
from mmadapt.sampling import MAX_STOP_CHARS
from mmadapt.serve.errors import APIError, bad_request

UNSUPPORTED = {
    **dict.fromkeys(("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"),
                    "tool and function calling is not supported"),
    "logit_bias": "logit_bias is not supported",
    **dict.fromkeys(("audio", "modalities"), "only text output is supported"),
    "prediction": "predicted outputs are not supported",
    **dict.fromkeys(("reasoning_effort", "verbosity"), "the model's template decides its thinking, not the request"),
    **dict.fromkeys(("store", "metadata"), "completions are not stored"),
    **dict.fromkeys(("service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
                     "web_search_options", "moderation"), "not available on this server"),
    "chat_template_kwargs": "the prompt is rendered with the template_kwargs the model was trained with (saved in its "
                            "template); a request cannot change them",
    "media_io_kwargs": "videos are sampled by the model's own processor settings, as in training",
    **dict.fromkeys(("top_k", "min_p", "min_tokens", "ignore_eos"), "not implemented (vLLM's sampling extensions)"),
}
"""OpenAI chat-completions fields the server refuses, with the reason it gives."""
MAX_STOP = 4  # stop strings, each at most MAX_STOP_CHARS characters
MAX_TOP_LOGPROBS = 20


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class MediaURL(Strict):
    url: str
    detail: str | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: MediaURL


class VideoPart(Strict):
    type: Literal["video_url"]
    video_url: MediaURL


Part = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]


class StreamOptions(Strict):
    include_usage: bool = False


class ResponseFormat(Strict):
    type: str


class ChatCompletionRequest(Strict):
    """A `POST /v1/chat/completions` body: OpenAI's fields that the server implements (module docstring)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    return_token_ids: bool | None = False
    user: str | None = None


def parse_request(body: Any) -> ChatCompletionRequest:
    """A decoded JSON body -> the request, or a 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    for key in body:
        if key not in ChatCompletionRequest.model_fields:
            reason = UNSUPPORTED.get(key, "not a chat-completions parameter this server knows")
            raise bad_request(f"unsupported parameter {key!r}: {reason}", param=key, code="unsupported_parameter")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        error = max(e.errors(), key=lambda x: len(x["loc"]))  # the deepest: the union branch that was meant
        where = _where(error["loc"])
        raise bad_request(f"{where}: {error['msg']}", param=where,
                          code="unsupported_parameter" if error["type"] == "extra_forbidden" else "invalid_value"
                          ) from None


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic location -> `messages[0].content[1].image_url.url` (union branch names and tags dropped)."""
    out, last = "", None
    for item in loc:
        if isinstance(item, str) and ("[" in item or item == "str" or item == last):
            last = item
            continue
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else item)
        last = item
    return out


def request_sampling(request: ChatCompletionRequest, *, default_max_tokens: int, max_tokens_limit: int,
                seed: int) -> Sampling:
    """The request's sampling settings, each honoured or refused (400): nothing is silently ignored. `seed` is the
    one to use when the request gives none (the server draws it)."""
    if (request.n or 1) != 1:
        raise bad_request(f"n={request.n}: this server returns one choice per request (n=1); send n requests",
                          param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not implemented (only 0 is accepted); use repetition_penalty (transformers' "
                              "multiplicative penalty, e.g. 1.1) instead", param=name, code="unsupported_parameter")
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request(f"response_format {request.response_format.type!r} is not supported (only 'text')",
                          param="response_format", code="unsupported_parameter")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP or not all(stop):
        raise bad_request(f"stop takes up to {MAX_STOP} non-empty strings, got {len(stop)}", param="stop")
    for k, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(f"stop strings may have at most {MAX_STOP_CHARS} characters; stop[{k}] has {len(text)}",
                              param="stop")
    max_tokens = request.max_completion_tokens or request.max_tokens or default_max_tokens
    if max_tokens > max_tokens_limit:
        raise bad_request(f"max_tokens {max_tokens} is over this server's limit of {max_tokens_limit} "
                          "(--max-tokens-limit)", param="max_completion_tokens" if request.max_completion_tokens
                          else "max_tokens")
    return Sampling(max_new_tokens=max_tokens, temperature=1.0 if request.temperature is None else request.temperature,
                    top_p=1.0 if request.top_p is None else request.top_p,
                    seed=seed if request.seed is None else request.seed,
                    repetition_penalty=request.repetition_penalty or 1.0, stop=tuple(stop),
                    logprobs=(request.top_logprobs or 0) if request.logprobs else None)


# ---- responses ------------------------------------------------------------------------------------------------------
def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's `usage`, with the visual tokens stated in `prompt_tokens_details` (`image_tokens`, `video_tokens`:
    the prompt positions the vision side filled, counted in `prompt_tokens`)."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": 0, "image_tokens": usage.image_tokens,
                                      "video_tokens": usage.video_tokens}}


def logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in entry.top]}


def completion_body(answer: Answer, *, name: str, cid: str, created: int, token_ids: bool) -> dict[str, Any]:
    """A whole `chat.completion` object."""
    choice: dict[str, Any] = {
        "index": 0, "message": {"role": "assistant", "content": answer.text},
        "logprobs": None if answer.logprobs is None else {"content": [logprob_entry(e) for e in answer.logprobs]},
        "finish_reason": answer.finish_reason}
    if token_ids:
        choice["token_ids"] = list(answer.token_ids)
    return {"id": cid, "object": "chat.completion", "created": created, "model": name, "choices": [choice],
            "usage": usage_body(answer.usage)}


def chunk_body(*, name: str, cid: str, created: int, delta: dict[str, Any] | None = None,
               logprobs: list[TokenLogprob] | None = None, finish_reason: str | None = None,
               token_ids: list[int] | None = None, usage: Usage | None = None,
               include_usage: bool = False) -> dict[str, Any]:
    """One `chat.completion.chunk`: a choice with `delta` (and its tokens' log-probs / ids), or - `usage` given - the
    usage chunk (no choices); with `include_usage` every other chunk carries `"usage": null`, as OpenAI's do."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name}
    if usage is not None:
        return {**body, "choices": [], "usage": usage_body(usage)}
    choice: dict[str, Any] = {"index": 0, "delta": delta or {},
                              "logprobs": None if logprobs is None else {"content": [logprob_entry(e)
                                                                                      for e in logprobs]},
                              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body["choices"] = [choice]
    if include_usage:
        body["usage"] = None
    return body


def now() -> int:
    return int(time.time())


def error_from(exc: BaseException) -> APIError:
    """What a failure while answering becomes: a request problem (a bad conversation, an image or video the pipeline
    refuses, a prompt over max_length: `ValueError` / `TypeError`, `DataProblem` included) is a 400, anything else a
    500 (logged with its traceback by the caller)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        reason = getattr(exc, "reason", None)
        return bad_request(" ".join(str(exc).split()), code=reason or "invalid_request")
    return APIError(500, f"the server failed while answering: {type(exc).__name__}: {exc}", code="server_error")
