"""Streaming an answer with stop strings: the time per token does not grow with the answer (issue 46).

    python benchmarks/bench_stop_strings.py [--quick] [--reps N] [--old-up-to N]

An answer of 1k, 2k, 4k and 8k tokens of Qwen3's real tokenizer (vendored in tests/fixtures; English with CJK and
emoji, some characters split into byte tokens), streamed token by token through `mmadapt.text_stream.TextStream` as
`Decoding` streams it, with four stop strings of the longest allowed length (`MAX_STOP_CHARS`, 256 characters) that
never match but whose first 255 characters are in the text, so the held-back text is as long as it can be. Beside
it, the stream as it was before (inlined below, `FullDecode`): every token decoded all the ids, searched each stop
string in the whole text and tried every prefix length of each. Medians of `--reps` runs (default 3; the old stream
once, up to `--old-up-to` tokens).

Measured on the shared 2-core machine (python 3.11, transformers 5.25, `--reps 5`; other work running, so +-30%):

| tokens | stream ms | us / token | before: ms | before: us / token | before / stream |
|---:|---:|---:|---:|---:|---:|
| 1000 | 12 | 12 | 248 | 248 | 20.5x |
| 2000 | 24 | 12 | 744 | 372 | 31.2x |
| 4000 | 48 | 12 | 2283 | 571 | 48.1x |
| 8000 | 138 | 17 | 7713 | 964 | 55.8x |

The stream's time per token is flat (timed per 1,000 tokens over a 16,000-token answer: 11 +- 0.5 us each); the
old one's grows with the answer, its total with the square. Issue 46 measured the old stream at 18 s over 2,000
tokens with four stop strings of 100,000 characters (now refused: at most 256 each).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the vendored real tokenizer

TEXT = ("The picture shows a small harbour at dusk: fishing boats 🚤 tied along a stone quay, nets drying on the "
        "rails, and a lighthouse whose lamp is already lit. 港口的灯塔已经亮了。 Two gulls circle above the water; "
        "one has landed on a mooring post 🐦. In the distance, hills fade into a violet haze, and the first stars "
        "appear.\n\n")


class FullDecode:
    """The stream before it was bounded (mmadapt 0.x `answering.TextStream`): quadratic in the answer's length."""

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None] | None, *,
                 stop: Sequence[str] = ()) -> None:
        self.decode, self.on_text, self.stop = decode, on_text, tuple(stop)
        self.sent = ""

    def update(self, ids: Sequence[int]) -> bool:
        text = self.decode(list(ids)).lstrip()
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.send(text[:max(min(found), len(self.sent))].rstrip())
            return True
        self.send(text[:len(text) - self.unsure(text)])
        return False

    def unsure(self, text: str) -> int:
        starts = [k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])]
        settled = len(text) - max(starts, default=0)
        while settled and (text[settled - 1].isspace() or text[settled - 1] == "\ufffd"):
            settled -= 1
        return len(text) - settled

    def send(self, so_far: str) -> None:
        if len(so_far) > len(self.sent):
            if self.on_text is not None:
                self.on_text(so_far[len(self.sent):])
            self.sent = so_far


def answer_ids(tokenizer: Any, tokens: int) -> list[int]:
    """`tokens` ids of TEXT repeated, every emoji split into one byte token per UTF-8 byte."""
    from mmadapt.answering import _byte_level_table

    byte_ids = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _byte_level_table().items()}
    ids: list[int] = []
    for piece in TEXT.replace("🚤", "\0🚤\0").replace("🐦", "\0🐦\0").split("\0"):
        ids += ([byte_ids[b] for b in piece.encode()] if piece in ("🚤", "🐦")
                else tokenizer.encode(piece, add_special_tokens=False))
    return (ids * (tokens // len(ids) + 1))[:tokens]


def time_stream(kind: type, decode: Callable[[list[int]], str], ids: list[int], stop: list[str]) -> float:
    """Seconds to stream `ids` one at a time (the ids so far in one list, as `Decoding` keeps them)."""
    stream, so_far = kind(decode, lambda piece: None, stop=stop), []
    start = time.perf_counter()
    for token in ids:
        so_far.append(token)
        if stream.update(so_far):
            raise AssertionError("a stop string matched; the benchmark's never should")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1k and 2k tokens, one run each (a smoke run)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs of the stream (default 3; --quick 1)")
    parser.add_argument("--old-up-to", type=int, default=8000, help="the longest answer the old stream runs")
    args = parser.parse_args()
    from real_tokenizers import real_tokenizer

    from mmadapt.sampling import MAX_STOP_CHARS
    from mmadapt.text_stream import TextStream

    tokenizer = real_tokenizer("qwen3")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    reps, sizes = args.reps or (1 if args.quick else 3), (1000, 2000) if args.quick else (1000, 2000, 4000, 8000)
    text = decode(answer_ids(tokenizer, 2000))
    stops = [text[k:k + MAX_STOP_CHARS - 1] + "\0" for k in (0, 150, 300, 450)]
    print(f"machine: {platform.machine()}, python {platform.python_version()}; Qwen3 tokenizer, four stop strings of "
          f"{MAX_STOP_CHARS} characters that never match\n")
    print("| tokens | stream ms | us / token | before: ms | before: us / token | before / stream |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tokens in sizes:
        ids = answer_ids(tokenizer, tokens)
        new = statistics.median(time_stream(TextStream, decode, ids, stops) for _ in range(reps))
        old = time_stream(FullDecode, decode, ids, stops) if tokens <= args.old_up_to else None
        before = "| - | - | - |" if old is None else \
            f"| {old * 1e3:.0f} | {old * 1e6 / tokens:.0f} | {old / new:.1f}x |"
        print(f"| {tokens} | {new * 1e3:.0f} | {new * 1e6 / tokens:.0f} {before}", flush=True)


if __name__ == "__main__":
    main()
