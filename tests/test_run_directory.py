"""A run's directory: its layout declared once (`mmadapt.run_directory`), which run a path belongs to, and a run's
saved config naming the same files from any working directory (the page's examples, `--resume`).

The failure this guards against: `mmadapt demo`, then `mmadapt serve runs/demo --ui` from another directory showed
scikit-image's photographs instead of the run's held-out digits, because the run's config held data paths relative to
the directory the demo ran in.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from helpers import noise_image, write_jsonl, write_run

import mmadapt
from mmadapt import demo
from mmadapt.run_directory import CHECKPOINTS, COMPLETE, RunDirectory, is_complete, step_of
from mmadapt.train.config import RunConfig

PACKAGE = Path(mmadapt.__file__).parent
HOME = PACKAGE / "run_directory.py"


# ---- the layout ---------------------------------------------------------------------------------------------------
def test_checkpoints_are_listed_by_step_and_only_complete_ones_when_asked(tmp_path):
    run = RunDirectory(tmp_path / "out")
    assert not run.exists() and run.checkpoints() == []
    for step in (2, 10, 9):
        run.checkpoint(step).mkdir(parents=True)
    (run.checkpoint(2) / COMPLETE).write_text("{}")
    (run.checkpoint(9) / COMPLETE).write_text("{}")
    (run.checkpoints_dir / ".tmp-step-0000011~host~1~0").mkdir()  # a writer's temporary directory
    assert run.exists() and run.checkpoint(10) == tmp_path / "out" / CHECKPOINTS / "step-0000010"
    assert [step_of(p) for p in run.checkpoints()] == [2, 9, 10]
    assert [step_of(p) for p in run.checkpoints(complete=True)] == [2, 9]
    assert is_complete(run.checkpoint(9)) and not is_complete(run.checkpoint(10))
    assert Path(run) == run.path and (Path(run) / "x") == run.path / "x"  # an os.PathLike: goes where OUT goes


def test_the_run_a_path_belongs_to(tmp_path, monkeypatch):
    out = tmp_path / "runs" / "demo"
    run = RunDirectory(out)
    run.checkpoint(3).mkdir(parents=True)
    for member in (out, run.model_dir, run.adapters_dir, run.config_file, run.checkpoints_dir, run.checkpoint(3)):
        assert RunDirectory.of(member) == RunDirectory(out), member
    assert RunDirectory.of(tmp_path / "runs") is None and RunDirectory.of(run.data_dir / "eval.jsonl") is None
    monkeypatch.chdir(out / CHECKPOINTS)
    assert RunDirectory.of("step-0000003") == run and RunDirectory.of("..").path == out  # absolute, normalised


def string_constants(tree: ast.AST) -> list[tuple[int, str, ast.AST]]:
    """(line, value, parent) of every string constant of a module that is not a docstring."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return [(node.lineno, node.value, parents.get(id(node))) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def run_names() -> tuple[set[str], set[str]]:
    """(file names that mean only a run's file: never spelled elsewhere, names joined onto a path: never joined
    elsewhere), read from `RunDirectory`'s own properties."""
    example = RunDirectory("OUT")
    paths = [getattr(example, name) for name, value in vars(RunDirectory).items() if isinstance(value, property)]
    names = {path.name for path in paths} | {Path(example.checkpoint(1)).parent.name}
    return {n for n in names if "." in n} | {CHECKPOINTS, COMPLETE}, names


def test_no_run_file_name_is_spelled_outside_the_run_directory_module():
    """The run's layout has one home: `"checkpoints"`, `"COMPLETE"`, `"config.yaml"`, `"log.jsonl"`, ... appear in
    no other module of mmadapt (docstrings aside), and no module joins a run member's name (`out / "model"`) itself."""
    exact, joined = run_names()
    assert {"checkpoints", "COMPLETE", "config.yaml", "log.jsonl", "report.json", ".lock", "model", "adapters"} <= (
        exact | joined)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == HOME:
            continue
        text = path.read_text()
        if not any(name in text for name in exact | joined):
            continue
        for line, value, parent in string_constants(ast.parse(text, str(path))):
            join = (isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div)) or (
                isinstance(parent, ast.Call) and getattr(parent.func, "attr", None) == "join")
            if value in exact or (join and value in joined):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r}")
    assert not found, ("a run's file named outside mmadapt/run_directory.py (use RunDirectory's properties, "
                       "checkpoint(step), checkpoints(), COMPLETE / CONFIG):\n" + "\n".join(sorted(found)))


# ---- a run's config, from any working directory --------------------------------------------------------------------
def test_a_saved_config_names_the_same_files_from_any_directory(tmp_path, monkeypatch):
    """The file a user passes keeps its relative paths (relative to the working directory, as a shell reads them);
    the config a run saves holds them absolute, so reading it back elsewhere means the same files."""
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (start / "parts").mkdir(parents=True)
    monkeypatch.chdir(start)
    write_run("run.yaml", model={"encoder": "qwen3_5_vit", "projector": "qwen_merger", "preset": None,
                                 "backbone": {"name": "qwen3_5", "pretrained": "parts/llm"}},
              data={"train": "data/train.jsonl", "eval": "data/eval.jsonl", "tokenizer": "~/tok"},
              train={"out": "runs/x", "eval_tasks": ["mme", "tasks/mine.yaml"]})
    given = RunConfig.load("run.yaml")
    assert (given.data.train, given.train.out, given.data.image_root) == ("data/train.jsonl", "runs/x", None)
    run = RunDirectory(given.train.out)
    run.path.mkdir(parents=True)
    given.save(run.config_file)  # what the trainer writes at start, and each checkpoint holds
    resolved = given.resolved()

    monkeypatch.chdir(elsewhere)
    saved = RunConfig.load(start / "runs" / "x")  # a run directory: the config its run saved
    assert saved == RunConfig.load(start / "runs" / "x" / "config.yaml") == resolved
    assert (saved.data.train, saved.data.eval) == (str(start / "data/train.jsonl"), str(start / "data/eval.jsonl"))
    assert saved.data.image_root == str(start)  # unset: image paths were relative to the working directory
    assert saved.data.tokenizer == str(Path.home() / "tok") and saved.train.out == str(start / "runs" / "x")
    assert saved.model.backbone["pretrained"] == str(start / "parts" / "llm")
    assert saved.train.eval_tasks == ["mme", str(start / "tasks" / "mine.yaml")]  # task names stay names
    with pytest.raises(FileNotFoundError, match=r"without a config\.yaml"):
        RunConfig.load(elsewhere)


def test_the_page_shows_the_runs_held_out_examples_from_another_directory(tmp_path, monkeypatch):
    """A demo-like run made with a relative OUT (as `mmadapt demo` makes runs/demo): served from another directory,
    the page's examples are the run's held-out records, not scikit-image's photographs."""
    pytest.importorskip("gradio")
    from mmadapt.serve.examples import default_examples

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    (start / "runs" / "demo" / "data" / "images").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    run = RunDirectory("runs/demo")
    held_out = [{"id": f"digit-{k}", "image": f"images/digit-{k}.png", "conversations": [
        {"from": "human", "value": f"<image>\n{demo.QUESTION}"}, {"from": "gpt", "value": str(k)}]} for k in range(3)]
    for k in range(3):
        noise_image(run.data_dir / "images" / f"digit-{k}.png", seed=k)
    write_jsonl(run.data_dir / "eval.jsonl", held_out)
    config = demo.run_config(run.path, steps=2, lr=1e-3, batch_size=2, warmup_steps=0, seed=0, progress=False)
    config.save(run.config_file)  # as the trainer does when the run starts
    run.checkpoint(2).mkdir(parents=True)

    monkeypatch.chdir(elsewhere)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for src in (start / "runs" / "demo", start / "runs" / "demo" / "model"):
        found = default_examples(src, scratch)
        assert [(e.name, e.question) for e in found] == [(f"digit-{k}", demo.QUESTION) for k in range(3)], src


# ---- resuming from any working directory -----------------------------------------------------------------------------
def write_data(root: Path, n: int = 8) -> None:
    """`n` one-image questions, their image paths relative to the working directory (data.image_root unset)."""
    (root / "data" / "images").mkdir(parents=True)
    records = []
    for k in range(n):
        noise_image(root / "data" / "images" / f"{k}.png", seed=k)
        records.append({"id": str(k), "image": f"data/images/{k}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": f"noise {k}"}]})
    write_jsonl(root / "data" / "train.jsonl", records)


@pytest.mark.slow
def test_a_run_resumes_from_another_working_directory(tmp_path, monkeypatch):
    """Trained with relative paths (data, images, OUT) and stopped after its step-2 checkpoint; resumed from another
    directory by naming its OUT: the same losses as the run that was never stopped (bitwise, CPU fp32)."""
    from mmadapt.train import Trainer
    from mmadapt.train.run import run

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    write_data(start)
    write_run("run.yaml", data={"train": "data/train.jsonl", "batch_size": 2},
              train={"steps": 3, "lr": 1e-3, "progress": False}, checkpoint={"every": 1})
    whole = [r["loss"] for r in run(RunConfig.load("run.yaml", ["train.out=whole"]))["history"]]

    save = Trainer.save

    def save_then_stop(self, **kwargs):
        path = save(self, **kwargs)
        if self.step == 2:
            raise KeyboardInterrupt  # the job is stopped right after its step-2 checkpoint
        return path

    monkeypatch.setattr(Trainer, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run(RunConfig.load("run.yaml", ["train.out=cut"]))
    monkeypatch.setattr(Trainer, "save", save)

    monkeypatch.chdir(elsewhere)
    resumed = run(RunConfig.load(start / "cut", ["checkpoint.resume=true"]))
    assert [r["loss"] for r in resumed["history"]] == whole
    logged = [json.loads(line)["step"] for line in (start / "cut" / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3] and not (elsewhere / "cut").exists()


# ---- no file of a run is written through a link --------------------------------------------------------------------
PRECIOUS = "a file outside the run that a link points to\n"


def train_tiny(out: Path, *overrides: str) -> dict:
    """A tiny random LLaVA (char tokenizer, synthetic samples) trained into `out`: 2 steps, a checkpoint after each."""
    import torch

    from mmadapt import Processor
    from mmadapt.data import char_tokenizer
    from mmadapt.synthetic import synthetic_samples
    from mmadapt.train import Trainer

    torch.manual_seed(0)
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    tokenizer = char_tokenizer()
    processor = Processor.for_model(model, tokenizer)
    config = RunConfig.load(None, [f"train.out={out}", "train.progress=false", "train.steps=2", "checkpoint.every=1",
                                   "checkpoint.keep=5", "data.batch_size=2", *overrides])
    samples = synthetic_samples(model, [1, 1, 1, 1], text_lengths=[5, 6, 7, 8], seed=0)
    return Trainer(model, config, samples, processor.collator, tokenizer=tokenizer).fit()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    train_tiny(out)
    return out


@pytest.mark.parametrize("name", [".lock", "config.yaml", "log.jsonl"])
def test_a_link_at_a_runs_file_is_refused_never_written_through(name, trained, tmp_path):
    """A symbolic link planted at OUT/.lock, OUT/config.yaml or OUT/log.jsonl, pointing at a file outside OUT: resuming
    the run stops with an error that names the link and says to remove it, and the file it points to is untouched;
    so does a fresh run (whose old log is removed - the link itself - never written)."""
    import shutil

    from mmadapt.atomic import LinkedFileError

    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    member = out / name
    member.unlink()
    member.symlink_to(outside)
    refused = rf"{re_escape(member)} is a symbolic link \(to {re_escape(outside)}\): mmadapt never writes through a " \
              rf"link.*Fix: remove it \(rm {re_escape(member)}\)"
    with pytest.raises(LinkedFileError, match=refused):
        train_tiny(out, "train.steps=3", "checkpoint.resume=true")
    assert outside.read_text() == PRECIOUS and member.is_symlink()

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / name).symlink_to(outside)
    if name == "log.jsonl":
        train_tiny(fresh)
        assert not (fresh / name).is_symlink() and len((fresh / name).read_text().splitlines()) == 2
    else:
        with pytest.raises(LinkedFileError, match=refused.replace(re_escape(out), re_escape(fresh))):
            train_tiny(fresh)
    assert outside.read_text() == PRECIOUS


def test_a_hard_link_is_refused_and_a_plain_file_is_written(tmp_path):
    from mmadapt.atomic import LinkedFileError, open_unlinked

    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    (tmp_path / "hard").hardlink_to(outside)
    with pytest.raises(LinkedFileError, match=r"hard is a hard link \(the same file has another name\).*Fix: remove"):
        open_unlinked(tmp_path / "hard", "a")
    assert outside.read_text() == PRECIOUS
    (tmp_path / "plain").write_text("old, longer text")
    with open_unlinked(tmp_path / "plain", "w") as f:
        f.write("new")
    with open_unlinked(tmp_path / "plain", "a") as f:
        f.write("er")
    assert (tmp_path / "plain").read_text() == "newer"


def re_escape(path: Path) -> str:
    import re

    return re.escape(str(path))
