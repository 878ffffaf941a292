"""Token ids in, answer text out while the answer is generated (`TextStream`), at a cost per token that does not grow
with the answer.

`mmadapt.answering.Decoding` streams every answer through it (`mmadapt chat`, the server, the page). The text it
builds is the tokenizer's decoding of all the ids (special tokens skipped, whitespace stripped at both ends, as
`Processor.decode` gives it), cut before the first stop string; what it sends is held back while it may still change
(trailing whitespace, an incomplete character, a possible start of a stop string). Three parts, each bounded:

- `TokenText`: incremental detokenization (vLLM's prefix / read offsets; transformers' `TextStreamer` does the same
  per line). A step decodes only a window: the context (ids already turned into text, decoded again so that a
  SentencePiece tokenizer's leading space comes out as it does inside the whole text) and the ids not settled yet,
  and gives the text they added. Ids are settled once their text does not end in U+FFFD (a character split across
  tokens); the window restarts at the last settled ids once it holds over `WINDOW` ids. A step decodes at most
  `WINDOW` + `PATIENCE` + 1 ids, and when it settles at most three decodings more of no more ids.
- `StopSearch`: the stop strings, found as the text grows, each settled character read once per stop string
  (Knuth-Morris-Pratt: the automaton's state is the longest start of the stop string the text ends with, so a new
  match can only end in new text, and the state is also what to hold back: linear in the stop string's length).
- `TextStream`: the held-back end is looked for only in the text a step added and the `max(len(stop)) - 1`
  characters before it: whatever was held back before that is whitespace or U+FFFD.

Per token: O(`WINDOW` + `PATIENCE` ids decoded + the characters they add + the longest stop string
(`mmadapt.sampling.MAX_STOP_CHARS`)), whatever the answer's length (tests/test_stop_strings.py counts it,
benchmarks/bench_stop_strings.py times it). `finish` decodes all the ids once: the answer is the tokenizer's text.

Exact: each step's text is the decoding of all the ids so far, wherever decoding is local - byte-level BPE (Qwen,
GPT-2), invalid bytes included, and SentencePiece (Llama, Mistral) with its leading space. One exception: while a
character spelled in SentencePiece byte pieces (`<0xE4>`) is incomplete, the byte-fallback decoder turns the whole
run of byte pieces before it into U+FFFD, which only the whole text shows (the run is unbounded); the stream sees
the run's complete characters (what decoding byte by byte gives) and may send them a token sooner. Text that keeps
ending in U+FFFD for over `PATIENCE` ids (invalid bytes) is settled where decoding both sides apart gives the same
text (`TokenText.force`), else whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what an incomplete or invalid character decodes to
WINDOW = 16  # ids kept as context at most before the window restarts at the last settled ids
PATIENCE = 8  # unsettled ids whose text still ends in U+FFFD before they are settled anyway (invalid bytes)
TAIL = 3  # ids kept unsettled when settling anyway: an incomplete character's bytes (at most 3) lie in the last 3


class TokenText:
    """Incremental detokenization: `push(ids)` takes the next ids and gives (settled, pending): `settled` the text
    they settled, for good; `pending` the text of the ids not settled yet (it ends in U+FFFD, or is empty).
    `decode(ids)` is the tokenizer's decoding (special tokens skipped, nothing stripped)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []  # the window: context ids (already settled), then unsettled ids
        self.read = 0  # ids[:read] is the context
        self.context = ""  # decode(ids[:read])

    def push(self, ids: Sequence[int]) -> tuple[str, str]:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        new = text[len(self.context):]
        if new and not new.endswith(REPLACEMENT):
            return self.settle(len(self.ids), text), ""
        if len(self.ids) - self.read <= PATIENCE:
            return "", new
        if not new:  # ids that add no text (skipped special tokens): dropped, the context kept
            del self.ids[self.read:]
            return "", ""
        return self.force(text)

    def force(self, text: str) -> tuple[str, str]:
        """Text that keeps ending in U+FFFD (invalid bytes): settled but for the last `TAIL` ids, which may still
        complete a character, when cutting there gives the same text (a boundary between characters); else all."""
        cut = len(self.ids) - TAIL
        head = self.decode(self.ids[:cut])
        if len(head) > len(self.context) and head + self.decode(self.ids[cut:]) == text:
            return self.settle(cut, head), text[len(head):]
        return self.settle(len(self.ids), text), ""

    def settle(self, upto: int, text: str) -> str:
        """Settle ids[:upto] (`text` their decoding): the text they added; the window restarts when it is long."""
        added = text[len(self.context):]
        if upto > WINDOW:  # the ids since the last settled point become the context
            del self.ids[:self.read]
            upto -= self.read
            text = self.decode(self.ids[:upto])
        self.read, self.context = upto, text
        return added


class StopSearch:
    """Stop strings in a text that grows: `scan(settled, pending)` reads the text a step settled (for good) and its
    pending end (read again next step), and gives (where the earliest stop string found begins, relative to the
    start of `settled`: negative when it began in earlier text; None: none found) and the length of the longest start
    of a stop string the text ends with. One Knuth-Morris-Pratt automaton per stop string: each settled character is
    read once per stop string. `examined` counts the characters read."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.borders = [_borders(stop) for stop in self.stops]
        self.states = [0] * len(self.stops)  # after the settled text
        self.examined = 0

    def scan(self, settled: str, pending: str) -> tuple[int | None, int]:
        states, found = self.read(self.states, settled)
        if found is not None:
            return found, 0
        self.states = states
        live, found = self.read(states, pending)
        return (None if found is None else len(settled) + found), max(live, default=0)

    def read(self, states: list[int], text: str) -> tuple[list[int], int | None]:
        """The states after `text`, and where in it the earliest stop string that ends in it begins."""
        after, found = [], None
        for stop, border, state in zip(self.stops, self.borders, states, strict=True):
            state, end = _advance(stop, border, state, text)
            self.examined += len(text) if end < 0 else end
            if end >= 0 and (found is None or end - len(stop) < found):
                found = end - len(stop)
            after.append(state)
        return after, found


def _borders(stop: str) -> list[int]:
    """border[i]: the length of the longest proper prefix of stop[:i + 1] that is also a suffix of it (KMP)."""
    border, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        if stop[i] == stop[k]:
            k += 1
        border[i] = k
    return border


def _advance(stop: str, border: list[int], state: int, text: str) -> tuple[int, int]:
    """`stop`'s automaton from `state` (the matched length) over `text`: (the state after it, the end of the first
    whole match in `text`, or -1)."""
    for i, c in enumerate(text):
        while state and stop[state] != c:
            state = border[state - 1]
        if stop[state] == c:
            state += 1
            if state == len(stop):
                return state, i + 1
    return state, -1


def _solid(c: str) -> bool:
    """A character the answer cannot end before: not whitespace (stripped at the end), not U+FFFD (incomplete)."""
    return not (c.isspace() or c == REPLACEMENT)


class TextStream:
    """Token ids in, answer text out: `on_text` gets what the answer gained, once it is sure.

    `decode(ids)` is the tokenizer's decoding (special tokens skipped, nothing stripped); the answer is that text
    without its leading and trailing whitespace (`Processor.decode`), cut before the first `stop` string, which is
    searched in the text itself (so a stop string of whitespace, "\n\n", is found as it appears). Held back until
    the next token settles them: trailing whitespace (the answer may end there), an incomplete character (decoded as
    U+FFFD) and an end that may be the start of a stop string. `update(ids)` (the ids so far; each call extends the
    last) returns True when a stop string has appeared; `finish(ids)` sends the rest and returns the whole answer.
    Each `update` costs the same whatever the answer's length (module docstring).
    """

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None] | None, *,
                 stop: Sequence[str] = ()) -> None:
        self.decode, self.on_text = decode, on_text
        self.tokens, self.search = TokenText(decode), StopSearch(stop)
        self.keep = max(map(len, stop), default=1) - 1  # settled characters a new stop string may begin in
        self.count = 0  # ids read
        self.length = 0  # settled characters (the text from its first non-whitespace character on)
        self.tail = ""  # the last `keep` settled characters
        self.held: list[str] = []  # the settled text not sent yet
        self.ahead = 0  # characters sent beyond the settled text (of the pending end)
        self.sent: list[str] = []
        self.sent_length = 0
        self.final: str | None = None  # the answer, once a stop string ended it
        self.scanned = 0  # characters of held-back text looked at

    @property
    def examined(self) -> int:
        """The characters looked at so far: stop strings searched, held-back text scanned."""
        return self.search.examined + self.scanned

    def update(self, ids: Sequence[int]) -> bool:
        """The tokens so far: send what is sure; True if a stop string appeared."""
        settled, pending = self.tokens.push(ids[self.count:])
        self.count = len(ids)
        if not self.length:  # the leading whitespace is not the answer's
            settled = settled.lstrip()
            pending = pending if settled else pending.lstrip()
        found, unsure = self.search.scan(settled, pending)
        start, region = self.length - len(self.tail), self.tail + settled + pending  # where anything new can be
        found = None if found is None else self.length + found
        self.absorb(settled)
        if found is not None:
            self.final = (self.sent_text() + self.unsent(pending)[:max(found - self.sent_length, 0)]).rstrip()
            self.emit(self.final[self.sent_length:])
            return True
        end = self.sure_end(region, start, len(region) - unsure)
        if end > self.sent_length:
            self.send(end, pending)
        return False

    def finish(self, ids: Sequence[int]) -> str:
        """All the tokens: the rest is sent; the whole answer, cut before a stop string."""
        if self.final is None:
            self.final = self.decode(list(ids)).strip()
            self.emit(self.final[self.sent_length:])
        return self.final

    def absorb(self, settled: str) -> None:
        """Settled text joins the held text (less what was already sent ahead of it)."""
        skip = min(self.ahead, len(settled))
        self.ahead -= skip
        if len(settled) > skip:
            self.held.append(settled[skip:])
        self.length += len(settled)
        self.tail = (self.tail + settled)[-self.keep:] if self.keep else ""

    def sure_end(self, region: str, start: int, cut: int) -> int:
        """Where the sure text ends: after the last solid character before `cut` (in `region`, which begins at
        `start`); none after what was sent: the text sent. A solid character after the sent text lies in the region:
        before it, the last step held back only whitespace and U+FFFD."""
        low = max(self.sent_length - start, 0)
        while cut > low and not _solid(region[cut - 1]):
            cut -= 1
            self.scanned += 1
        return start + cut if cut > low else self.sent_length

    def unsent(self, pending: str) -> str:
        return "".join(self.held) + pending[self.ahead:]

    def sent_text(self) -> str:
        return "".join(self.sent)

    def send(self, end: int, pending: str) -> None:
        """Send the text up to `end`; what is settled after it stays held."""
        text = self.unsent(pending)
        self.scanned += len(text)
        piece, rest = text[:end - self.sent_length], self.length - end
        self.held = [text[len(piece):len(piece) + rest]] if rest > 0 else []
        self.ahead = max(-rest, 0)
        self.emit(piece)

    def emit(self, piece: str) -> None:
        if piece:
            self.sent.append(piece)
            self.sent_length += len(piece)
            if self.on_text is not None:
                self.on_text(piece)
