"""Running the API: `load_app(MODEL)` (what `mmadapt serve MODEL` serves), `run(app)` (uvicorn, in the foreground)
and `BackgroundServer(app)` (uvicorn on a thread: a notebook, a training run's evaluation, the tests).
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
    settings' `max_connections` connections at once (uvicorn answers more with 503)."""
    import uvicorn

    service = app.state.service
    service.hosts.bind(host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
                limit_concurrency=service.settings.max_connections)


class BackgroundServer:
    """`app` served by uvicorn on a thread of this process while the block runs; `url` is its base URL.

        with BackgroundServer(app) as server:                    # port 0: a free port, chosen by the system
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout: float = 30.0) -> None:
        import uvicorn

        service = app.state.service
        service.hosts.bind(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=5,
                                                    limit_concurrency=service.settings.max_connections))
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
