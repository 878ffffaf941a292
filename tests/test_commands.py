"""Every command the README and docs show, run as a user runs it: a separate process (`python -m mmadapt ...`) in a
fresh directory, on a tiny run trained there; and a run directory used where it is, not where its config says it was.

- `test_every_documented_command_runs_as_a_process`: train, plan, data check / show, chat, eval, sees, explain,
  export (both formats: a run, a checkpoint), serve with one request, list, check-model; each command line is one the
  pages show (`tests/test_docs.py` extracts them), with the pages' placeholders (runs/colours, step-0000400, port
  8000, ...) mapped onto this directory's files. `AutoProcessor` and `AutoModelForImageTextToText` load the
  transformers export, and its logits and greedy answer equal mmadapt's.
- `test_every_documented_command_is_run_here_or_by_a_named_test`: the commands the pages show are those run here, or
  listed with the test that runs them.
- `test_a_copied_run_resumes_in_the_copy_and_continues_bitwise`: a stopped run, copied elsewhere and resumed there
  (`mmadapt train COPY --resume`, from a third directory), writes only into the copy and its losses continue those of
  an uninterrupted run bitwise; the original's files are untouched, and once it is deleted chat and export read the
  copy alone. `RunConfig.load` takes a run directory given (or a run's config.yaml) as the run's train.out.
- `test_plan_imports_no_reward_code_unless_asked`: `mmadapt plan RUN` on a GRPO run whose config names a reward in
  code (a module that writes a marker when imported) leaves it out and says so; `--rewards` imports it.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import TINY_LLAVA, write_run
from test_docs import COMMANDS, write_inputs

ROOT = Path(__file__).parents[1]
RUN = "runs/train"

# The pages' placeholders, as this directory has them (a word of a documented command line -> the word run here).
PLACES = {"runs/colours": RUN, "runs/colours/model": f"{RUN}/model", "llama-tokenizer/": f"{RUN}/model"}
# Per command, the documented line run here (a placeholder as the page writes it; STEP and PORT are filled in).
RUNS = {
    "list": "list",
    "check-model": "check-model clip mlp2x_gelu qwen3_5",
    "train": "train run.yaml train.lr=2e-4",
    "plan": "plan run.yaml --gpus 8 --gpu-memory 80GiB",
    "data check": "data check data/train.jsonl --image-root data/images --json report.json",
    "data show": "data show d.jsonl --encoder clip --projector mlp2x_gelu --backbone llama --tokenizer "
                 "llama-tokenizer/ --n 1",
    "chat": 'chat runs/train --image photo.png "What is in this picture?"',
    "eval": "eval runs/train data/eval.jsonl --require-sees",
    "sees": "sees runs/train data/eval.jsonl",
    "explain": 'explain runs/train --image photo.png "What is in this picture?" --out evidence.png',
    "export": "export runs/train exported-hf/ --format transformers",
    "export (checkpoint)": "export runs/train/checkpoints/step-0000400 exported/",
    "train --resume": "train run.yaml --resume",
    "serve": "serve runs/colours/model --port 8000 --served-model-name colours",
}
# Exit codes that are answers, not failures: eval / sees say 1 when the model does not rest on its images (a tiny
# model trained two steps does not).
VERDICTS = {"eval": {0, 1}, "sees": {0, 1}}
# Commands the pages show that run elsewhere: a GPU or torchrun, a browser, or many minutes (the test that runs each).
ELSEWHERE = {
    "demo": "tests/test_demo.py::test_a_short_demo_run_passes_its_verdict_and_writes_every_output",
    "torchrun train": "tests/test_distributed.py::test_fsdp2_and_ddp_equal_one_process",
    "serve --ui": "tests/test_page_browser.py::test_the_pages_answer_is_mmadapt_chats_answer",
    "numerics dump": "tests/test_numerics.py::test_cli_dump",
    "numerics compare": "tests/test_numerics.py::test_cli_compare_writes_json_and_plot",
    "numerics lint-deepspeed": "tests/test_docs.py::test_cheap_commands_run_as_documented",
    "numerics deepspeed-config": "tests/test_docs.py::test_cheap_commands_run_as_documented",
}


def environment(tmp: Path) -> dict[str, str]:
    """This checkout's mmadapt, caches in `tmp`, one thread, nothing from the network."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "MMADAPT_CACHE": str(tmp / "cache"), "HF_DATASETS_CACHE": str(tmp / "cache" / "datasets"),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def mmadapt(folder: Path, line: str | list[str], env: dict[str, str], *, codes: set[int] = frozenset({0}),
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m mmadapt LINE` in `folder`, as a user runs it; its exit code must be one of `codes`."""
    argv = shlex.split(line) if isinstance(line, str) else line
    done = subprocess.run([sys.executable, "-m", "mmadapt", *argv], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode in codes and "error:" not in done.stderr, (
        f"mmadapt {shlex.join(argv)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def documented(line: str) -> bool:
    """`line` is a command line a page shows, word for word."""
    return any(c.argv == tuple(shlex.split(line)) for c in COMMANDS)


def placed(line: str, step: str, port: int) -> list[str]:
    """The documented `line` as argv here: its placeholders mapped onto this directory (`PLACES`, the checkpoint's
    step, a free port)."""
    words = [PLACES.get(w, w).replace("step-0000400", step) for w in shlex.split(line)]
    return [str(port) if w == "8000" and words[k - 1] == "--port" else w for k, w in enumerate(words)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_workspace(folder: Path) -> None:
    """The pages' files: data/ (train.jsonl, pairs.jsonl, images), data/eval.jsonl (its image paths from its folder,
    as eval reads them), d.jsonl (from here), photo.png, and run.yaml: a tiny LLaVA trained two steps into runs/train,
    a checkpoint each step."""
    from PIL import Image

    write_inputs(folder)
    records = [json.loads(line) for line in (folder / "data" / "train.jsonl").read_text().splitlines()]
    for path, root in ((folder / "data" / "eval.jsonl", "images"), (folder / "d.jsonl", "data/images")):
        path.write_text("".join(json.dumps({**r, "image": f"{root}/{r['image']}"}) + "\n" for r in records))
    Image.new("RGB", (32, 24), (200, 30, 30)).save(folder / "photo.png")
    write_run(folder / "run.yaml", model=TINY_LLAVA,
              data={"train": "data/train.jsonl", "image_root": "data/images", "batch_size": 2},
              train={"steps": 2, "out": RUN, "progress": False}, checkpoint={"every": 1})


# ---- every documented command, as a process --------------------------------------------------------------------------
def test_every_documented_command_is_run_here_or_by_a_named_test():
    for key, line in RUNS.items():
        assert documented(line), f"{key}: {line!r} is not a command line the pages show"
    shown = {c.key for c in COMMANDS}
    ran = {key.split(" (")[0] for key in RUNS} - {"train --resume"}
    assert not shown - ran - set(ELSEWHERE), f"documented commands run nowhere: {shown - ran - set(ELSEWHERE)}"
    for key, test in ELSEWHERE.items():
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{key}: {test} does not exist"


@pytest.mark.slow
def test_every_documented_command_runs_as_a_process(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    write_workspace(folder)
    env = environment(tmp_path)
    port = free_port()

    def run(key: str, **kw) -> subprocess.CompletedProcess:
        return mmadapt(folder, placed(RUNS[key], step, port), env, codes=VERDICTS.get(key, {0}), **kw)

    step = "step-0000400"
    trained = run("train")
    assert f"outputs in {RUN}" in trained.stdout and (folder / RUN / "model" / "config.json").is_file()
    step = sorted(p.name for p in (folder / RUN / "checkpoints").iterdir())[-1]
    assert "names code" not in run("plan").stderr
    run("data check")
    assert json.loads((folder / "report.json").read_text())["ok"] == 3
    assert "What colour is this?" in run("data show").stdout
    assert "qwen3_5" in run("list").stdout and run("check-model")
    assert run("chat").stdout.strip()
    assert "blanked" in run("eval").stdout and run("sees").stdout.strip()
    run("explain")
    assert (folder / "evidence.png").stat().st_size > 0
    run("export")
    run("export (checkpoint)")
    assert (folder / "exported" / "config.json").is_file()
    run("train --resume")
    served = served_answer(folder, placed(RUNS["serve"], step, port), env, port)
    assert served["model"] == "colours" and served["choices"][0]["message"]["role"] == "assistant"
    transformers_export_equals_mmadapt(folder / "exported-hf", folder / RUN / "model", folder / "photo.png")


def served_answer(folder: Path, argv: list[str], env: dict[str, str], port: int) -> dict:
    """Start `mmadapt serve` as a process, send one chat request with an image when it is up, stop it."""
    import httpx

    server = subprocess.Popen([sys.executable, "-m", "mmadapt", *argv], cwd=folder, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert server.poll() is None, f"mmadapt {shlex.join(argv)} ended:\n{server.stdout.read()[-3000:]}"
        body = {"model": "colours", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
                (folder / "photo.png").read_bytes()).decode()}},
            {"type": "text", "text": "What colour is this?"}]}]}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def transformers_export_equals_mmadapt(export: Path, model_dir: Path, image_path: Path) -> None:
    """The export loads with AutoProcessor and AutoModelForImageTextToText; its inputs, logits (<= 1e-5) and
    greedy answer equal mmadapt's model's."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmadapt import Processor, VisionLanguageModel

    image = Image.open(image_path).convert("RGB")
    theirs_processor = AutoProcessor.from_pretrained(export)
    conversation = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": "What colour is this?"}]}]
    inputs = theirs_processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="pt")
    ours_model = VisionLanguageModel.from_pretrained(model_dir).eval()
    processor = Processor.from_pretrained(model_dir)
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    ours = processor(question, images=[image])
    assert inputs["input_ids"].tolist() == ours["input_ids"].tolist()
    theirs = AutoModelForImageTextToText.from_pretrained(export).eval()
    with torch.no_grad():
        theirs_logits = theirs(**inputs).logits
        ours_logits = ours_model(**ours).logits
        assert (theirs_logits - ours_logits).abs().max() <= 1e-5
        theirs_answer = theirs.generate(**inputs, max_new_tokens=4, do_sample=False)[:, inputs["input_ids"].shape[1]:]
        ours_answer = ours_model.generate(**ours, max_new_tokens=4)
    assert theirs_answer.tolist() == ours_answer[:, -theirs_answer.shape[1]:].tolist()


# ---- a run is used where it is ---------------------------------------------------------------------------------------
def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and mtime (ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def logged_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())}


def test_a_copied_run_resumes_in_the_copy_and_continues_bitwise(tmp_path, monkeypatch):
    from mmadapt.cli import main
    from mmadapt.train import RunConfig, Trainer

    work = tmp_path / "work"
    work.mkdir()
    write_workspace(work)
    monkeypatch.chdir(work)
    settings = ["train.steps=4", "checkpoint.every=2", "train.schedule=cosine", "train.lr=1e-3"]
    assert main(["train", "run.yaml", *settings, "train.out=runs/full"]) == 0
    original = Trainer.save

    def save_then_stop(self, **kwargs):
        original(self, **kwargs)
        if self.step == 2:
            raise KeyboardInterrupt  # the job is stopped right after its step-2 checkpoint

    monkeypatch.setattr(Trainer, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        main(["train", "run.yaml", *settings, "train.out=runs/cut"])
    monkeypatch.setattr(Trainer, "save", original)
    copy = tmp_path / "elsewhere" / "kept"
    shutil.copytree(work / "runs" / "cut", copy)
    before = listing(work / "runs" / "cut")
    saved = yaml.safe_load((copy / "config.yaml").read_text())["train"]["out"]
    assert Path(saved) == work / "runs" / "cut"  # the copy's config names the original's place

    (tmp_path / "third").mkdir()
    monkeypatch.chdir(tmp_path / "third")
    assert main(["train", str(copy), "--resume"]) == 0
    assert RunConfig.load(copy / "config.yaml").train.out == str(copy)  # its config file stands for it too
    assert listing(work / "runs" / "cut") == before  # nothing written to, or created in, the original
    assert (copy / "model" / "config.json").is_file() and (copy / "checkpoints" / "step-0000004").is_dir()
    assert Path(yaml.safe_load((copy / "config.yaml").read_text())["train"]["out"]) == copy
    full, resumed = logged_losses(work / "runs" / "full"), logged_losses(copy)
    assert sorted(resumed) == [1, 2, 3, 4] and resumed == full  # bitwise
    assert not (tmp_path / "third" / "runs").exists()
    shutil.rmtree(work / "runs" / "cut")  # the copy needs nothing of the original: chat and export read it alone
    assert main(["chat", str(copy), "--image", str(work / "photo.png"), "--max-new-tokens", "2", "Colour?"]) == 0
    assert main(["export", str(copy), "exported-hf", "--format", "transformers"]) == 0
    assert (tmp_path / "third" / "exported-hf" / "preprocessor_config.json").is_file()


def test_a_run_directory_given_is_the_runs_train_out_and_a_users_config_keeps_its_own(tmp_path):
    """`RunConfig.load(OUT)` (checkpoints or not yet) and `RunConfig.load(OUT/config.yaml)` of a run take OUT as
    train.out, whatever the saved config says; a user's config.yaml outside a run keeps the train.out it names."""
    from mmadapt.train import RunConfig

    elsewhere = str(tmp_path / "where-it-was")
    for name in ("started", "checkpointed", "user"):
        (tmp_path / name).mkdir()
        write_run(tmp_path / name / "config.yaml", train={"out": elsewhere})
    (tmp_path / "checkpointed" / "checkpoints").mkdir()
    assert RunConfig.load(tmp_path / "started").train.out == str(tmp_path / "started")
    assert RunConfig.load(tmp_path / "checkpointed" / "config.yaml").train.out == str(tmp_path / "checkpointed")
    assert RunConfig.load(tmp_path / "user" / "config.yaml").train.out == elsewhere
    assert RunConfig.load(tmp_path / "started", [f"train.out={elsewhere}"]).train.out == elsewhere  # asked for


# ---- plan and the code a config names --------------------------------------------------------------------------------
def test_plan_imports_no_reward_code_unless_asked(tmp_path, monkeypatch, capsys):
    """A GRPO run whose grpo.rewards names `planted_reward:score`, a module that writes a marker when imported:
    `mmadapt plan RUN` leaves it out (one line saying so) and the marker is never written; `--rewards` imports it."""
    marker = tmp_path / "imported"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "planted_reward.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        "def score(completions, **columns):\n    return [0.0 for _ in completions]\n")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Say red.", "solution": "red"}) + "\n")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # a run directory (its config saved as the trainer saves it)
    write_run(run / "config.yaml", model=TINY_LLAVA, data={"train": tmp_path / "prompts.jsonl", "batch_size": 1},
              train={"objective": "grpo", "rewards": ["accuracy", "planted_reward:score"], "out": run},
              grpo={"num_generations": 2, "max_completion_length": 4})
    from mmadapt.cli import main

    monkeypatch.syspath_prepend(str(tmp_path / "code"))  # importable: only never asked for
    monkeypatch.delitem(sys.modules, "planted_reward", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(run), "--device", "cpu", "--json"]) == 0
    plain = capsys.readouterr()
    assert not marker.exists() and "planted_reward" not in sys.modules
    assert "grpo.rewards names code ['planted_reward:score'], not imported" in plain.err
    assert "--rewards accuracy,planted_reward:score" in plain.err
    assert json.loads(plain.out)["per_gpu"]["total"] > 0
    assert main(["plan", str(run), "--device", "cpu", "--json", "--rewards", "accuracy,planted_reward:score"]) == 0
    asked = capsys.readouterr()
    assert marker.exists() and "not imported" not in asked.err
    assert json.loads(asked.out)["per_gpu"] == json.loads(plain.out)["per_gpu"]
    monkeypatch.delitem(sys.modules, "planted_reward")
