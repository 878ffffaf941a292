"""Verifiable rewards for online RL (`train.objective: grpo`): plain callables that score completions, a registry of the
built-in ones by exact name, the run config's `grpo.rewards` parsed into weighted specs, and `score`, which runs them
on a batch without letting one failing row stop the run.

A reward is a callable `(completions: list[str], **columns) -> list[float | None]`: one value per completion (its
text, the chat template's markup removed), given the dataset's columns for the same rows as keyword arguments (lists,
one entry per completion: `solution=[...]`); None means "cannot score this row" (no solution, say). Built-ins:

- `accuracy` (`Accuracy`): 1.0 when the completion's answer equals the row's `solution` (or `answer`) column, else
  0.0; None without one. The answer is the last `\\boxed{...}` (balanced braces), else the text after the last
  `</think>`, else the whole completion; the solution is read the same way. Both are compared after `normalise`:
  whitespace collapsed, case folded, a trailing period dropped, and plain decimal numbers compared as numbers
  ("3" = "3.0" = " 3 "). No symbolic maths (trl's `accuracy_reward` uses math_verify for that).
- `format` (`Format`): 1.0 when the completion matches `pattern` (`re.match`, DOTALL and MULTILINE, as trl's
  `think_format_reward`), default trl's `^<think>(?!.*<think>)(.*?)</think>.*$`: one reasoning block first, then
  the answer.

`grpo.rewards` is a list of names or of mappings `{name, weight (1.0), ...options}` (`reward_specs`). A name with a
colon, `package.module:function`, is the user's callable, imported from an installed module: that imports and runs
the module the run config names, so a config file is code to trust as much as the module it names (no file paths are
accepted, nothing is fetched). Its options, if any, must be bound in its module (a factory or `functools.partial`).

Scoring (`score`), with w_k the weights and v_k the values (trl 1.16 `_calculate_rewards` and its `nansum`,
grpo_trainer.py 1579-1682, 2759-2764): total = sum_k w_k v_k over the rewards that scored the row (None counts 0);
NaN when no reward scored it (trl's unscorable row: no advantage, kept out of its group's baseline by
`policy_gradient.group_advantages`). A reward that raises is run again row by row: the rows it raises on are None,
counted in `Scores.failed` and logged once per call with its name, the rows and the first error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmadapt.registry import Registry, UnknownComponentError

log = logging.getLogger(__name__)

RewardFunction = Callable[..., list[float | None]]
THINK_FORMAT = r"^<think>(?!.*<think>)(.*?)</think>.*$"  # trl.rewards.think_format_reward's pattern
NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
BOXED_OPEN = re.compile(re.escape("\\boxed{"))
BRACE = re.compile(r"[{}]")


# ---- the built-in rewards --------------------------------------------------------------------------------------------
def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (braces balanced), or None (none, or never closed).

    One pass over the braces with a stack of the open ones (each `{` closed by the first `}` that balances it), so
    the cost is linear in `text`: searching each box's end from its start again costs the square of the number of
    unclosed boxes (a 56 KB solution of them took 36 s)."""
    opens = {match.end() - 1 for match in BOXED_OPEN.finditer(text)}  # the positions of the boxes' own `{`
    if not opens:
        return None
    stack: list[int] = []
    last: tuple[int, int] | None = None  # (its `{`, its `}`) of the closed box that starts last
    for brace in BRACE.finditer(text, min(opens)):
        at = brace.start()
        if text[at] == "{":
            stack.append(at)
        elif stack:
            start = stack.pop()
            if start in opens and (last is None or start > last[0]):
                last = (start, at)
    return None if last is None else text[last[0] + 1 : last[1]]


def final_answer(text: str) -> str:
    """The answer a completion gives: its last `\\boxed{...}`, else what follows its last `</think>`, else all."""
    found = boxed(text)
    if found is not None:
        return found
    return text.rpartition("</think>")[2]


def normalise(answer: str) -> str | float:
    """`answer` as compared: a float for a plain decimal number, else the text with whitespace collapsed, case folded
    and a trailing period dropped."""
    text = " ".join(answer.split()).casefold().removesuffix(".").strip()
    return float(text) if NUMBER.fullmatch(text) else text


@dataclass(frozen=True, kw_only=True)
class Accuracy:
    """1.0 when the completion's answer equals the row's solution, 0.0 when not, None without a solution. `column`:
    the column holding it (None: per row, its `solution`, else its `answer`: a file mixing trl's and EasyR1's
    records holds each in one of them)."""

    column: str | None = None

    def __call__(self, completions: list[str], **columns: Any) -> list[float | None]:
        solutions = self.solutions(columns, len(completions))
        return [None if missing(solution) else float(normalise(final_answer(text)) == normalise(final_answer(
                str(solution)))) for text, solution in zip(completions, solutions, strict=True)]

    def solutions(self, columns: dict[str, Any], rows: int) -> list[Any]:
        if self.column:
            if self.column not in columns:
                raise KeyError(f"reward 'accuracy' reads column {self.column!r}, which the data lacks; it has "
                               f"{sorted(columns)}")
            return list(columns[self.column])
        present = [columns[name] for name in ("solution", "answer") if name in columns]
        return [next((column[r] for column in present if not missing(column[r])), None) for r in range(rows)]


def missing(solution: Any) -> bool:
    """No solution to compare with: None, NaN (a table's empty cell) or blank text."""
    return solution is None or (isinstance(solution, float) and math.isnan(solution)) or str(solution).strip() == ""


@dataclass(frozen=True, kw_only=True)
class Format:
    """1.0 when the completion matches `pattern` (`re.match` with DOTALL and MULTILINE), else 0.0."""

    pattern: str = THINK_FORMAT

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as error:
            raise ValueError(f"reward 'format': pattern {self.pattern!r} is not a regular expression ({error}); fix "
                             "it, or leave it out for trl's think format") from None

    def __call__(self, completions: list[str], **columns: Any) -> list[float | None]:
        return [1.0 if re.match(self.pattern, text, re.DOTALL | re.MULTILINE) else 0.0 for text in completions]


REWARDS: Registry[type] = Registry("reward")  # name -> a frozen dataclass whose fields are its options
REWARDS.register("accuracy", Accuracy)
REWARDS.register("format", Format)


# ---- grpo.rewards ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RewardSpec:
    """One entry of `grpo.rewards`: its name (a registered reward, or `module:function`), weight, options and the
    callable they make."""

    name: str
    function: RewardFunction = field(compare=False, repr=False)
    weight: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, entry: Any, where: str = "grpo.rewards") -> RewardSpec:
        """A name, or a mapping `{name, weight, ...options}`."""
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise ValueError(f"{where}: expected a reward name or a mapping with a 'name', got {entry!r}; known "
                             f"rewards: {', '.join(REWARDS.names())}, or 'package.module:function'")
        options = {k: v for k, v in entry.items() if k not in ("name", "weight")}
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"{where} ({entry['name']!r}): weight must be a finite number, got {weight!r}")
        return cls(entry["name"], build_reward(entry["name"], options, where), float(weight), options)


def reward_specs(value: Any) -> tuple[RewardSpec, ...]:
    """`grpo.rewards` (a non-empty list of names or mappings) as specs; `ValueError` naming the entry and the known
    rewards."""
    if isinstance(value, str | Mapping) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"grpo.rewards must be a non-empty list of reward names or mappings {{name, weight, "
                         f"...options}}, got {value!r}; known rewards: {', '.join(REWARDS.names())}")
    specs = tuple(RewardSpec.parse(entry, f"grpo.rewards[{k}]") for k, entry in enumerate(value))
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"grpo.rewards names {repeated} more than once; list each reward once (its values are "
                         "logged under its name)")
    return specs


def build_reward(name: str, options: dict[str, Any], where: str) -> RewardFunction:
    """The callable `name` stands for: a registered reward built with `options`, or an imported `module:function`."""
    if ":" in name:
        if options:
            raise ValueError(f"{where}: options {sorted(options)} for {name!r}; a user's reward takes none here, bind "
                             "them in its module (a factory, or functools.partial)")
        return imported_reward(name, where)
    try:
        kind = REWARDS.get(name)
    except UnknownComponentError as error:
        raise UnknownComponentError(f"{where}: {error}; or 'package.module:function' for your own") from None
    known = [f.name for f in dataclasses.fields(kind)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{where}: reward {name!r} has no option {unknown}; its options: {known or 'none'}")
    return kind(**options)


def imported_reward(path: str, where: str) -> RewardFunction:
    """`package.module:function` from an installed module (this imports, so runs, that module)."""
    from mmadapt.lazy import imported

    function = imported(path, where, "reward")
    if not callable(function):
        raise TypeError(f"{where}: {path!r} is a {type(function).__name__}, not a callable "
                        "(completions, **columns) -> list[float | None]")
    return function


# ---- scoring ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scores:
    """A batch's rewards: `total` (per row, the weighted sum; NaN: no reward scored the row), `values` (per reward,
    per row; None: not scored), `failed` (per reward, the rows it raised on)."""

    total: list[float]
    values: dict[str, list[float | None]]
    failed: dict[str, list[int]]

    def logged(self) -> dict[str, float]:
        """Per reward `rewards/<name>/mean` over the rows it scored (NaN if none), `.../unscored` and `.../failed`
        (row counts); `reward`, the mean total over the scored rows."""
        out = {}
        for name, values in self.values.items():
            scored = [v for v in values if v is not None]
            out[f"rewards/{name}/mean"] = sum(scored) / len(scored) if scored else math.nan
            out[f"rewards/{name}/unscored"] = float(len(values) - len(scored))
            out[f"rewards/{name}/failed"] = float(len(self.failed[name]))
        totals = [t for t in self.total if not math.isnan(t)]
        out["reward"] = sum(totals) / len(totals) if totals else math.nan
        return out


def score(completions: list[str], columns: Mapping[str, Sequence[Any]], specs: Sequence[RewardSpec]) -> Scores:
    """Every reward of `specs` on `completions` and the rows' `columns` (the module docstring's rules)."""
    for name, column in columns.items():
        if len(column) != len(completions):
            raise ValueError(f"column {name!r} has {len(column)} values for {len(completions)} completions; pass "
                             "each column's value for every completion (repeat a prompt's row for each of its G)")
    values, failed = {}, {}
    for spec in specs:
        values[spec.name], failed[spec.name] = run_reward(spec, completions, columns)
    total = []
    for row in range(len(completions)):
        scored = [spec.weight * values[spec.name][row] for spec in specs if values[spec.name][row] is not None]
        total.append(math.fsum(scored) if scored else math.nan)
    return Scores(total, values, failed)


def run_reward(spec: RewardSpec, completions: list[str], columns: Mapping[str, Sequence[Any]]
               ) -> tuple[list[float | None], list[int]]:
    """One reward's values on the batch, and the rows it raised on (run again row by row when the batch call
    raises)."""
    try:
        return checked(spec.name, spec.function(list(completions), **{k: list(v) for k, v in columns.items()}),
                       len(completions)), []
    except Exception:  # a row's failure: find which rows, score the rest
        values, failed, first = [], [], None
        for row, text in enumerate(completions):
            try:
                one = spec.function([text], **{k: [v[row]] for k, v in columns.items()})
                values.append(checked(spec.name, one, 1)[0])
            except Exception as error:
                values.append(None)
                failed.append(row)
                first = first or f"{type(error).__name__}: {error}"
        if failed:
            log.warning("reward %r raised on rows %s of %d (first: %s); those rows count it as unscored (0 in the "
                        "total)", spec.name, failed, len(completions), first)
        return values, failed


def checked(name: str, values: Any, rows: int) -> list[float | None]:
    """`values` as floats or None (NaN -> None); `ValueError` when there is not one per row, `TypeError` for a value
    that is no number (both caught per row by `run_reward`)."""
    values = list(values)
    if len(values) != rows:
        raise ValueError(f"reward {name!r} returned {len(values)} values for {rows} completions; return one per "
                         "completion (None for one it cannot score)")
    out = []
    for value in values:
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"reward {name!r} returned {value!r}; rewards are numbers or None")
        out.append(None if value is None or math.isnan(value) else float(value))
    return out
