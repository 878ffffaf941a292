"""`mmadapt serve MODEL`: the OpenAI-compatible API over a trained model (`mmadapt.serve`), bound to 127.0.0.1."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from mmadapt.cli.common import add_model_arguments

log = logging.getLogger(__name__)
PAGE_PATH = "/ui"


def cmd_serve(args: argparse.Namespace) -> int:
    """Load MODEL and serve it until interrupted."""
    try:
        from mmadapt.serve import MediaPolicy, ServeSettings, default_name, load_app, run
    except ImportError as e:
        raise ValueError(f"mmadapt serve needs FastAPI and uvicorn ({e}); install them: pip install 'mmadapt[serve]'"
                         ) from None
    key = args.api_key if args.api_key is not None else os.environ.get("MMADAPT_API_KEY") or None
    if args.image_root is not None and not Path(args.image_root).is_dir():
        raise FileNotFoundError(f"--image-root {args.image_root} is not a directory")
    settings = ServeSettings(
        name=args.served_model_name or default_name(args.model), api_key=key,
        media=MediaPolicy(image_root=Path(args.image_root) if args.image_root else None,
                          allow_remote=args.allow_remote_images, max_image_bytes=args.max_image_bytes),
        max_queue=args.max_queue, default_max_tokens=args.max_tokens, max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes)
    if key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.basicConfig(level=logging.INFO)
        log.warning("serving on %s without an API key: anyone who reaches the port can use the model (--api-key)",
                    args.host)
    device = None if args.device == "auto" else args.device
    if args.device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else None
    if args.examples is not None and not Path(args.examples).is_file():
        raise FileNotFoundError(f"--examples {args.examples} is not a file")
    if args.ui:
        try:
            from mmadapt.serve.page import mount_page
        except ImportError as e:
            raise ValueError(f"mmadapt serve --ui needs gradio ({e}); install it: pip install 'mmadapt[ui]'") from None
    app = load_app(args.model, args.adapters, settings=settings, device=device)
    if args.ui:
        mount_page(app, src=args.model, path=PAGE_PATH, examples=args.examples)
        print(f"the page: http://{args.host}:{args.port}{PAGE_PATH} (chat, evidence, model card)", flush=True)
    print(f"serving {settings.name!r} at http://{args.host}:{args.port}/v1 (OpenAI chat completions; Ctrl-C stops)",
          flush=True)
    run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP API over a trained model (/v1/chat/completions)")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: "
                       "$MMADAPT_API_KEY; neither: no key)")
    serve.add_argument("--served-model-name", default=None, help="the name requests give as `model` (default: the "
                       "model directory's name, the run's for OUT/model)")
    serve.add_argument("--image-root", default=None, help="allow image_url / video_url paths under this directory "
                       "(resolved; .. and symlinks may not leave it). Default: no local files")
    serve.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image and video URLs (off by "
                       "default: the server would fetch whatever a client names)")
    serve.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024, help="largest encoded image "
                       "(default 20 MiB); the pixel limit is the model's max_image_pixels")
    serve.add_argument("--max-request-bytes", type=int, default=64 * 1024 * 1024, help="largest request body "
                       "(default 64 MiB)")
    serve.add_argument("--max-queue", type=int, default=16, help="requests that may wait behind the running one; "
                       "one more gets 429 with Retry-After (default 16)")
    serve.add_argument("--max-tokens", type=int, default=512, help="max_tokens of a request that sets none "
                       "(default 512)")
    serve.add_argument("--max-tokens-limit", type=int, default=8192, help="the most max_tokens a request may ask "
                       "for (default 8192)")
    serve.add_argument("--device", default="auto", help="where the model runs: auto (cuda when available, else "
                       "where it loads: cpu), cpu, cuda, cuda:1, ...")
    serve.add_argument("--ui", action="store_true", help=f"also serve a web page at {PAGE_PATH}: chat with images, "
                       "the evidence map of each answer, the model card (needs gradio: pip install 'mmadapt[ui]')")
    serve.add_argument("--examples", default=None, help="--ui: a LLaVA / messages file whose first single-image "
                       "questions are the page's examples (default: the run's data.eval, else sample photographs)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(func=cmd_serve)
