"""`mmadapt serve MODEL`: the OpenAI-compatible API over a trained model (`mmadapt.serve`), bound to 127.0.0.1."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from mmadapt.cli.common import add_model_arguments

log = logging.getLogger(__name__)
PAGE_PATH = "/ui"
BUDGET_FLAGS = {"max_images": "max_images", "max_pixels": "max_request_pixels", "max_videos": "max_videos",
                "max_frames": "max_frames", "max_video_bytes": "max_video_decoded_bytes",
                "max_text_chars": "max_text_chars", "decode_slots": "decode_slots"}
"""`RequestBudget` settings -> their flags' argparse names (a flag not given: the budget's default)."""


def cmd_serve(args: argparse.Namespace) -> int:
    """Load MODEL and serve it until interrupted."""
    try:
        from mmadapt.serve import MediaPolicy, RequestBudget, ServeSettings, default_name, load_app, run
    except ImportError as e:
        raise ValueError(f"mmadapt serve needs FastAPI and uvicorn ({e}); install them: pip install 'mmadapt[serve]'"
                         ) from None
    key = args.api_key if args.api_key is not None else os.environ.get("MMADAPT_API_KEY") or None
    if args.api_key is not None:
        logging.basicConfig(level=logging.INFO)
        log.warning("--api-key puts the key on the command line, where other users of this machine see it (ps); "
                    "pass it as MMADAPT_API_KEY instead")
    if args.image_root is not None and not Path(args.image_root).is_dir():
        raise FileNotFoundError(f"--image-root {args.image_root} is not a directory")
    settings = ServeSettings(
        name=args.served_model_name or default_name(args.model), api_key=key,
        media=MediaPolicy(image_root=Path(args.image_root) if args.image_root else None,
                          allow_remote=args.allow_remote_images, max_image_bytes=args.max_image_bytes,
                          max_video_bytes=args.max_video_file_bytes, remote_networks=tuple(args.remote_network),
                          remote_timeout=args.remote_timeout),
        max_queue=args.max_queue, default_max_tokens=args.max_tokens, max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes, body_timeout=args.body_timeout, header_timeout=args.header_timeout,
        max_connections=args.max_connections, allowed_hosts=tuple(args.allowed_hosts),
        budget=RequestBudget(**{name: getattr(args, dest) for name, dest in BUDGET_FLAGS.items()
                                if getattr(args, dest) is not None}))
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
    limits = page_limits(args)
    app = load_app(args.model, args.adapters, settings=settings, device=device)
    if args.ui:
        mount_page(app, src=args.model, path=PAGE_PATH, examples=args.examples, limits=limits)
        print(f"the page: http://{args.host}:{args.port}{PAGE_PATH} (chat, evidence, model card)", flush=True)
    print(f"serving {settings.name!r} at http://{args.host}:{args.port}/v1 (OpenAI chat completions; Ctrl-C stops)",
          flush=True)
    run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def page_limits(args: argparse.Namespace) -> Any:
    """The page's `PageLimits` from the flags given (the others: its defaults); None without --ui, where they are a
    warning (they bound what the page keeps)."""
    given = {name: value for name, value in (("sessions", args.page_sessions),
                                             ("session_bytes", args.page_session_bytes)) if value is not None}
    if not args.ui:
        if given:
            logging.basicConfig(level=logging.INFO)
            log.warning("--page-sessions / --page-session-bytes have no effect without --ui")
        return None
    from mmadapt.serve.budget import PageLimits

    return PageLimits(**given)


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP API over a trained model (/v1/chat/completions)")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: "
                       "$MMADAPT_API_KEY, the way to pass it: a command line is visible to other users; neither: no "
                       "key)")
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
    serve.add_argument("--max-video-file-bytes", type=int, default=256 * 1024 * 1024, help="largest encoded video "
                       "(default 256 MiB)")
    budget = serve.add_argument_group("what one request (or a page's conversation) may hold, checked before "
                                      "decoding (default: the model's data settings, the limits training had)")
    budget.add_argument("--max-images", type=int, default=None, help="images (default: data setting max_images)")
    budget.add_argument("--max-request-pixels", type=int, default=None, help="pixels of all its images, from their "
                        "headers (default: data setting max_sample_pixels)")
    budget.add_argument("--max-videos", type=int, help="videos (default 4)")
    budget.add_argument("--max-frames", type=int, default=None, help="video frames as sampled, from their headers "
                        "(default: data setting max_sample_frames)")
    budget.add_argument("--max-video-decoded-bytes", type=int, default=None, help="bytes of its decoded video "
                        "frames, from their headers (default: data setting max_video_bytes)")
    budget.add_argument("--max-text-chars", type=int, help="characters of text, before tokenising (default 262144)")
    budget.add_argument("--decode-slots", type=int, help="requests that decode their images at once, after taking "
                        "their queue place (default 2)")
    serve.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive "
                       "(default 30; 408 after)")
    serve.add_argument("--header-timeout", type=float, default=10.0, help="seconds a request's head (request line "
                       "and headers) may take to arrive, from the connection's start or its previous answer "
                       "(default 10; the connection is closed after)")
    serve.add_argument("--max-connections", type=int, default=64, help="open connections at once (default 64; "
                       "503 beyond)")
    serve.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME", help="Host names the server "
                       "answers to besides localhost and the address it binds (a proxy's or this machine's name); "
                       "'*' turns the check off")
    serve.add_argument("--remote-network", action="append", default=[], metavar="CIDR", help="with "
                       "--allow-remote-images: a private network remote images may come from (e.g. 10.1.0.0/16; "
                       "default: public addresses only)")
    serve.add_argument("--remote-timeout", type=float, default=10.0, help="with --allow-remote-images: seconds one "
                       "fetch may take in total, connecting, headers and body together, redirects included "
                       "(default 10)")
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
    serve.add_argument("--page-sessions", type=int, default=None, help="--ui: conversations the page keeps, one "
                       "per open page; the least recently used beyond are forgotten (default 32)")
    serve.add_argument("--page-session-bytes", type=int, default=None, help="--ui: decoded bytes (width x height x "
                       "3) of the images one page conversation may hold (default 64 MiB)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(func=cmd_serve)
