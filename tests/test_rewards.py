"""Verifiable rewards (`mmadapt.train.rewards`): `accuracy` on boxed, reasoning, plain and numeric answers; `format`
equal to trl's `think_format_reward` on its own examples and more; `grpo.rewards` parsed (names, weights, options, a
user's `module:function`) with errors that list the known rewards; `score`'s weighted totals, None and NaN as trl
treats them, and a raising reward counted per row, never fatal.
"""

from __future__ import annotations

import logging
import math
import time

import pytest

from mmadapt.registry import UnknownComponentError
from mmadapt.train.rewards import (
    REWARDS,
    THINK_FORMAT,
    Accuracy,
    Format,
    RewardSpec,
    boxed,
    final_answer,
    reward_specs,
    score,
)

MB = 1_000_000


# ---- accuracy --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("completion,solution,expected", [
    ("So the total is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{3}", 1.0),                 # nested braces
    ("first \\boxed{1}, then \\boxed{2}", "2", 1.0),               # the last box
    ("\\boxed{7} and an unclosed \\boxed{8", "7", 1.0),            # an unclosed box is no answer
    ("<think>maybe 5, or \\boxed{6}?</think> 4", "6", 1.0),         # a box wins over the reasoning's end
    ("<think>maybe 5</think>\n4", "4", 1.0),                       # after the last </think>
    ("<think>4</think> The answer is 5", "4", 0.0),
    ("  Paris. ", "paris", 1.0),                                   # case, spaces, a final period
    ("New   York\n", "new york", 1.0),
    ("3.0", "3", 1.0), (" 3 ", "3.00", 1.0), ("-0.50", "-.5", 1.0), ("1e3", "1000", 1.0),
    ("3", 3, 1.0),                                                 # a numeric solution column
    ("4", "3", 0.0), ("3.01", "3", 0.0), ("\\boxed{12}", "\\boxed{21}", 0.0), ("Lyon", "Paris", 0.0),
])
def test_accuracy(completion, solution, expected):
    assert Accuracy()([completion], solution=[solution]) == [expected]


def test_accuracy_is_none_without_a_solution_and_reads_answer_or_a_named_column():
    reward = Accuracy()
    assert reward(["1", "2", "3", "4"], solution=[None, "", float("nan"), "4"]) == [None, None, None, 1.0]
    assert reward(["1", "2"], answer=["1", "3"]) == [1.0, 0.0]
    assert reward(["1"], question=["what?"]) == [None]
    # a file mixing trl's (solution) and EasyR1's (answer) records: each row reads the one it has, solution first
    assert reward(["1", "2", "3"], solution=["1", None, "3"], answer=[None, "2", "9"]) == [1.0, 1.0, 1.0]
    assert Accuracy(column="gold")(["1", "2"], gold=["1", "1"], solution=["2", "2"]) == [1.0, 0.0]
    with pytest.raises(KeyError, match="reads column 'gold', which the data lacks"):
        Accuracy(column="gold")(["1"], solution=["1"])


def test_boxed_and_final_answer():
    assert boxed("no box") is None and boxed("\\boxed{a{b}c}") == "a{b}c" and boxed("\\boxed{}") == ""
    assert final_answer("<think>x</think>y</think>z") == "z" and final_answer("plain") == "plain"


def test_boxed_finds_a_box_closed_after_unclosed_ones():
    assert boxed("\\boxed{a} \\boxed{b \\boxed{c}") == "c" and boxed("\\boxed{a} \\boxed{b {") == "a"
    assert boxed("\\boxed{x \\boxed{y} z}") == "y" and boxed("}} \\boxed{{}}}") == "{}"


@pytest.mark.parametrize("solution,expected", [
    ("\\boxed{" * (MB // 7), 0.0),              # unclosed boxes: each was searched to the end again (quadratic)
    ("\\boxed{" + "{" * MB, 0.0),               # one box, a million braces
    ("\\boxed{" + "{}" * (MB // 2) + "} 4", 0.0),  # ... that closes: its content is the answer
    ("1" * MB + ".", 0.0),                        # a million digits
    ("</think>" * (MB // 8) + " 4", 1.0),
])
def test_accuracy_is_linear_in_a_megabyte_solution(solution, expected):
    start = time.perf_counter()
    assert Accuracy()(["\\boxed{4}"], solution=[solution]) == [expected]
    assert time.perf_counter() - start < 1.0  # was quadratic: 36 s for 56 KB of unclosed boxes


@pytest.mark.parametrize("completion,expected", [
    ("<think>" + "</think" * (MB // 7), 0.0), ("<think>" + "<thin" * (MB // 5) + "</think>", 1.0),
    ("<think>x</think>" + "\n" * MB, 1.0), ("<think>" * (MB // 7), 0.0),
])
def test_format_is_linear_in_a_megabyte_completion(completion, expected):
    start = time.perf_counter()
    assert Format()([completion]) == [expected]
    assert time.perf_counter() - start < 1.0


# ---- format ----------------------------------------------------------------------------------------------------------
FORMATS = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",   # trl's docstring examples
    "<think>\nThis is my reasoning.\nThis is my answer.",
    "<think></think>", "<think>a</think>\n\nline two\nline three", "<think>a</think><think>b</think>c",
    "answer first <think>a</think>", " <think>a</think>", "</think>", "<think>a\n</think>", "<THINK>a</THINK>",
    "<think>one\n<think>two</think>", "",
]


def test_format_equals_trls_think_format_reward():
    think_format_reward = pytest.importorskip("trl.rewards").think_format_reward
    theirs = think_format_reward([[{"role": "assistant", "content": text}] for text in FORMATS])
    assert Format()(FORMATS) == theirs
    assert theirs[:2] == [1.0, 0.0] and 0.0 in theirs[2:] and 1.0 in theirs[2:]


def test_format_pattern_option():
    assert THINK_FORMAT == Format().pattern
    answer_tags = Format(pattern=r"^.*<answer>.+</answer>\s*$")
    assert answer_tags(["x <answer>4</answer>\n", "<answer></answer>", "4"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"reward 'format': pattern '\(' is not a regular expression"):
        Format(pattern="(")


# ---- grpo.rewards ---------------------------------------------------------------------------------------------------
def test_specs_from_names_and_mappings():
    specs = reward_specs(["accuracy", {"name": "format", "weight": 0.5, "pattern": "^<a>"}])
    assert [(s.name, s.weight) for s in specs] == [("accuracy", 1.0), ("format", 0.5)]
    assert specs[1].function == Format(pattern="^<a>") and specs[1].options == {"pattern": "^<a>"}
    assert REWARDS.names() == ["accuracy", "format"]


def test_a_users_reward_is_imported_by_its_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def short(completions, **columns):\n"
                                            "    return [1.0 if len(c) < 5 else 0.0 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (spec,) = reward_specs([{"name": "my_rewards:short", "weight": 2}])
    assert score(["ok", "too long"], {}, [spec]).total == [2.0, 0.0]


@pytest.mark.parametrize("value,message", [
    (["accurate"], r"grpo.rewards\[0\]: unknown reward 'accurate'; known: accuracy, format; or 'package.module"),
    ("accuracy", "must be a non-empty list of reward names.*known rewards: accuracy, format"),
    ([], "must be a non-empty list"),
    ([{"weight": 1}], r"grpo.rewards\[0\]: expected a reward name or a mapping with a 'name'.*accuracy, format"),
    ([{"name": "format", "weight": "high"}], "weight must be a finite number, got 'high'"),
    ([{"name": "format", "weight": math.inf}], "weight must be a finite number"),
    ([{"name": "format", "patern": "x"}], r"reward 'format' has no option \['patern'\]; its options: \['pattern'\]"),
    (["format", {"name": "format", "weight": 2}], r"names \['format'\] more than once"),
    (["no_such_module_47:f"], "cannot import reward 'no_such_module_47:f'.*install its package"),
    (["math:no_such_function"], "cannot import reward 'math:no_such_function'"),
    (["rewards/mine.py:f"], "is not 'package.module:function' \\(a dotted module path, not a file\\)"),
    ([{"name": "math:floor", "scale": 2}], "options \\['scale'\\] for 'math:floor'.*functools.partial"),
])
def test_bad_specs_say_what_to_fix(value, message):
    with pytest.raises(ValueError, match=message):
        reward_specs(value)


def test_unknown_reward_is_the_registrys_error_and_a_non_callable_is_refused():
    with pytest.raises(UnknownComponentError):
        reward_specs(["accurate"])
    with pytest.raises(TypeError, match="'math:pi' is a float, not a callable"):
        reward_specs(["math:pi"])


# ---- score -----------------------------------------------------------------------------------------------------------
def test_weighted_totals_with_none_as_zero_and_unscored_rows_nan():
    specs = reward_specs([{"name": "accuracy", "weight": 2.0}, {"name": "format", "weight": 0.5}])
    completions = ["<think>x</think>4", "<think>x</think>5", "4", "no think"]
    result = score(completions, {"solution": ["4", "4", None, "1"]}, specs)
    assert result.values == {"accuracy": [1.0, 0.0, None, 0.0], "format": [1.0, 1.0, 0.0, 0.0]}
    assert result.total == [2.5, 0.5, 0.0, 0.0]
    nothing = RewardSpec("nothing", lambda completions, **_: [None] * len(completions))
    assert all(math.isnan(t) for t in score(["a", "b"], {}, [nothing]).total)  # trl: unscorable, NaN
    logged = result.logged()
    assert logged["rewards/accuracy/mean"] == pytest.approx(1 / 3) and logged["rewards/accuracy/unscored"] == 1
    assert logged["reward"] == pytest.approx(0.75) and logged["rewards/format/failed"] == 0


def fragile(completions, **columns):
    """Raises on any completion that says 'boom'."""
    if any("boom" in c for c in completions):
        raise RuntimeError("cannot score a boom")
    return [float(len(c)) for c in completions]


def test_a_raising_reward_is_counted_per_row_not_fatal(caplog):
    specs = [RewardSpec("fragile", fragile, 0.5), *reward_specs(["format"])]
    with caplog.at_level(logging.WARNING, logger="mmadapt.train.rewards"):
        result = score(["ab", "boom", "<think></think>", "boom!"], {"solution": ["", "", "", ""]}, specs)
    assert result.values["fragile"] == [2.0, None, 7.5 * 2, None]
    assert result.failed == {"fragile": [1, 3], "format": []}
    assert result.total == [1.0, 0.0, 8.5, 0.0]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'fragile' raised on rows [1, 3] of 4" in warnings[0]
    assert "RuntimeError: cannot score a boom" in warnings[0]


def test_bad_return_values_are_failed_rows_and_columns_must_match():
    wrong_length = RewardSpec("wrong_length", lambda completions, **_: [1.0, 1.0, 1.0])
    text = RewardSpec("text", lambda completions, **_: ["1.0"] * len(completions))
    result = score(["a", "b"], {}, [wrong_length, text])
    assert result.failed == {"wrong_length": [0, 1], "text": [0, 1]}
    assert all(math.isnan(t) for t in result.total)
    with pytest.raises(ValueError, match="column 'solution' has 1 values for 2 completions"):
        score(["a", "b"], {"solution": ["1"]}, reward_specs(["accuracy"]))
