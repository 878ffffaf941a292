"""The README and the docs say only what runs: every command they show parses, and runs here or in a named test.

Checked over the fenced code blocks of README.md, docs/*.md and benchmarks/README.md:
- every `mmadapt ...` line (also `$ mmadapt ...`, `... && mmadapt ...` and `torchrun ... -m mmadapt ...`) parses
  with the real parser, so no page names a command or a flag that does not exist (placeholders such as MODEL or
  run.yaml parse as values);
- every command is either executed here, as written, in a folder with the small files it names (`EXECUTED`), or
  listed with the existing test that runs it (`RUN_BY`), and that test exists;
- every ```python block runs (tiny models, CPU, seconds); a ```python no-run block (it needs checkpoints or data
  that a test cannot have) at least compiles;
- every ```yaml block that holds run sections is a valid run config (unknown keys fail);
- every relative link points to a file that exists, and every #anchor to a heading of that file.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]

# Commands run in this file, as the docs write them (see `test_cheap_commands_run_as_documented`).
EXECUTED = {"list": 0, "check-model": 0, "data check": 0, "numerics deepspeed-config": 0,
            "numerics lint-deepspeed": 0}
# Commands whose runs take a trained model, a training run or minutes: the test that runs each.
RUN_BY = {
    "train": "tests/test_train.py::test_mmadapt_train_writes_out_model_with_the_final_logits",
    "torchrun train": "tests/test_distributed.py::test_fsdp2_and_ddp_equal_one_process",
    "plan": "tests/test_plan.py::test_the_command_prints_a_table_and_json_and_says_whether_it_fits",
    "export": "tests/test_commands.py::test_every_documented_command_runs_as_a_process",
    "chat": "tests/test_inference.py::test_chat_one_shot_answer_is_generate_and_the_last_line",
    "eval": "tests/test_evaluate.py::test_eval_reports_three_ways_and_the_trained_model_passes",
    "sees": "tests/test_evaluate.py::test_sees_prints_a_table_and_an_exit_code",
    "explain": "tests/test_evidence.py::test_cmd_explain_answers_and_writes_the_png_for_a_saved_model",
    "data show": "tests/test_templates.py::test_data_show_prints_the_samples_with_supervised_tokens_marked",
    "numerics dump": "tests/test_numerics.py::test_cli_dump",
    "numerics compare": "tests/test_numerics.py::test_cli_compare_writes_json_and_plot",
    "serve": "tests/test_lmms_eval.py::test_lmms_eval_model_openai_against_mmadapt_serve_gives_the_same_score",
    "serve --ui": "tests/test_page_browser.py::test_the_pages_answer_is_mmadapt_chats_answer",
    "demo": "tests/test_demo.py::test_a_short_demo_run_passes_its_verdict_and_writes_every_output",
}


@dataclass(frozen=True)
class Block:
    """One fenced code block: its info string (```python no-run -> 'python no-run'), text and where it starts."""

    page: Path
    line: int
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One documented command line: `argv` after `mmadapt`; `torchrun` when it is launched by torchrun."""

    block: Block
    argv: tuple[str, ...]
    torchrun: bool

    @property
    def key(self) -> str:
        words = self.argv[:2] if self.argv[0] in ("data", "numerics") else self.argv[:1]
        if self.argv[0] == "serve" and "--ui" in self.argv:
            words = ("serve", "--ui")
        return ("torchrun " if self.torchrun else "") + " ".join(words)


def blocks(page: Path) -> list[Block]:
    found, info, start, lines = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```") and info is None:
            info, start, lines = line[3:].strip(), number, []
        elif line.startswith("```"):
            found.append(Block(page, start, info, "\n".join(lines) + "\n"))
            info = None
        elif info is not None:
            lines.append(line)
    assert info is None, f"{page}: a code block opened at line {start} is never closed"
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def commands() -> list[Command]:
    found = []
    for block in ALL_BLOCKS:
        if block.info.startswith("python"):
            continue
        lines = block.text.replace("\\\n", " ").splitlines()
        for line in (part.strip().removeprefix("$ ") for text in lines for part in text.split("&&")):
            if not line.startswith(("mmadapt ", "torchrun ")) and line != "mmadapt":
                continue
            words = shlex.split(line, comments=True)
            if words[:1] == ["mmadapt"]:
                found.append(Command(block, tuple(words[1:]), torchrun=False))
            elif words[:1] == ["torchrun"]:
                at = words.index("mmadapt")
                assert words[at - 1] == "-m", f"{block.where}: {line}"
                found.append(Command(block, tuple(words[at + 1:]), torchrun=True))
    return found


COMMANDS = commands()


def parse(argv: tuple[str, ...]) -> argparse.Namespace:
    """The real parser, as `mmadapt.cli.main` uses it (prompt words may follow a chat / explain option)."""
    from mmadapt.cli import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args, extra = build_parser().parse_known_args(list(argv))
    except SystemExit:
        pytest.fail(f"mmadapt {' '.join(argv)}: {stderr.getvalue().strip()}")
    prompt_words = args.command in ("chat", "explain") and not any(a.startswith("-") for a in extra)
    assert not extra or prompt_words, f"mmadapt {' '.join(argv)}: unrecognized arguments {extra}"
    return args


def test_the_pages_show_commands_of_every_kind():
    keys = {c.key for c in COMMANDS}
    assert {"list", "check-model", "data check", "train", "plan", "chat", "eval", "explain"} <= keys
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.block.where}:{c.key}")
def test_every_documented_command_parses(command):
    args = parse(command.argv)
    assert callable(args.func)


def test_every_documented_command_runs_here_or_in_a_named_test():
    missing = sorted({f"{c.key} ({c.block.where})" for c in COMMANDS if c.key not in EXECUTED | RUN_BY})
    assert not missing, f"documented commands that no test runs: {missing}"
    for key, test in RUN_BY.items():
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{key}: {test} does not exist"
    unused = set(RUN_BY) - {c.key for c in COMMANDS}
    assert not unused, f"RUN_BY names commands no page shows: {unused}"


def write_inputs(folder: Path) -> None:
    """The files the cheap commands name: a small LLaVA dataset under data/ (images in data/images), pairs, and a
    run file mixing the dataset with itself."""
    from PIL import Image

    (folder / "data" / "images").mkdir(parents=True)
    records = []
    for i, colour in enumerate(["red", "blue", "green"]):
        Image.new("RGB", (32, 24), colour).save(folder / "data" / "images" / f"{i}.png")
        records.append({"id": f"s{i}", "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is this?"}, {"from": "gpt", "value": colour}]})
    (folder / "data" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    pairs = [{"id": f"p{i}", "images": [f"{i}.png"], "prompt": "<image>\nWhat colour is this?", "chosen": colour,
              "rejected": "purple"} for i, colour in enumerate(["red", "blue", "green"])]  # trl's preference format
    (folder / "data" / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs))
    (folder / "run.yaml").write_text(  # a run whose data.train is a mixture (data check run.yaml)
        "model: {encoder: clip, projector: mlp2x_gelu, backbone: llama, preset: tiny}\n"
        "data: {train: [{path: data/train.jsonl, weight: 3}, {path: data/train.jsonl, weight: 1, name: again}], "
        "image_root: data/images}\n")


def test_cheap_commands_run_as_documented(tmp_path, monkeypatch, capsys):
    from mmadapt.cli import main

    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    ran = set()
    # a config is written before it is linted, whatever the order the pages show them in
    cheap = sorted((c for c in COMMANDS if c.key in EXECUTED), key=lambda c: c.key != "numerics deepspeed-config")
    for command in cheap:
        assert main(list(command.argv)) == EXECUTED[command.key], f"{command.block.where}: {command.argv}"
        ran.add(command.key)
    assert ran == set(EXECUTED)
    printed = capsys.readouterr().out
    assert "qwen3_5" in printed and "mlp2x_gelu" in printed  # list, check-model
    assert json.loads((tmp_path / "report.json").read_text())["ok"] == 3  # data check


PYTHON = [b for b in ALL_BLOCKS if b.info == "python"]


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.where)
def test_python_examples_run(block, tmp_path, monkeypatch):
    from mmadapt import BACKBONES, ENCODERS, PROJECTORS

    monkeypatch.chdir(tmp_path)
    registered = {registry: set(registry.names()) for registry in (BACKBONES, ENCODERS, PROJECTORS)}
    try:
        exec(compile(block.text, block.where, "exec"), {"__name__": "docs_example"})
    finally:
        for registry, names in registered.items():
            for name in set(registry.names()) - names:
                registry.unregister(name)


def test_the_runnable_examples_are_the_first_use_and_the_registrations():
    texts = [b.text for b in PYTHON]
    assert any("build_model" in t and "check_batch" in t for t in texts)
    assert any("BACKBONES.register" in t for t in texts) and any("ENCODERS.register" in t for t in texts)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.info.startswith("python ")], ids=lambda b: b.where)
def test_python_sketches_compile(block):
    assert block.info == "python no-run", f"{block.where}: unknown info string {block.info!r}"
    compile(block.text, block.where, "exec")


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.info == "yaml"], ids=lambda b: b.where)
def test_yaml_run_sections_are_valid_run_configs(block):
    import yaml

    from mmadapt.train.config import RunConfig

    RunConfig.from_dict(yaml.safe_load(block.text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    for block in blocks(page):  # '# comments' inside code blocks are not headings
        text = text.replace(block.text, "")
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_to_files_and_headings_that_exist(page):
    text = page.read_text()
    for block in blocks(page):
        text = text.replace(block.text, "")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.relative_to(ROOT)}: link to {target}: no such heading"


def test_the_readme_is_a_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme) if not re.match(r"[a-z]+:", t)}
    assert set(PAGES[1:]) <= linked, f"pages the README does not link: {set(PAGES[1:]) - linked}"
