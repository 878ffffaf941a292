"""Running the API: `load_app(MODEL)` (what `mmadapt serve MODEL` serves), `run(app)` (uvicorn, in the foreground)
and `BackgroundServer(app)` (uvicorn on a thread: a notebook, a training run's evaluation, the tests). Both run
uvicorn's h11 protocol with a deadline for each request's head (`head_timeout_protocol`): uvicorn has none.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from fastapi import FastAPI

from mmadapt.run_directory import RunDirectory
from mmadapt.serve.app import ServeSettings, create_app

log = logging.getLogger(__name__)


def default_name(src: str | Path) -> str:
    """The name a model is served under by default: its directory's name (the run's, for a run's OUT/model or
    OUT/adapters)."""
    path = Path(src).resolve()
    run = RunDirectory.of(path)
    return run.path.name if run is not None and path in (run.model_dir, run.adapters_dir) else path.name


def load_app(src: str | Path, adapters: str | Path | None = None, *, settings: ServeSettings | None = None,
             device: str | None = None) -> FastAPI:
    """The API over the model `src` names (anything `mmadapt.inference.load_for_inference` takes: a model directory,
    a run, a checkpoint, an export; `adapters` merged in), moved to `device` when given; `settings` default: named
    after the model's directory (`default_name`)."""
    from mmadapt.inference import load_for_inference
    from mmadapt.processor import Processor

    model, tokenizer = load_for_inference(src, adapters)
    if device is not None:
        model = model.to(device)
    settings = settings or ServeSettings(name=default_name(src))
    return create_app(model.eval(), Processor.for_model(model, tokenizer), settings)


def run(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` until interrupted (uvicorn; Ctrl-C stops it after the running answer is cancelled); at most the
    settings' `max_connections` connections at once (uvicorn answers more with 503), each closed when a request's
    head takes over `header_timeout` seconds to arrive."""
    import uvicorn

    uvicorn.run(app, **uvicorn_options(app, host), port=port, log_level=log_level, timeout_graceful_shutdown=10)


def uvicorn_options(app: FastAPI, host: str) -> dict[str, Any]:
    """What `run` and `BackgroundServer` give uvicorn for `app` bound to `host` (which its Host check then allows)."""
    settings = app.state.service.settings
    app.state.service.hosts.bind(host)
    return {"host": host, "limit_concurrency": settings.max_connections,
            "http": head_timeout_protocol(settings.header_timeout)}


def head_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request head (request line and headers) is not complete
    within `seconds` of the connection opening, or of its previous response ending.

    uvicorn has no such deadline: its `timeout_keep_alive` covers only a connection idle after a response, so one that
    sends half a head holds its place, and its count against `limit_concurrency`, for as long as it likes (six held a
    server with `--max-connections 6` at 503 for 45 s). This subclass is the one place that adds it: a timer per
    connection, armed while h11 waits for a request head (the client's state IDLE) and cancelled once it is whole."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.watch_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watch_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.watch_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_head_timer()
            super().connection_lost(exc)

        def watch_head(self) -> None:
            """Arm the timer while a head is awaited (once: the first byte of a head does not restart it)."""
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                self.stop_head_timer()
            elif self.head_timer is None:
                self.head_timer = self.loop.call_later(seconds, self.head_timed_out)

        def stop_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_timed_out(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closed a connection from %s: no whole request head within %g s (--header-timeout)",
                         self.client[0] if self.client else "?", seconds)
                self.transport.close()

    return HeadTimeoutProtocol


class BackgroundServer:
    """`app` served by uvicorn on a thread of this process while the block runs; `url` is its base URL.

        with BackgroundServer(app) as server:                    # port 0: a free port, chosen by the system
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout: float = 30.0) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(app, host), port=port,
                                                    log_level=log_level, timeout_graceful_shutdown=5))
        self.host, self.start_timeout = host, start_timeout
        self.thread = threading.Thread(target=self.server.run, name="mmadapt-serve", daemon=True)
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError(f"the server did not start on {self.host} within {self.start_timeout} s (is the "
                                   "port taken? see the uvicorn log above)")
            time.sleep(0.02)
        sockets: Any = self.server.servers[0].sockets
        self.port = int(sockets[0].getsockname()[1])
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if self.thread.is_alive():
            log.warning("the background server did not stop within 30 s")
