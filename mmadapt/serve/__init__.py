"""`mmadapt serve`: an OpenAI-compatible HTTP API over a trained model (FastAPI + uvicorn; extra `serve`).

    from mmadapt.serve import BackgroundServer, ServeSettings, create_app, load_app
    app = load_app("runs/colours", settings=ServeSettings(name="colours", api_key="secret"))
    with BackgroundServer(app) as server:                       # or mmadapt.serve.run(app, port=8000)
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret").chat.completions.create(...)

`create_app` (app.py) builds the API over a model and its Processor, testable without a socket; each request is
answered by `mmadapt.inference.respond` (the code `mmadapt chat` runs) on one worker thread (worker.py); protocol.py
is the request, its checks and the response bodies; budget.py what one request may hold, checked before any
decoding; media.py stages, header-checks and decodes what `image_url` / `video_url` parts name; guard.py the Host /
Origin / JSON checks that keep other sites' pages out; errors.py is OpenAI's error shape; runner.py runs uvicorn.
page.py is `--ui`'s web page (gradio, extra `ui`, imported only when asked for: `mount_page(app, src=...)`) and
card.py the model card it shows. The surface, limits and errors: docs/serving.md.
"""

from mmadapt.serve.app import ServeSettings, create_app
from mmadapt.serve.budget import RequestBudget
from mmadapt.serve.errors import APIError
from mmadapt.serve.media import MediaPolicy
from mmadapt.serve.runner import BackgroundServer, default_name, load_app, run

__all__ = ["APIError", "BackgroundServer", "MediaPolicy", "RequestBudget", "ServeSettings", "create_app",
           "default_name", "load_app", "run"]
