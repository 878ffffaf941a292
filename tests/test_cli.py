"""The `mmadapt` console script."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import write_jsonl, write_run

from mmadapt import BACKBONES, ENCODERS, PROJECTORS
from mmadapt.cli import main


def test_list_prints_every_component(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for registry in (BACKBONES, ENCODERS, PROJECTORS):
        for name, spec in registry.items():
            assert name in out and spec.description in out


def test_check_model_reports_ok(capsys):
    assert main(["check-model", "clip", "mlp2x_gelu", "qwen3_5"]) == 0
    out = capsys.readouterr().out
    assert "contract: OK" in out and "projector gradient norm" in out


def test_unknown_name_is_a_clean_error(capsys):
    assert main(["check-model", "clip", "mlp", "llama"]) == 2
    assert "known: identity" in capsys.readouterr().err


@pytest.mark.slow
def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "mmadapt", "list"], capture_output=True, text=True, check=True)
    assert "qwen3_5_vit" in out.stdout


def test_train_with_a_missing_pretrained_part_is_one_line(tmp_path, capsys):
    write_run(tmp_path / "run.yaml", model={"backbone": {"name": "llama", "pretrained": f"{tmp_path}/vicuna"}},
              data={"train": write_jsonl(tmp_path / "train.jsonl", [])}, train={"out": tmp_path / "out"})
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: backbone 'llama': pretrained path {tmp_path}/vicuna does not exist (rerun with --debug " \
                  "for the traceback)"
    with pytest.raises(FileNotFoundError):
        main(["train", str(tmp_path / "run.yaml"), "--debug"])


@pytest.mark.parametrize(("yaml_text", "expected"), [
    ("data: {train: DIR/missing.jsonl}\n", "missing.jsonl"),
    ("data: {train: DIR/train.jsonl}\ntrain: {lr: fast}\n", "train.lr must be a number"),
    ("data: {train: DIR/train.jsonl}\nmodel: {encoder: clipp}\n", "unknown encoder 'clipp'; known: clip"),
    ("data: {train: DIR/train.jsonl\n", "while parsing"),
], ids=["missing-data-file", "bad-value", "unknown-name", "bad-yaml"])
def test_every_train_user_error_is_one_line(yaml_text, expected, tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "run.yaml").write_text(yaml_text.replace("DIR", str(tmp_path)))
    assert main(["train", str(tmp_path / "run.yaml"), f"train.out={tmp_path}/out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


def run_mmadapt(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """`python -m mmadapt ARGS` (what the `mmadapt` script runs), or `python -c CODE`, from this checkout."""
    command = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "mmadapt", *args]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_help_lists_every_command_with_its_summary():
    from mmadapt.cli import COMMANDS

    done = run_mmadapt("--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps the summaries
    for name, command in COMMANDS.items():
        assert f" {name} " in text and command.summary in text, name
    assert "serve" in COMMANDS and "mmadapt demo" in text


def test_every_command_is_registered_and_has_its_full_parser():
    from mmadapt.cli import COMMANDS, build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert list(commands) == list(COMMANDS)
    assert commands["serve"].description.startswith("mmadapt serve: ")
    assert parser.parse_args(["serve", "runs/x", "--port", "9"]).port == 9


def help_commands() -> list[tuple[str, ...]]:
    """Every command and subcommand the parser knows (`data check`, `numerics dump`, ...), read from the parser
    itself, so that a command added later is in the list: [(), ("demo",), ("data",), ("data", "check"), ...]."""
    from mmadapt.cli import build_parser

    def below(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        found = [path]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found += below(child, (*path, name))
        return found

    commands = below(build_parser(), ())
    assert {("eval",), ("explain",), ("sees",), ("data", "check"), ("numerics", "compare")} <= set(commands)
    return commands


def test_parsing_and_help_import_no_torch():
    every = [list(c) for c in help_commands() if c]
    code = ("import sys\nfrom mmadapt.cli import main\n"
            f"for argv in [['--help'], ['trian'], *([*c, '--help'] for c in {every!r}), ['train', '--x']]:\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = run_mmadapt(code=code)
    assert "IMPORTED []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_wrong_flag_or_command_is_one_line_after_the_usage():
    for argv in (["train", "--bogus"], ["trian"]):
        done = run_mmadapt(*argv)
        assert done.returncode == 2 and done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert lines[0].startswith("usage: mmadapt") and lines[-1].startswith("mmadapt: error: "), done.stderr
        assert len([line for line in lines if "error" in line]) == 1


def test_help_answers_quickly():
    """Loose bound (2 shared cores under load); benchmarks/bench_cli.py measures the median of 5 (target < 1 s)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        assert run_mmadapt("--help").returncode == 0
        times.append(time.perf_counter() - started)
    assert sorted(times)[1] < 3.0, times


def test_every_help_answers_under_a_second():
    """`mmadapt [COMMAND [SUBCOMMAND]] --help` for every (sub)command the parser has, each a fresh process: the
    slowest, each the best of up to 3 runs (a run over 1 s is tried again: the machine's other work, e.g. the other
    test worker), under 1 s (a command imports its library only when it runs; torch alone takes longer than that)."""
    times = {}
    for command in help_commands():
        runs = []
        while len(runs) < 3 and (not runs or min(runs) >= 1.0):
            started = time.perf_counter()
            done = run_mmadapt(*command, "--help")
            runs.append(time.perf_counter() - started)
            assert done.returncode == 0 and "usage: mmadapt" in done.stdout, (command, done.stderr[-2000:])
        times[" ".join(command) or "(none)"] = min(runs)
    slowest = max(times, key=times.get)
    assert times[slowest] < 1.0, f"mmadapt {slowest} --help took {times[slowest]:.2f} s: {times}"


def test_explain_flags_show_the_libraries_defaults():
    """`explain`'s flags take their defaults from `mmadapt.evidence.settings` without importing the methods; they are
    the methods' own defaults."""
    from mmadapt.cli import build_parser
    from mmadapt.evidence import DEFAULT_METHOD, Integrated, Occlusion, Rise
    from mmadapt.evidence.measure import CURVE_STEPS

    args = build_parser(["explain"]).parse_args(["explain", "MODEL", "--image", "x.png"])
    assert (args.method, args.windows, args.samples, args.steps, args.curve_steps) == (
        DEFAULT_METHOD.name, Occlusion().windows, Rise().samples, Integrated().steps, CURVE_STEPS)
