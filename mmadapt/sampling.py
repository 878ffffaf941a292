"""The sampling settings, declared once: `Sampling`, each field with its default, its help and - for the settings a
person sets - the range a control offers.

`sampling_settings()` lists those shown settings: `mmadapt chat` adds one flag per setting
(`mmadapt.cli.common.add_sampling_arguments`) and the page one control per setting (`mmadapt.serve.page`), as the data
settings come from `mmadapt.data.config`; so a field added here is a flag and a control at once, and `mmadapt chat`
accepts every setting the page shows. Light on purpose (no torch): the command line's parser reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_CHARS = 256
"""The longest stop string, in characters: the stream looks back this far for each new token (`mmadapt.text_stream`),
so a long stop string costs every token of every answer. OpenAI documents only a count (up to 4), vLLM no limit (it
too searches only the new text and the longest stop string's length before it); stop strings in use are end markers
and turn prefixes ("\\n\\n", "</s>", "Question:", "```"), far shorter, and 256 leaves room for a line of text."""


def shown(help: str, low: float, high: float, step: float) -> dict[str, Any]:
    """A sampling field's metadata: its help, and the range a control offers (a flag of `mmadapt chat` and a control
    of the page); a field without it is set from Python and the API only."""
    return {"help": help, "range": (low, high, step)}


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How an answer's tokens are chosen: greedy (`temperature` <= 0, the default) or sampled at `temperature` from
    the `top_p` nucleus, reproducibly from `seed`; at most `max_new_tokens` per answer.

    `repetition_penalty`: transformers' (1.0 = off; > 1 discourages the tokens already in the prompt or the answer,
    `mmadapt.generation.penalize_repetition`). `stop`: strings that end the answer, text-level: the answer is cut before
    the first one that appears (it is not part of the answer) and generation stops there; each at most
    `MAX_STOP_CHARS` characters. `logprobs`: None for none, K >= 0 for each answer token's log-prob and its K most
    likely alternatives (`TokenLogprob`; the model's own distribution, before the penalty, temperature and nucleus:
    `mmadapt.generation.token_logprobs`).

    The declaration is the one place these settings and their defaults are written: the fields with a range
    (`shown`) are `mmadapt chat`'s flags and the page's controls (`sampling_settings`).
    """

    max_new_tokens: int = field(default=256, metadata=shown("the most tokens an answer may have", 1, 8192, 1))
    temperature: float = field(default=0.0, metadata=shown("0 = greedy (the default); above 0, sampled", 0.0, 2.0,
                                                           0.05))
    top_p: float = field(default=1.0, metadata=shown("sample from the smallest set of tokens holding this share of "
                                                     "the probability (1 = all)", 0.05, 1.0, 0.05))
    seed: int = field(default=0, metadata=shown("the random seed of sampling (the same seed, the same answer)", 0,
                                                2**63 - 1, 1))
    repetition_penalty: float = field(default=1.0, metadata=shown(
        "transformers' repetition penalty (1 = off; above 1 discourages tokens already in the prompt or answer)",
        0.5, 2.0, 0.05))
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            raise TypeError(f"stop must be a sequence of strings, got the string {self.stop!r}: give (text,)")
        object.__setattr__(self, "stop", tuple(self.stop))
        problems = [
            f"max_new_tokens must be >= 1, got {self.max_new_tokens}" if self.max_new_tokens < 1 else "",
            f"temperature must be >= 0, got {self.temperature}" if not self.temperature >= 0 else "",
            f"top_p must be in (0, 1], got {self.top_p}" if not 0 < self.top_p <= 1 else "",
            f"repetition_penalty must be > 0, got {self.repetition_penalty}" if not self.repetition_penalty > 0 else "",
            "stop strings must be non-empty strings" if not all(isinstance(t, str) and t for t in self.stop) else "",
            *(f"stop strings may have at most {MAX_STOP_CHARS} characters (MAX_STOP_CHARS), stop[{k}] has {len(t)}: "
              "shorten it" for k, t in enumerate(self.stop) if isinstance(t, str) and len(t) > MAX_STOP_CHARS),
            f"logprobs must be None or >= 0, got {self.logprobs}" if (self.logprobs or 0) < 0 else "",
        ]
        if any(problems):
            raise ValueError("; ".join(p for p in problems if p))


@dataclass(frozen=True)
class SamplingSetting:
    """One shown sampling setting (a `Sampling` field with a range): what a flag and a page control are built from."""

    name: str
    kind: type  # int or float
    default: Any
    help: str
    low: float
    high: float
    step: float

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def label(self) -> str:
        return self.name.replace("_", " ")


def sampling_settings() -> tuple[SamplingSetting, ...]:
    """The `Sampling` fields a person sets (`mmadapt chat`'s flags, the page's controls), in declaration order."""
    kinds = {"int": int, "float": float, int: int, float: float}
    return tuple(SamplingSetting(f.name, kinds[f.type], f.default, f.metadata["help"], *f.metadata["range"])
                 for f in dataclasses.fields(Sampling) if "range" in f.metadata)


DEFAULT_SAMPLING = Sampling()
"""Every setting at its default (greedy): the default of every function that takes a `Sampling`."""
