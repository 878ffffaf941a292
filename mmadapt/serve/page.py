"""`mmadapt serve MODEL --ui`: a web page to talk to a trained model and see where each answer looks (gradio).

    app = load_app("runs/demo")                                   # the OpenAI-compatible API (mmadapt.serve)
    mount_page(app, src="runs/demo")                              # + the page at /ui, on the same model and worker

Three tabs over the server's one model (`Service`):
- Chat: images (upload, paste, or an example), videos for the Qwen families, multi-turn, the answer streamed, Stop /
  Regenerate / Clear, the sampling settings `mmadapt chat` has (both generated from `mmadapt.sampling.Sampling`).
  Each answer is `Chat.ask` (`mmadapt chat`'s own code: the same prompt, the same decoding), run on the model's one
  worker thread (`ModelWorker`), so the page and the API answer one request at a time; gradio's queue
  (`concurrency_id="model"`) shows a page's place in line and the status line the worker's own count (API requests
  included).
- Evidence: for the latest answer, the evidence map as `mmadapt explain` draws it (the answer shown in the chat,
  sampled or not, is the one explained), its faithfulness and the verdict in words, and the image effect: what the
  model answers with the image blanked (the processor's mean colour) and with another image (an example), with the
  change of log p(answer) (`mmadapt.evidence.effect`). It costs about a hundred forwards, so it runs when asked,
  with progress, and Cancel stops it at the next batch.
- Model card: `mmadapt.serve.card.ModelCard`.

Uploads are untrusted: a turn is budgeted with its conversation as an API request is (`mmadapt.serve.budget`: the
counts and the text, then each file's size, signature and header; gradio's own `max_file_size` before it is stored)
and a bad one is a message in the page, the file dropped from the box and the conversation unchanged. What the page
keeps is bounded (`PageLimits`: conversations, the decoded bytes of each one's images). A conversation holds its
images encoded, never decoded (they decode on the model's worker when a prompt is built), never in more bytes than
their pixels (`compact_image`); its uploads are removed when its page closes (or it is forgotten). Example images are
decoded and re-encoded into a directory the page owns; nothing is read from a path a client names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # the page never phones home

import gradio as gr
from fastapi import FastAPI

from mmadapt.data.images import EmbeddedImage
from mmadapt.data.problems import DataProblem
from mmadapt.evidence import Integrated, Occlusion, Rise, explain
from mmadapt.evidence.effect import Effect, image_effect
from mmadapt.evidence.maps import MIN_EFFECT
from mmadapt.inference import Answer, Chat
from mmadapt.sampling import Sampling, sampling_settings
from mmadapt.serve.budget import PageLimits, Tally
from mmadapt.serve.card import ModelCard
from mmadapt.serve.errors import APIError
from mmadapt.serve.examples import Example, default_examples, examples_from
from mmadapt.serve.media import VIDEO_TYPES, compact_image, image_header, stage_image_file
from mmadapt.serve.worker import Cancelled, QueueFull

log = logging.getLogger(__name__)

AUTO = "an example unlike this image"
METHODS: dict[str, Callable[[], Any]] = {"occlusion": Occlusion, "rise": Rise, "integrated": Integrated}


class PageMessage(Exception):
    """Something the user can fix, said in the page (a bad upload, a question the evidence view cannot map)."""


class Session:
    """One page's conversation (`Chat` over the shared model) and its cancel flags."""

    def __init__(self, chat: Chat) -> None:
        self.chat = chat
        self.stop = threading.Event()  # the answer being streamed
        self.cancel = threading.Event()  # the evidence being computed
        self.files: set[str] = set()  # its uploads (checked to lie in the upload folders), removed when it ends

    def held_bytes(self) -> int:
        """The bytes of the images its conversation holds (what it keeps in memory for them)."""
        return sum(len(image.data) for turn in self.chat.turns for image in turn.images
                   if isinstance(image, EmbeddedImage))

    def end(self) -> None:
        """Stop what it runs and remove its uploaded files."""
        self.stop.set()
        self.cancel.set()
        for path in self.files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.files.clear()


class Page:
    """The page over a `Service` (the API's model, processor and worker); `build()` is the gradio app."""

    def __init__(self, service: Any, card: ModelCard, examples: list[Example], *,
                 upload_folders: list[Path] | None = None, limits: PageLimits | None = None) -> None:
        """`upload_folders`: where the files of a request may lie (default: gradio's upload folder); the examples'
        folders are added. `limits`: what the page keeps (default `PageLimits()`)."""
        from gradio.utils import get_upload_folder

        self.service, self.card, self.examples, self.limits = service, card, examples, limits or PageLimits()
        folders = [Path(get_upload_folder())] if upload_folders is None else upload_folders
        self.upload_folders = {Path(os.path.realpath(f)) for f in [*folders, *(e.image.parent for e in examples)]}
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.sessions_lock = threading.Lock()
        encoder = service.processor.encoder
        self.videos = encoder.video_processor is not None

    # ---- sessions --------------------------------------------------------------------------------------------------
    def session(self, request: gr.Request | None) -> Session:
        key = getattr(request, "session_hash", None) or "-"
        with self.sessions_lock:
            if key not in self.sessions:
                self.sessions[key] = Session(Chat(self.service.model, self.service.processor))
                while len(self.sessions) > self.limits.sessions:
                    self.sessions.popitem(last=False)[1].end()
            self.sessions.move_to_end(key)
            return self.sessions[key]

    def end(self, request: gr.Request) -> None:
        """A page closed (gradio's unload): its conversation is forgotten and its uploads removed."""
        key = getattr(request, "session_hash", None) or "-"
        with self.sessions_lock:
            session = self.sessions.pop(key, None)
        if session is not None:
            session.end()

    # ---- uploads ---------------------------------------------------------------------------------------------------
    def uploads(self, files: list[Any], text: str, chat: Chat) -> tuple[list[Any], list[str], list[str], list[str]]:
        """(images staged, video files, the files kept, a message per file refused) for a turn of `chat` with
        `files` and `text`. The turn is budgeted with the conversation it joins (the model reads it whole), as an
        API request is (`mmadapt.serve.budget`): the counts and the text first, then each file's size, signature
        and header, and the decoded size of the conversation's images against the page's `session_bytes`. Images
        are kept encoded (`EmbeddedImage`, see `image`), never as decoded pixels."""
        paths = [str(f.get("path") if isinstance(f, dict) else f) for f in files]
        is_video = [Path(p).suffix.lower() in VIDEO_TYPES.values() for p in paths]
        held_images = [i for t in chat.turns for i in t.images]
        held_videos = [v for t in chat.turns for v in t.videos]
        budget = self.service.budget
        try:
            budget.check_counts(images=len(held_images) + is_video.count(False),
                                videos=len(held_videos) + is_video.count(True),
                                text_chars=len(text) + sum(len(t.content) for t in chat.turns), param=None)
        except APIError as e:  # the box is emptied: gradio would copy every file back into it
            return [], [], [], [f"this turn: {e.message}"]
        tally, held = Tally(budget), 0
        try:  # the conversation's own media come first: they are in every prompt
            for image in held_images:
                width, height = image_header(image, self.service.media, image.name)
                tally.image(width, height)
                held += max(3 * width * height, len(image.data))
            for video in held_videos:
                plan = self.service.processor.encoder.video_header(video, Path(video).name)
                tally.video(plan.frames, plan.bytes)
        except (APIError, DataProblem) as e:
            return [], [], [], [f"this conversation: {getattr(e, 'message', e)} (Clear starts a new one)"]
        images, videos, kept, problems = [], [], [], []
        for path, video in zip(paths, is_video, strict=True):
            name = Path(path).name
            try:
                resolved = Path(os.path.realpath(path))
                if not self.upload_folders & set(resolved.parents):  # gradio checks too: no file is read from
                    raise PageMessage("not a file uploaded to this page")  # a path a client names
                if video:
                    videos.append(self.video(path, name, tally))
                else:
                    image, size = self.image(path, name, tally, held=held)
                    images.append(image)
                    held += size
                kept.append(path)
            except APIError as e:
                problems.append(f"{name}: {e.message}")
            except (PageMessage, DataProblem) as e:
                problems.append(f"{name}: {e}")
            except OSError as e:
                problems.append(f"{name}: the file cannot be read ({e.strerror or type(e).__name__})")
        return images, videos, kept, problems

    def image(self, path: str, name: str, tally: Tally, *, held: int) -> tuple[EmbeddedImage, int]:
        """(the image as the conversation keeps it, what it costs the conversation) for an upload: its size,
        signature and header checked, its pixels counted in the request budget (`tally`) and, with the `held` bytes
        of the conversation's images, against the page's `session_bytes`. It costs its decoded bytes (checked before
        decoding), or the bytes it is kept in if more (`compact_image`: a tiny PNG's framing)."""
        media = self.service.media
        staged = stage_image_file(path, media, name)
        width, height = image_header(staged, media, name)
        tally.image(width, height, param=name)
        self.limits.check_room(3 * width * height, held, param=name)
        with self.service.decoding:  # when it decodes: the API's bound
            data = compact_image(staged, 3 * width * height, media, name)
        cost = max(3 * width * height, len(data))
        self.limits.check_room(cost, held, param=name)
        return EmbeddedImage(data, name), cost

    def video(self, path: str, name: str, tally: Tally) -> str:
        if not self.videos:
            raise PageMessage("this model takes no videos (its encoder has no video processor): attach images")
        size = os.stat(path).st_size
        if size > self.service.media.max_video_bytes:
            raise PageMessage(f"the video is {size} bytes, over the limit of {self.service.media.max_video_bytes}")
        plan = self.service.processor.encoder.video_header(path, name)  # its header: frames kept, decoded bytes
        tally.video(plan.frames, plan.bytes, param=name)
        return path

    @staticmethod
    def say(text: str) -> None:
        """A message in the page (a toast that stays until closed); the event goes on."""
        gr.Warning(text, duration=None)

    def check_text(self, text: str) -> None:
        held = [p for p in self.service.processor.placeholder_texts if p in text]
        if held:
            raise PageMessage(f"the question holds {', '.join(map(repr, held))}, which this model reads as visual "
                              "input: attach images with the paper clip instead, and remove that text")

    # ---- running on the model's worker -----------------------------------------------------------------------------
    def on_worker(self, job: Callable[[Callable[[Any], None]], Any]) -> Iterator[tuple[str, Any]]:
        """Run `job(emit)` on the model's worker; yields ("wait", the worker's state) until it starts, then
        ("event", x) for each `emit(x)` and ("running", None) every 0.1 s without one, then ("done", its result).
        Its exception is raised here."""
        events: queue.Queue = queue.Queue()
        started = threading.Event()

        def run() -> Any:
            started.set()
            return job(events.put)

        try:
            future = self.service.worker.submit(run)
        except QueueFull as e:
            raise PageMessage(f"the model is busy: {e}") from None
        future.add_done_callback(lambda done: self.service.worker.count(outcome(done)))
        while True:
            try:
                yield "event", events.get(timeout=0.1)
                continue
            except queue.Empty:
                pass
            if future.done():
                break
            yield ("running", None) if started.is_set() else ("wait", self.service.worker.state())
        while not events.empty():
            yield "event", events.get_nowait()
        yield "done", future.result()

    # ---- chat ------------------------------------------------------------------------------------------------------
    def sampling(self, session: Session, values: tuple[Any, ...]) -> None:
        """The chat's `Sampling` from the controls' values (`sampling_controls`, in `sampling_settings` order)."""
        sampling = Sampling(**{s.name: s.kind(s.default if v is None else v)
                               for s, v in zip(sampling_settings(), values, strict=True)})
        chat = session.chat
        if sampling.seed != chat.sampling.seed:
            chat.generator.manual_seed(sampling.seed)
        chat.sampling = sampling

    def send(self, message: dict[str, Any] | None, history: list[dict[str, Any]], *controls: Any,
             request: gr.Request) -> Iterator[tuple[Any, ...]]:
        """The user's turn: checked, shown, answered in a stream (`controls`: the sampling controls' values)."""
        message = message or {}
        text, files = str(message.get("text") or "").strip(), list(message.get("files") or [])
        session = self.session(request)
        images, videos, kept, problems = self.uploads(files, text, session.chat)
        session.files.update(kept)  # removed when the session ends
        if problems:
            self.say("Not sent: " + "; ".join(problems))
            yield history, gr.update(value={"text": text, "files": kept}), gr.skip()
            return
        if not text:
            self.say("Type a question to send with the attachments." if files else "Type a question.")
            yield history, gr.skip(), gr.skip()
            return
        try:
            self.check_text(text)
        except PageMessage as e:
            self.say(str(e))
            yield history, gr.skip(), gr.skip()
            return
        self.sampling(session, controls)
        shown = [*history, {"role": "user", "content": [*({"path": f} for f in kept), text]}]
        chat = session.chat  # this conversation, even if Clear replaces the page's conversation meanwhile

        def answer(on_text: Callable[[str], None], stop: Callable[[], bool]) -> Answer:
            chat.ask(text, images=images, videos=videos, on_text=on_text, cancelled=stop)
            return chat.last

        yield from self.stream(session, shown, answer)

    def regenerate(self, history: list[dict[str, Any]], *controls: Any,
                   request: gr.Request) -> Iterator[tuple[Any, ...]]:
        session = self.session(request)
        if not session.chat.turns or session.chat.turns[-1].role != "assistant":
            self.say("There is no answer to regenerate yet.")
            yield history, gr.skip(), gr.skip()
            return
        self.sampling(session, controls)
        shown = list(history)
        while shown and shown[-1]["role"] == "assistant":
            shown.pop()
        chat = session.chat

        def answer(on_text: Callable[[str], None], stop: Callable[[], bool]) -> Answer:
            chat.regenerate(on_text, stop)
            return chat.last

        yield from self.stream(session, shown, answer)

    def stream(self, session: Session, shown: list[dict[str, Any]],
               answer: Callable[[Callable[[str], None], Callable[[], bool]], Answer]) -> Iterator[tuple[Any, ...]]:
        """Answer on the worker, streaming the text into the last chat message; the box is locked meanwhile."""
        session.stop.clear()
        locked = gr.update(value=None, interactive=False)
        text = ""
        yield [*shown, {"role": "assistant", "content": "…"}], locked, "answering"
        try:
            for kind, value in self.on_worker(lambda emit: answer(emit, session.stop.is_set)):
                if kind == "event":
                    text += value
                    yield [*shown, {"role": "assistant", "content": text}], locked, "answering"
                elif kind == "wait":
                    yield ([*shown, {"role": "assistant", "content": waiting(value)}], locked, "waiting")
                elif kind == "done":
                    final = [*shown, {"role": "assistant", "content": value.text or "(empty answer)"}]
                    yield final, gr.update(value=None, interactive=True), describe(value)
        except (PageMessage, ValueError, TypeError, DataProblem) as e:  # the turn was not taken (Chat removes it)
            self.say(f"Not answered: {e}")
            yield shown[:-1] if shown and shown[-1]["role"] == "user" else shown, \
                gr.update(interactive=True), "not answered"
        finally:
            session.stop.set()  # a page that went away frees the model at the next token

    def stop(self, request: gr.Request) -> None:
        session = self.session(request)
        session.stop.set()
        session.cancel.set()

    def clear(self, request: gr.Request) -> tuple[Any, ...]:
        session = self.session(request)
        session.stop.set()  # an answer still running ends at its next token, in the conversation it belonged to
        session.chat = Chat(self.service.model, self.service.processor, sampling=session.chat.sampling)
        return [], gr.update(value=None, interactive=True), "", None, ""

    def status(self) -> str:
        state = self.service.worker.state()
        busy = "answering" if state["running"] else "idle"
        return (f"model **{busy}** · {state['waiting']} waiting · {state['answered']} answered "
                "(this page and the API share it)")

    # ---- evidence --------------------------------------------------------------------------------------------------
    def evidence(self, method: str, curve_steps: float, other: str | None, request: gr.Request,
                 progress: gr.Progress = gr.Progress()) -> Iterator[tuple[Any, ...]]:  # noqa: B008 (gradio)
        """Map the latest answer, measure the map, and answer again without the image and with another one."""
        session = self.session(request)
        chat = session.chat
        if chat.last is None or not chat.turns or chat.turns[-1].role != "assistant":
            raise gr.Error("Ask a question about an image first: the evidence view explains the latest answer.")
        messages, images, videos = chat.prompt()
        if videos or len(images) != 1:
            raise gr.Error(f"The evidence view maps an answer about one image; this conversation has {len(images)} "
                           f"image(s) and {len(videos)} video(s). Clear it and ask about one image.")
        with self.service.decoding:  # the conversation keeps it encoded; decoding has the API's bound
            image = self.service.processor.image(images[0])
        picked = self.other_image(other, image)
        session.cancel.clear()
        answer = chat.last
        state: dict[str, Any] = {"stage": "waiting for the model", "done": 0, "total": 1}

        def report(stage: str, done: int, total: int) -> None:
            state.update(stage=stage, done=done, total=total)
            if session.cancel.is_set():
                raise Cancelled()

        def job(emit: Callable[[Any], None]) -> tuple[Any, ...]:
            with tempfile.TemporaryDirectory(prefix="mmadapt-page-") as scratch:
                result = explain(self.service.model, self.service.processor, image, messages,
                                 answer_ids=answer.token_ids, method=METHODS[method](),
                                 curve_steps=int(curve_steps), out=Path(scratch) / "map.png", progress=report)
                from PIL import Image

                with Image.open(result.png) as drawn:
                    picture = drawn.convert("RGB")
            report("image effect", 0, 2)
            effect = image_effect(self.service.model, self.service.processor, messages, image,
                                  None if picked is None else picked.image, answer, chat.sampling.max_new_tokens)
            return picture, result, effect

        bar = 0.0
        try:
            yield None, "Working…", gr.update(visible=True)
            for kind, value in self.on_worker(job):
                if kind == "wait":
                    progress(0.0, desc=f"waiting for the model ({value['waiting']} waiting)")
                elif kind == "done":
                    picture, result, effect = value
                    yield picture, verdict_words(result, effect, picked), gr.update(visible=False)
                    return
                else:  # running: the bar follows the work's stage (never back: a stage may make several sweeps)
                    bar = max(bar, stage_fraction(state))
                    progress(bar, desc=f"{state['stage']}: {state['done']}/{state['total']}")
        except Cancelled:
            yield None, "Cancelled: no map was drawn.", gr.update(visible=False)
        except (ValueError, TypeError) as e:
            yield None, f"The evidence could not be computed: {e}", gr.update(visible=False)

    def other_image(self, name: str | None, image: Any) -> Example | None:
        """The example named `name`, or (`AUTO`) the first example whose pixels differ from `image`."""
        import numpy as np
        from PIL import Image

        if name != AUTO:
            return next((e for e in self.examples if e.name == name), None)
        pixels = np.asarray(image)
        for example in self.examples:
            with Image.open(example.image) as opened:
                if not np.array_equal(np.asarray(opened.convert("RGB")), pixels):  # shapes differ: not equal
                    return example
        return None

    # ---- the page --------------------------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        kinds = ["image", *([".mp4", ".webm", ".mov", ".mkv", ".avi"] if self.videos else [])]
        name = self.card.name
        with gr.Blocks(title=f"mmadapt · {name}", analytics_enabled=False,
                       delete_cache=(3600, 3600)) as page:  # uploads older than an hour are deleted, hourly
            with gr.Row():
                gr.Markdown(f"## {name}\nA vision-language model trained with mmadapt. Ask about an image; then "
                            "open **Evidence** to see where the answer looks.", elem_id="title")
                status = gr.Markdown(self.status(), elem_id="status")
            with gr.Tabs():
                with gr.Tab("Chat", id="chat"), gr.Row():
                    with gr.Column(scale=3):
                        chatbot = gr.Chatbot(elem_id="chatbot", height=480, label="conversation",
                                             feedback_options=None, buttons=["copy"])
                        box = gr.MultimodalTextbox(
                            elem_id="ask", file_types=kinds, file_count="multiple", sources=["upload"],
                            placeholder="Ask about an image: attach or paste it (or pick an example), then Enter",
                            show_label=False)
                    with gr.Column(scale=1, min_width=260):
                        with gr.Row():
                            stop = gr.Button("Stop", elem_id="stop", variant="stop", size="sm")
                            again = gr.Button("Regenerate", elem_id="regenerate", size="sm")
                            clear = gr.Button("Clear", elem_id="clear", size="sm")
                        finish = gr.Markdown("", elem_id="finish")
                        if self.examples:
                            gr.Examples([{"text": e.question, "files": [str(e.image)]} for e in self.examples],
                                        inputs=[box], label="examples",
                                        example_labels=[e.name for e in self.examples])
                        with gr.Accordion("Sampling (as mmadapt chat)", open=False):
                            settings = sampling_controls(self.service.settings.max_tokens_limit)
                with gr.Tab("Evidence", id="evidence"), gr.Row():
                    with gr.Column(scale=3):
                        picture = gr.Image(elem_id="evidence-map", label="evidence map of the latest answer",
                                           interactive=False, type="pil", height=520, buttons=["download"])
                    with gr.Column(scale=2, min_width=320):
                        with gr.Row():
                            run = gr.Button("Map the latest answer", elem_id="explain", variant="primary")
                            cancel = gr.Button("Cancel", elem_id="cancel", visible=False)
                        words = gr.Markdown("Where does the latest answer rest on its image? The map is drawn as "
                                            "`mmadapt explain` draws it and checked against random orders "
                                            "(faithfulness); then the question is answered with the image blanked "
                                            "and with another image.", elem_id="verdict")
                        with gr.Accordion("Settings", open=False):
                            method = gr.Dropdown(list(METHODS), value="occlusion", label="method")
                            curves = gr.Slider(0, 16, value=8, step=1, label="faithfulness curve points (0 = skip)")
                            other = gr.Dropdown([AUTO, *(e.name for e in self.examples)], value=AUTO,
                                                label="another image (for the image effect)")
                with gr.Tab("Model card", id="card"):
                    gr.Markdown(self.card.markdown(), elem_id="card")

            model = {"concurrency_limit": 1, "concurrency_id": "model"}
            sent = box.submit(requested(self.send), [box, chatbot, *settings], [chatbot, box, finish], **model)
            redo = again.click(requested(self.regenerate), [chatbot, *settings], [chatbot, box, finish], **model)
            stop.click(self.stop, None, None, queue=False)  # the answer ends at its next token and the box unlocks
            for emptied in (clear.click, chatbot.clear):  # the button, and the chat's own bin icon
                emptied(self.clear, None, [chatbot, box, finish, picture, words], queue=False, cancels=[sent, redo])
            run.click(self.evidence, [method, curves, other], [picture, words, cancel], **model)
            cancel.click(self.stop, None, None, queue=False).then(
                lambda: gr.update(visible=False), None, [cancel], queue=False)
            gr.Timer(2.0).tick(self.status, None, [status], queue=False, show_progress="hidden")
            page.unload(self.end)
        return page


# ---- what the evidence view says ---------------------------------------------------------------------------------
def requested(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """`method(*inputs, request=)` as gradio calls it (it passes the request by position, before `*inputs`)."""
    def call(request: gr.Request, *inputs: Any) -> Iterator[Any]:
        yield from method(*inputs, request=request)

    return call


def sampling_controls(max_tokens_limit: int) -> list[Any]:
    """One control per sampling setting (`mmadapt.sampling.sampling_settings`: the flags of `mmadapt chat`, with
    their defaults and help): a slider over the setting's range (max new tokens up to the server's limit), or a
    number box for a seed."""
    def control(s: Any) -> Any:
        high, shown = min(s.high, max_tokens_limit) if s.name == "max_new_tokens" else s.high, {
            "label": s.label, "info": s.help, "elem_id": s.name.replace("_", "-")}
        return (gr.Number(value=s.default, precision=0, **shown) if s.name == "seed" else
                gr.Slider(s.low, high, value=min(s.default, high), step=s.step, **shown))

    return [control(s) for s in sampling_settings()]


def stage_fraction(state: dict[str, Any]) -> float:
    """The progress bar: the map 0-60%, faithfulness 60-95%, the image effect the rest."""
    spans = {"map": (0.0, 0.6), "faithfulness": (0.6, 0.95), "image effect": (0.95, 1.0)}
    start, end = spans.get(state["stage"], (0.0, 0.0))
    return start + (end - start) * state["done"] / max(state["total"], 1)


def verdict_words(result: Any, effect: Effect, other: Example | None) -> str:
    """The evidence view's text: the answer, whether to trust its map, and what the model says without the image."""
    measured = result.faithfulness
    lines = [f"**Answer explained:** “{result.answer or '(empty)'}”", ""]
    if measured is None:
        lines.append("**Faithfulness not measured** (curve points 0): the map is drawn but not checked.")
    elif not measured.decisive:
        lines.append(f"**Do not read this map:** the answer barely depends on the image's pixels (log p changes by "
                     f"{measured.pixel_effect:+.2f} nats with the mean-colour image, under {MIN_EFFECT}), so there is "
                     "no evidence to show.")
    elif measured.trusted:
        lines.append(f"**Trusted map:** removing its strongest cells first lowers the answer faster, and revealing "
                     f"them first raises it faster, than every one of {measured.orders} random orders (faithfulness "
                     f"{measured.score:+.2f}; 0 = a random map).")
    else:
        lines.append(f"**Do not trust this map:** it beats only {measured.wins} of {measured.orders} random orders "
                     f"(faithfulness {measured.score:+.2f}; 0 = a random map): the evidence it shows is not where the "
                     "answer's support lies.")
    shares = ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in result.quadrants.items())
    lines += ["", f"Evidence by quadrant: {shares}.", "", "**Image effect**",
              *effect.lines(None if other is None else other.name)]
    return "\n".join(lines)


def outcome(done: Any) -> str:
    """How a finished job of the page counts in the worker's tally (`/health`)."""
    if done.cancelled() or isinstance(done.exception(), Cancelled):
        return "cancelled"
    return "failed" if done.exception() is not None else "answered"


def waiting(state: dict[str, Any]) -> str:
    ahead = state["waiting"]
    return "⏳ waiting for the model: it is answering another request" + (f" ({ahead} waiting)" if ahead else "")


def describe(answer: Answer) -> str:
    """The line under the buttons: how the answer ended and what the prompt held."""
    usage = answer.usage
    ended = {"stop": "ended by the model", "length": "cut at max new tokens (raise it in Sampling)",
             "cancelled": "stopped"}.get(answer.finish_reason, answer.finish_reason)
    return (f"{usage.completion_tokens} tokens, {ended}; prompt {usage.prompt_tokens} tokens, "
            f"{usage.image_tokens + usage.video_tokens} of them visual")


# ---- mounting ----------------------------------------------------------------------------------------------------
def mount_page(app: FastAPI, *, src: str | os.PathLike | None = None, path: str = "/ui",
               examples: str | os.PathLike | None = None, limits: PageLimits | None = None) -> FastAPI:
    """Add the page at `path` of `app` (an app of `create_app` / `load_app`: the page answers through its model and
    worker). `src`: where the model was loaded from (the model card, the run's example questions); `examples`: a
    LLaVA / messages file whose first single-image questions are the examples (default: the run's data.eval);
    `limits`: the conversations it keeps and their images' decoded bytes (`PageLimits`).
    A server with an API key asks for it on the page too (a login form: any user name, the key as password)."""
    import hmac
    import shutil
    import weakref

    service = app.state.service
    scratch = Path(tempfile.mkdtemp(prefix="mmadapt-page-examples-"))
    weakref.finalize(app, shutil.rmtree, scratch, ignore_errors=True)
    found = (examples_from(examples, scratch) if examples is not None else default_examples(src, scratch))
    card = ModelCard.read(src, service.model, service.processor, name=service.settings.name)
    page = Page(service, card, found, limits=limits).build()
    page.queue(default_concurrency_limit=1, max_size=service.settings.max_queue + 1)
    limit = max(service.media.max_image_bytes, service.media.max_video_bytes if
                service.processor.encoder.video_processor is not None else 0)
    key = service.settings.api_key
    login = None if key is None else (lambda user, password: hmac.compare_digest(password.encode(), key.encode()))
    app.state.page_examples = scratch
    return gr.mount_gradio_app(app, page, path=path, allowed_paths=[str(scratch)], max_file_size=limit,
                               auth=login, auth_message="This server has an API key: sign in with any name and the key "
                               "as the password.", show_error=True, footer_links=[], theme=gr.themes.Default(),
                               css=CSS)


CSS = """
#status { text-align: right; font-size: 0.9em; }
#verdict { font-size: 1.02em; }
#chatbot img {  /* small images (a 48 px digit) stay visible */
  width: 160px !important; height: 160px !important; max-height: none !important;
  object-fit: contain; image-rendering: pixelated;
}
footer { display: none !important; }
"""

__all__ = ["Page", "PageLimits", "mount_page", "sampling_controls", "verdict_words"]
