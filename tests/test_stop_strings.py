"""Stop strings bounded in length and an answer streamed at a constant cost per token (`mmadapt.text_stream`).

Exact: the stream (a window of ids decoded per step, stop strings searched in the new text only) sends the same
pieces, stops at the same token and gives the same answer as `FullDecode` below - the stream as it was when every
step decoded all the ids and searched the whole text - with Qwen3's byte-level BPE and the Mistral / Llama
SentencePiece tokenizer (vendored, `real_tokenizers`), over token sequences made to break it: characters split into
byte tokens, emoji, CJK, whitespace runs, skipped special tokens, random ids (invalid bytes), stop strings across
tokens and of whitespace. Bounded: counted, not timed - the ids decoded and the characters looked at per token over
an 8k-token answer with four stop strings of the longest allowed length are those over a 1k-token answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

import pytest
from real_tokenizers import real_tokenizer

from mmadapt.answering import _byte_level_table
from mmadapt.sampling import MAX_STOP_CHARS, Sampling
from mmadapt.serve.errors import APIError
from mmadapt.serve.protocol import parse_request, request_sampling
from mmadapt.text_stream import PATIENCE, WINDOW, TextStream

FRAGMENTS = ("Hello", " wörld", " 😀", "中文", "日本語の", "\n\n", "   ", "\t", " 🦜🦜", "é", "👩\u200d👩\u200d👧",
             " x", ".", " Line", "\n", "ﬁ", "\ufffd", "\u3000", " 𝔘", "STOP", "ab", "a")


class FullDecode:
    """The reference: every step decodes all the ids and searches the whole text (the stream before it was bounded;
    quadratic in the answer's length)."""

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None] | None, *,
                 stop: Sequence[str] = ()) -> None:
        self.decode, self.on_text, self.stop = decode, on_text, tuple(stop)
        self.sent = ""
        self.final: str | None = None

    def update(self, ids: Sequence[int]) -> bool:
        text = self.decode(list(ids)).lstrip()
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.final = text[:max(min(found), len(self.sent))].rstrip()
            self.send(self.final)
            return True
        self.send(text[:len(text) - self.unsure(text)])
        return False

    def finish(self, ids: Sequence[int]) -> str:
        if self.final is None:
            self.final = self.decode(list(ids)).strip()
            self.send(self.final)
        return self.final

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


def stream(kind: type, decode: Callable[[list[int]], str], ids: Sequence[int],
           stop: Sequence[str]) -> tuple[list[str], str, int | None]:
    """Feed `ids` one at a time: (the pieces sent, the answer, the number of ids when a stop string ended it)."""
    pieces: list[str] = []
    text_stream, so_far = kind(decode, pieces.append, stop=stop), []
    for token in ids:
        so_far.append(token)
        if text_stream.update(so_far):
            return pieces, text_stream.finish(so_far), len(so_far)
    return pieces, text_stream.finish(so_far), None


def assert_streams_alike(decode: Callable[[list[int]], str], ids: Sequence[int], stop: Sequence[str]) -> None:
    expected = stream(FullDecode, decode, ids, stop)
    got = stream(TextStream, decode, ids, stop)
    assert got == expected, f"ids {list(ids)}, stop {stop!r}"
    assert "".join(got[0]) == got[1]


# ---- the tokenizers and the sequences made to break the stream -----------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    tokenizer = real_tokenizer("qwen3")
    byte_ids = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _byte_level_table().items()}
    special = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>", "<|vision_start|>"])
    return tokenizer, byte_ids, special


@pytest.fixture(scope="module")
def llama():
    tokenizer = real_tokenizer("llama2")
    byte_ids = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    return tokenizer, byte_ids, [tokenizer.bos_token_id, tokenizer.eos_token_id]


def decoder(tokenizer) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def local_decoder(tokenizer) -> Callable[[list[int]], str]:
    """A SentencePiece tokenizer's decoding, byte by byte: its pieces' bytes (`<0xE4>` one byte, `▁` a space) as
    UTF-8, the first space dropped. The tokenizer's own text for valid UTF-8; while a character is incomplete it
    gives one U+FFFD where the tokenizer's byte-fallback decoder replaces the whole run of byte pieces (so the whole
    text, not a window, would be needed to decode as it does)."""
    special = set(tokenizer.all_special_ids)
    table = [bytes([int(p[3:5], 16)]) if re.fullmatch(r"<0x[0-9A-F]{2}>", p) else p.replace("▁", " ").encode()
             for p in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]

    def decode(ids: list[int]) -> str:
        text = b"".join(table[i] for i in ids if i not in special).decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text

    return decode


def made_to_break(tokenizer, byte_ids: dict[int, int], special: list[int], rng: random.Random,
                  fragments: int = 40, runs: bool = True) -> list[int]:
    """Fragments encoded whole, or one byte token per UTF-8 byte (characters split across tokens), with skipped
    special tokens between them (sometimes a run longer than the stream waits for). Without `runs`, byte tokens
    only for one character between whole tokens."""
    ids: list[int] = []
    byte_set = set(byte_ids.values())
    for _ in range(fragments):
        text = rng.choice(FRAGMENTS) * rng.choice((1, 1, 1, 3))
        whole = tokenizer.encode(text, add_special_tokens=False)
        if rng.random() < 0.4 and (runs or len(text) == 1):
            ids += [byte_ids[b] for b in text.encode()]
            ids += [] if runs else tokenizer.encode(" x", add_special_tokens=False)  # a whole token after it
        elif runs or not byte_set.intersection(whole):
            ids += whole
        if special and rng.random() < 0.1:
            ids += [rng.choice(special)] * rng.choice((1, PATIENCE + 3))
    return ids


def stop_strings(text: str, rng: random.Random) -> list[str]:
    """Stop strings for `text`: pieces of it (across tokens, maybe of whitespace), pieces that nearly match, and
    strings that are there only as a start."""
    stops = []
    for _ in range(rng.randint(0, 4)):
        start = rng.randrange(max(len(text), 1))
        piece = text[start:start + rng.randint(1, 12)] or "x"
        kind = rng.random()
        stops.append(piece if kind < 0.4 else piece + "\x00" if kind < 0.7 else
                     rng.choice(("\n\n", " ", "  ", "\n", "😀", "STOP", "aab", "中文\n")))
    return stops


def test_the_stream_equals_decoding_every_id_with_qwens_byte_level_bpe(qwen):
    tokenizer, byte_ids, special = qwen
    rng, decode = random.Random("break-qwen"), decoder(tokenizer)
    for _ in range(60):
        ids = made_to_break(tokenizer, byte_ids, special, rng)
        assert_streams_alike(decode, ids, stop_strings(decode(ids), rng))


def test_the_stream_equals_decoding_every_id_with_a_sentencepiece_tokenizer(llama):
    """Leading spaces (`▁`, dropped at the start of a decoding), byte pieces for one character between whole
    pieces, skipped special tokens."""
    tokenizer, byte_ids, special = llama
    rng, decode = random.Random("break-llama"), decoder(tokenizer)
    for _ in range(60):
        ids = made_to_break(tokenizer, byte_ids, special, rng, runs=False)
        assert_streams_alike(decode, ids, stop_strings(decode(ids), rng))


def test_runs_of_sentencepiece_byte_pieces_stream_as_decoded_byte_by_byte(llama):
    """Runs of characters in byte pieces (emoji, CJK): the tokenizer's decoding of all the ids turns the whole run
    into U+FFFD while its last character is incomplete, which no bounded window can reproduce; the stream is the
    decoding byte by byte (`local_decoder`, the same text once the characters are complete)."""
    tokenizer, byte_ids, special = llama
    rng, local = random.Random("runs-llama"), local_decoder(tokenizer)
    for _ in range(60):
        ids = made_to_break(tokenizer, byte_ids, special, rng)
        text = local(ids)
        assert text == decoder(tokenizer)(ids)
        stop = [s for s in stop_strings(text, rng) if "\ufffd" not in s]
        expected = stream(FullDecode, local, ids, stop)
        assert stream(TextStream, decoder(tokenizer), ids, stop) == expected, f"ids {ids}, stop {stop!r}"


def test_a_split_emoji_a_whitespace_stop_and_a_stop_across_tokens(qwen):
    tokenizer, byte_ids, _ = qwen
    decode = decoder(tokenizer)
    split = [byte_ids[b] for b in " 😀 中".encode()]  # every character in byte tokens
    ids = tokenizer.encode("  Line one.", add_special_tokens=False) + split + \
        tokenizer.encode("\n\nLine two", add_special_tokens=False)
    for stop in ((), ("\n\n",), ("😀",), ("one. 😀 中",), ("e o",), ("two", "Line"), ("\x00",)):
        assert_streams_alike(decode, ids, stop)
    pieces, final, at = stream(TextStream, decode, ids, ("\n\n",))
    assert final == "Line one. 😀 中" and at is not None and not any("\ufffd" in p for p in pieces)


def test_random_qwen_ids_invalid_bytes_included(qwen):
    """Random ids of the whole vocabulary: byte pieces that make no character, text that keeps ending in U+FFFD."""
    tokenizer, byte_ids, _ = qwen
    rng, decode = random.Random("ids"), decoder(tokenizer)
    for _ in range(40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 80))]
        ids += [byte_ids[rng.choice((0xE4, 0xF0, 0x9F, 0xB8))] for _ in range(rng.choice((0, 12)))]
        assert_streams_alike(decode, ids, stop_strings(decode(ids), rng))


def test_random_bytes_with_runs_that_never_complete_a_character():
    """One byte per token (the decoder of test_generation.py): lead bytes in runs longer than the stream waits for."""
    rng = random.Random("bytes")

    def by_bytes(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    for _ in range(200):
        ids = [rng.choice((rng.randrange(256), 0xF0, 0xE4, 0x9F, 0x98, 0x20, 0x61)) for _ in range(rng.randint(1, 60))]
        assert_streams_alike(by_bytes, ids, stop_strings(by_bytes(ids), rng))


# ---- bounded: the cost of a token does not grow with the answer ----------------------------------------------------
def costs(tokenizer, ids: list[int], stop: Sequence[str], kind: type = TextStream) -> tuple[int, int, int]:
    """(the most ids decoded in one step, the most characters looked at in one step, the step at which it stopped
    or 0), counted by wrapping the decoder."""
    decoded = [0]

    def decode(window: list[int]) -> str:
        decoded[0] += len(window)
        return tokenizer.decode(window, skip_special_tokens=True)

    text_stream, so_far = kind(decode, None, stop=stop), []
    most_ids = most_chars = 0
    for token in ids:
        so_far.append(token)
        decoded[0], before = 0, getattr(text_stream, "examined", 0)
        if text_stream.update(so_far):
            return most_ids, most_chars, len(so_far)
        most_ids, most_chars = max(most_ids, decoded[0]), max(most_chars, getattr(text_stream, "examined", 0) - before)
    return most_ids, most_chars, 0


@pytest.fixture(scope="module")
def long_answer(qwen):
    """250 tokens of mixed text (characters split into byte tokens, skipped special tokens, text that keeps ending
    in U+FFFD), repeated; and four stop strings of MAX_STOP_CHARS characters that never match but whose first 255
    characters are in the text (the held-back text is as long as it can be)."""
    tokenizer, byte_ids, special = qwen
    rng = random.Random("long")
    block: list[int] = []
    while len(block) < 250:
        block += made_to_break(tokenizer, byte_ids, special, rng, fragments=1)
    block = block[:250]
    n, text = len(decoder(tokenizer)(block)), decoder(tokenizer)(block * 4)
    stops = [text[k:k + MAX_STOP_CHARS - 1] + "\x00" for k in (0, n // 4, n // 2, 3 * n // 4)]
    assert all(len(s) == MAX_STOP_CHARS for s in stops)
    return block, stops


def test_the_cost_of_a_token_does_not_grow_with_the_answer(qwen, long_answer):
    """The most ids decoded and characters looked at in one step: the same over 8,000 tokens as over 1,000, and
    under the bound the window sets."""
    tokenizer = qwen[0]
    block, stops = long_answer
    short, long = costs(tokenizer, block * 4, stops), costs(tokenizer, block * 32, stops)
    assert short[2] == long[2] == 0  # no stop string matched
    assert long[:2] == short[:2]
    assert long[0] <= 2 * (WINDOW + PATIENCE + 1) + PATIENCE + 1 and long[1] < 2 * MAX_STOP_CHARS
    # what the counting measures: decoding every id per step costs twice as much per token over twice the answer
    assert [costs(tokenizer, block[:n], stops, FullDecode)[0] for n in (125, 250)] == [125, 250]


# ---- the limit -----------------------------------------------------------------------------------------------------
def test_a_stop_string_over_the_limit_is_refused_naming_the_limit():
    Sampling(stop=("x" * MAX_STOP_CHARS,) * 4)
    with pytest.raises(ValueError, match=rf"at most {MAX_STOP_CHARS} characters .*stop\[1\] has {MAX_STOP_CHARS + 1}"):
        Sampling(stop=("\n\n", "x" * (MAX_STOP_CHARS + 1)))


@pytest.mark.parametrize(("stop", "error"), [
    (["ok", "x" * (MAX_STOP_CHARS + 1)], rf"at most {MAX_STOP_CHARS} characters; stop\[1\] has"),
    ("x" * (MAX_STOP_CHARS + 1), rf"at most {MAX_STOP_CHARS} characters; stop\[0\] has"),
    (["a", "b", "c", "d", "e"], "up to 4 non-empty strings"),
])
def test_the_server_refuses_a_stop_over_the_limits_with_a_400_on_stop(stop, error):
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": stop})
    with pytest.raises(APIError, match=error) as raised:
        request_sampling(request, default_max_tokens=8, max_tokens_limit=16, seed=0)
    assert raised.value.status == 400 and raised.value.param == "stop"
    accepted = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "stop": ["x" * MAX_STOP_CHARS] * 4})
    sampling = request_sampling(accepted, default_max_tokens=8, max_tokens_limit=16, seed=0)
    assert sampling.stop == ("x" * MAX_STOP_CHARS,) * 4
