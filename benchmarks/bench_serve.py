"""Generation speed: `mmadapt serve` (through HTTP) and mmadapt's `generate` against transformers' `generate` on the
exported model - the same prompt, image and greedy tokens, on the CPU.

    python benchmarks/bench_serve.py [--quick] [--reps N] [--tokens N] [--out FILE]

The model: a random Qwen3.5-0.8B-shaped VLM (`qwen3_5_vit` + `qwen_merger` + `qwen3_5`, preset `qwen3.5-0.8b`: text
hidden 1024, vision hidden 768) at reduced depth (full run: 4 text layers - three Gated DeltaNet and one attention, the
real 3:1 pattern - and 2 vision blocks; `--quick`: 2 text layers, 1 vision block), with Qwen's real tokenizer (vendored
in tests/fixtures, 151,669 tokens; the vocabulary follows it) and Qwen3.5's template, in fp32. It is exported with
`save_pretrained(dir, format="transformers", processor_export=export_processor)` and transformers'
`AutoModelForImageTextToText` loads the export; mmadapt's `generate` and the server (`create_app`) use the model in
memory. One prompt: a 256 x 256 image (64 visual tokens) and a question.

Timed, alternating, `--reps` times each (medians):
- transformers: `generate(**inputs, do_sample=False, max_new_tokens=N, min_new_tokens=N)` on the export, the first
  token's time taken by a streamer;
- mmadapt generate: `VisionLanguageModel.generate` on the same inputs (no end token, N tokens), the first token's
  time taken by `on_token`;
- mmadapt serve: a streamed `POST /v1/chat/completions` with the image as a data URL, through the `openai` client,
  to `mmadapt serve`'s app on a local uvicorn server; the first token's time is the first chunk that carries a token.
  Its TTFT counts what the other two start from ready: the request, the image's decoding and the Processor (chat
  template, tokenization, image preprocessing), then the event stream.
TTFT: time to the first token (the prompt's prefill, the vision tower included; for the server, to the first chunk
carrying a token). Decode tokens/s: the tokens after those over the time after them. The ratios are mmadapt /
transformers: TTFT < 1 and tokens/s > 1 mean mmadapt is faster (the goal: tokens/s >= 1.0x). Every run checks that
mmadapt's and transformers' greedy tokens are equal.
"""

from __future__ import annotations

import argparse
import base64
import io
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the vendored real tokenizer

QUESTION = "Describe the picture in detail."


def build(quick: bool) -> tuple[Any, Any, str]:
    """The random model with Qwen's tokenizer and Qwen3.5's template; (model, tokenizer, description)."""
    from real_tokenizers import real_tokenizer

    import mmadapt
    from mmadapt import Processor

    layers = ["linear_attention", "full_attention"] if quick else ["linear_attention"] * 3 + ["full_attention"]
    blocks = 1 if quick else 2
    torch.manual_seed(0)
    model = mmadapt.build_model({"name": "qwen3_5_vit", "preset": "qwen3.5-0.8b", "options": {"depth": blocks}},
                                "qwen_merger",
                                {"name": "qwen3_5", "preset": "qwen3.5-0.8b",
                                 "options": {"num_hidden_layers": len(layers), "layer_types": layers}}).eval()
    tokenizer = real_tokenizer("qwen3")
    Processor.for_model(model, tokenizer, chat_template="qwen3_5")  # adds / aligns the span tokens
    described = (f"Qwen3.5-0.8B widths (text hidden 1024, vision hidden 768), {len(layers)} text layers "
                 f"({', '.join(layers)}), {blocks} vision block(s) of 12, vocabulary {len(tokenizer):,}, fp32, "
                 f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
    return model, tokenizer, described


def picture() -> Image.Image:
    rng = np.random.default_rng(0)
    smooth = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    return Image.fromarray(smooth).resize((256, 256), Image.Resampling.BICUBIC)


def time_transformers(theirs: Any, inputs: dict[str, Any], tokens: int) -> tuple[float, float, list[int], int]:
    """(TTFT s, total s, tokens, 1) of transformers' greedy generate."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls, self.first = 0, None

        def put(self, value: torch.Tensor) -> None:
            self.calls += 1
            if self.calls == 2:  # the first put is the prompt
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    streamer = FirstToken()
    start = time.perf_counter()
    with torch.no_grad():
        out = theirs.generate(**inputs, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                              streamer=streamer)
    end = time.perf_counter()
    return streamer.first - start, end - start, out[0, inputs["input_ids"].shape[1]:].tolist(), 1


def time_generate(model: Any, inputs: dict[str, Any], tokens: int) -> tuple[float, float, list[int], int]:
    """(TTFT s, total s, tokens, 1) of mmadapt's greedy generate."""
    first: list[float] = []
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=tokens, eos_token_id=None,
                         on_token=lambda token: first or first.append(time.perf_counter()))
    end = time.perf_counter()
    return first[0] - start, end - start, out[0].tolist(), 1


def time_serve(client: Any, url: str, tokens: int) -> tuple[float, float, list[int], int]:
    """(TTFT s, total s, tokens, tokens in the first chunk) of a streamed request to the server (a chunk may carry
    several tokens: text that may be an incomplete character is held back until the next token)."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]
    ids: list[int] = []
    first, in_first = None, 0
    start = time.perf_counter()
    for chunk in client.chat.completions.create(model="bench", messages=messages, temperature=0, max_tokens=tokens,
                                                stream=True, extra_body={"return_token_ids": True}):
        got = chunk.choices[0].token_ids if chunk.choices else None
        if got and first is None:
            first, in_first = time.perf_counter(), len(got)
        ids += got or []
    end = time.perf_counter()
    return first - start, end - start, ids, in_first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 text layers, 1 vision block, 8 tokens, 1 rep")
    parser.add_argument("--reps", type=int, default=None, help="timed runs of each (default 3; --quick 1)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per answer (default 64; --quick 8)")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = parser.parse_args()
    reps, tokens = args.reps or (1 if args.quick else 3), args.tokens or (8 if args.quick else 64)
    import openai
    import transformers
    from transformers import AutoModelForImageTextToText

    from mmadapt.answering import PromptInputs as Prompt
    from mmadapt.processor import Processor, export_processor
    from mmadapt.serve import BackgroundServer, ServeSettings, create_app

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model, tokenizer, described = build(args.quick)
    processor = Processor.for_model(model, tokenizer)
    image = picture()
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    inputs = Prompt.build(model, processor, messages).inputs
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "export", format="transformers", tokenizer=tokenizer,
                              processor_export=export_processor)
        theirs = AutoModelForImageTextToText.from_pretrained(Path(tmp) / "export").eval()
    theirs_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "pixel_values",
                                                              "image_grid_thw", "mm_token_type_ids")}
    app = create_app(model, processor, ServeSettings(name="bench", max_tokens_limit=max(tokens, 8192)))
    times: dict[str, list[tuple[float, float, list[int], int]]] = {"transformers": [], "generate": [], "serve": []}
    with BackgroundServer(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=600)
        runs = {"transformers": lambda: time_transformers(theirs, theirs_inputs, tokens),
                "generate": lambda: time_generate(model, inputs, tokens),
                "serve": lambda: time_serve(client, url, tokens)}
        for run in runs.values():  # warm-up
            run()
        for _ in range(reps):
            for name, run in runs.items():
                times[name].append(run())
    reference = times["transformers"][0][2]
    for name in ("generate", "serve"):
        got = times[name][0][2]
        if got[:len(reference)] != reference[:len(got)]:
            raise SystemExit(f"{name}'s greedy tokens differ from transformers': {got} vs {reference}")
    print(table(times, described, tokens, reps, inputs, processor))
    if args.out:
        Path(args.out).write_text(table(times, described, tokens, reps, inputs, processor) + "\n")


def table(times: dict[str, list[tuple[float, float, list[int], int]]], described: str, tokens: int, reps: int,
          inputs: dict[str, Any], processor: Any) -> str:
    import transformers

    def medians(name: str) -> tuple[float, float, int]:
        runs = times[name]
        ttft = statistics.median(r[0] for r in runs)
        speed = statistics.median((len(r[2]) - r[3]) / (r[1] - r[0]) for r in runs)
        return ttft, speed, len(runs[0][2])

    base_ttft, base_speed, _ = medians("transformers")
    visual = int((inputs["input_ids"] == processor.encoder.image_token_id).sum())
    lines = [f"### Generation: {tokens} greedy tokens after one image ({visual} visual tokens) and a question "
             f"({inputs['input_ids'].shape[1]} prompt tokens)", "",
             f"Model: random, {described}. Machine: {platform.machine()}, {torch.get_num_threads()} threads; "
             f"torch {torch.__version__}, transformers {transformers.__version__}; medians of {reps} run(s).", "",
             "| path | TTFT ms | decode tokens/s | tokens | TTFT ratio | tokens/s ratio |", "|---|---|---|---|---|---|"]
    names = {"transformers": "transformers generate (AutoModelForImageTextToText, the export)",
             "generate": "mmadapt generate (VisionLanguageModel.generate)",
             "serve": "mmadapt serve (HTTP, streamed, openai client)"}
    for name, label in names.items():
        ttft, speed, count = medians(name)
        lines.append(f"| {label} | {ttft * 1000:.0f} | {speed:.1f} | {count} | {ttft / base_ttft:.2f}x | "
                     f"{speed / base_speed:.2f}x |")
    lines.append("")
    lines.append("Ratios: mmadapt / transformers (TTFT < 1x and tokens/s > 1x: mmadapt faster; goal tokens/s >= 1.0x). "
                 "The greedy tokens of all three are equal.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
