"""lmms-eval: `--model mmadapt`, `--model openai` against `mmadapt serve`, and the in-memory model, all score what
mmadapt's own generation answers.

The task is local and offline: a JSON file of images (colour squares drawn with PIL, digits from scikit-learn), each
with a question, read by a YAML task (`dataset_path: json`) through `--include_path`. The model is a tiny random
Qwen3-VL with Qwen's real tokenizer and the Qwen3-VL template, so its answers are words that depend on the image.
Each answer is computed directly (`Processor` + `model.generate`, one request at a time) and the JSON's expected
answers are chosen from them: every other doc expects the model's own answer, the others an answer it never gives.
Every harness must then report exactly 0.5, and every per-sample answer must equal the direct one (matches and misses
both); a second task with a stop string (`until`) must report the answers cut before it.

lmms-eval starts slowly (its command line imports torch, transformers, datasets and evaluate: about 15 s of CPU,
25 s of wall time on 2 busy cores), so the command-line tests are marked slow; the in-process ones share one import.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("lmms_eval", reason="lmms-eval is the optional extra mmadapt[lmms]: pip install -e '.[test]'")

import mmadapt
from mmadapt import Processor, VisionLanguageModel
from mmadapt.data.templates import TEMPLATES

TASK, STOP_TASK = "mmadapt_probe", "mmadapt_probe_stop"
MAX_NEW_TOKENS = 4
MISS = "(an answer the model never gives)"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_MODE": "disabled",
           # any request that leaves this machine fails at once; 127.0.0.1 (mmadapt serve) is reached directly
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


def direct_answer(model, processor, image, question: str, system: str | None = None) -> str:
    """What mmadapt answers one request with, without lmms-eval: the chat messages lmms-eval builds (the image, then
    the question), the Processor, greedy `generate`, decoded up to the end token."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    with torch.no_grad():
        ids = model.generate(**processor([messages], images=[[image]]), max_new_tokens=MAX_NEW_TOKENS,
                             eos_token_id=processor.eos_token_ids,
                             pad_token_id=processor.encoder.pad_token_id)[0].tolist()
    ends = set(processor.eos_token_ids)
    return processor.decode(ids[:next((k + 1 for k, t in enumerate(ids) if t in ends), len(ids))])


def images_and_questions(root: Path) -> list[tuple[Path, str]]:
    from sklearn.datasets import load_digits

    out = []
    for name, rgb in (("red", (220, 20, 20)), ("green", (20, 200, 20)), ("blue", (20, 20, 220))):
        Image.new("RGB", (32, 32), rgb).save(root / f"{name}.png")
        out.append((root / f"{name}.png", "What colour is this square?"))
    digits = load_digits()
    for k in range(3):
        pixels = (digits.images[k] * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels).convert("RGB").resize((32, 32), Image.NEAREST).save(root / f"digit{k}.png")
        out.append((root / f"digit{k}.png", "Which digit is this?"))
    return out


def task_yaml(name: str, data: Path, until: list[str]) -> str:
    return json.dumps({  # JSON is YAML
        "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "generate_until", "doc_to_visual": "image", "doc_to_text": "question",
        "doc_to_target": "answer", "generation_kwargs": {"max_new_tokens": MAX_NEW_TOKENS, "until": until},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}, indent=1)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The saved tiny model, the task files, the direct answers and the scores they give."""
    from real_tokenizers import real_tokenizer

    root = tmp_path_factory.mktemp("lmms")
    tokenizer = real_tokenizer("qwen3")
    tokenizer.chat_template = TEMPLATES.get("qwen3_vl").jinja(tokenizer)
    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_vl_vit", "qwen_merger",
                                {"name": "qwen3_vl", "options": {"vocab_size": len(tokenizer)}}).eval()
    Processor.for_model(model, tokenizer)  # the span tokens, as training adds them
    model.save_pretrained(root / "model", tokenizer=tokenizer)
    model = VisionLanguageModel.from_pretrained(root / "model").eval()
    processor = Processor.from_pretrained(root / "model")
    docs = images_and_questions(root)
    direct = [direct_answer(model, processor, path, question) for path, question in docs]
    assert len(set(direct)) > 1, f"the tiny model answers every image alike ({direct[0]!r}): choose another seed"
    expected = [answer if k % 2 == 0 else MISS for k, answer in enumerate(direct)]
    data = root / "probe.json"
    data.write_text(json.dumps([{"id": k, "image": str(path), "question": question, "answer": answer}
                                for k, ((path, question), answer) in enumerate(zip(docs, expected, strict=True))]))
    # a stop string that occurs inside some answers (not at their start), to see `until` cut them
    stop = next(a[2:4] for a in direct if len(a) >= 4 and a[2:4].strip())
    cut = [a[:a.find(stop)] if stop in a else a for a in direct]
    assert cut != direct, "the stop string must cut an answer"
    (root / "tasks").mkdir()
    (root / "tasks" / f"{TASK}.yaml").write_text(task_yaml(TASK, data, []))
    (root / "tasks" / f"{STOP_TASK}.yaml").write_text(task_yaml(STOP_TASK, data, [stop]))
    return argparse.Namespace(root=root, model_dir=root / "model", model=model, tokenizer=processor.tokenizer,
                              tasks=root / "tasks", direct=direct, expected=expected, stop=stop, cut=cut,
                              score=float(np.mean([a == e for a, e in zip(direct, expected, strict=True)])),
                              stop_score=float(np.mean([c == e for c, e in zip(cut, expected, strict=True)])))


def test_the_probe_is_not_vacuous(probe):
    assert probe.score == 0.5
    assert probe.stop_score < probe.score  # the stop string changes the score


# ---- the command line ---------------------------------------------------------------------------------------------
def lmms_eval_cli(args: list[str], cwd: Path) -> tuple[dict, dict, float]:
    """Run `lmms-eval eval ARGS --output_path OUT --log_samples` offline: (results, {task: answers by doc}, seconds)."""
    exe = shutil.which("lmms-eval", path=str(Path(sys.executable).parent)) or shutil.which("lmms-eval")
    assert exe, "the lmms-eval command is not installed"
    out = cwd / "out"
    started = time.perf_counter()
    done = subprocess.run([exe, "eval", *args, "--output_path", str(out), "--log_samples"], cwd=cwd,
                          env={**os.environ, **OFFLINE, "HF_HOME": str(cwd / "hf")},
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    assert done.returncode == 0 and list(out.rglob("*_results.json")), done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(next(out.rglob("*_results.json")).read_text())
    samples = {}
    for path in out.rglob("*_samples_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[path.stem.split("_samples_")[1]] = [r["filtered_resps"] for r in sorted(rows,
                                                                                        key=lambda r: r["doc_id"])]
    return results, samples, seconds


@pytest.mark.slow
def test_lmms_eval_model_mmadapt_scores_the_direct_answers(probe, tmp_path):
    results, samples, seconds = lmms_eval_cli(
        ["--model", "mmadapt", "--model_args", f"pretrained={probe.model_dir},record={tmp_path / 'record.json'}",
         "--include_path", str(probe.tasks), "--tasks", f"{TASK},{STOP_TASK}", "--batch_size", "2",
         "--limit", str(len(probe.direct))], tmp_path)
    print(f"lmms-eval eval --model mmadapt, 2 tasks x {len(probe.direct)} docs: {seconds:.1f} s")
    assert results["results"][TASK]["exact_match,none"] == probe.score
    assert results["results"][STOP_TASK]["exact_match,none"] == probe.stop_score
    assert samples[TASK] == probe.direct and samples[STOP_TASK] == probe.cut
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["model"]["source"] == str(probe.model_dir.resolve())
    assert record["model"]["sha256"] == state_sha256(probe.model)
    assert record["template"]["name"] == "qwen3_vl" and record["mmadapt_version"] == mmadapt.__version__
    assert "max_pixels=" in record["image_processor"] and record["generation"]["batch_size"] == 2
    assert record["generation"]["by_task"][STOP_TASK]["decoding"]["stop"] == [probe.stop]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_lmms_eval_model_openai_against_mmadapt_serve_gives_the_same_score(probe, tmp_path):
    """`--model openai` sends no stop strings (`until`), so only the task without one is compared."""
    pytest.importorskip("fastapi", reason="mmadapt serve is the optional extra mmadapt[serve]")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mmadapt", "serve", str(probe.model_dir), "--port", str(port),
                               "--served-model-name", "probe", "--device", "cpu", "--log-level", "warning"],
                              env={**os.environ, **OFFLINE}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, f"mmadapt serve exited: {server.stdout.read()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "mmadapt serve did not answer /health within 180 s"
                time.sleep(0.5)
        results, samples, seconds = lmms_eval_cli(
            ["--model", "openai", "--model_args", f"model=probe,base_url=http://127.0.0.1:{port}/v1,api_key=unused,"
             "num_concurrent=1,max_retries=1", "--include_path", str(probe.tasks), "--tasks", TASK,
             "--limit", str(len(probe.direct))], tmp_path)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"lmms-eval eval --model openai against mmadapt serve, {len(probe.direct)} docs: {seconds:.1f} s")
    assert samples[TASK] == probe.direct
    assert results["results"][TASK]["exact_match,none"] == probe.score


# ---- in this process ----------------------------------------------------------------------------------------------
def state_sha256(model) -> str:
    from mmadapt.lmms_eval.model import state_sha256 as of

    return of(model)


def test_the_entry_point_makes_model_mmadapt_the_chat_model():
    from lmms_eval.models import get_model, get_model_manifest

    from mmadapt.lmms_eval.plugin import MANIFEST, MmadaptModel

    assert get_model_manifest("mmadapt") == MANIFEST
    assert get_model("mmadapt") is MmadaptModel and MmadaptModel.is_simple is False


def test_simple_evaluate_on_the_model_in_memory_scores_the_direct_answers(probe):
    """nanoVLM's way (`simple_evaluate(model=instance)`), batched: the same answers, `until` honoured."""
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    from mmadapt.lmms_eval.plugin import MmadaptModel

    lm = MmadaptModel.from_model(probe.model, probe.tokenizer, batch_size=3)
    tasks = TaskManager("WARNING", include_path=str(probe.tasks), include_defaults=False)
    results = simple_evaluate(model=lm, tasks=[TASK, STOP_TASK], task_manager=tasks, verbosity="WARNING")
    answers = {task: [s["filtered_resps"][0] for s in sorted(rows, key=lambda s: s["doc_id"])]
               for task, rows in results["samples"].items()}
    assert answers == {TASK: probe.direct, STOP_TASK: probe.cut}
    assert results["results"][TASK]["exact_match,none"] == probe.score
    assert results["results"][STOP_TASK]["exact_match,none"] == probe.stop_score
    assert lm.record["model"]["sha256"] == state_sha256(probe.model) and lm.model is probe.model  # not dropped
    assert not probe.model.training


def test_generate_until_called_as_the_evaluator_calls_it_answers_and_records_a_bad_request(probe):
    """lmms-eval's chat requests built by hand: a request with a part mmadapt does not read (audio) is answered "" and
    recorded, its batch's other request is answered; the system prompt goes first where the task gives none."""
    from lmms_eval.api.instance import Instance

    from mmadapt.lmms_eval.plugin import MmadaptModel

    docs = json.loads((probe.root / "probe.json").read_text())

    def messages(doc):
        first = {"type": "audio", "url": "a.wav"} if doc["id"] == 1 else {"type": "image", "url": doc["image"]}
        return [{"role": "user", "content": [first, {"type": "text", "text": doc["question"]}]}]

    def requests(ids):
        return [Instance("generate_until", (docs[k]["question"], messages, {"max_new_tokens": MAX_NEW_TOKENS},
                                            k, TASK, "test"), idx=0, metadata={"task": TASK, "doc_id": k, "repeats": 1})
                for k in ids]

    lm = MmadaptModel.from_model(probe.model, probe.tokenizer, batch_size=2)
    lm.task_dict = {TASK: {"test": docs}}
    assert [r.text for r in lm.generate_until(requests([0, 1, 2]))] == [probe.direct[0], "", probe.direct[2]]
    assert list(lm.record["generation"]["by_task"][TASK]["problems"]) == ["1"]
    system = "Answer with one word."
    lm = MmadaptModel.from_model(probe.model, probe.tokenizer, system_prompt=system)
    lm.task_dict = {TASK: {"test": docs}}
    [answer] = lm.generate_until(requests([3]))
    assert answer.text == direct_answer(probe.model, Processor.from_pretrained(probe.model_dir), docs[3]["image"],
                                        docs[3]["question"], system=system)
    assert lm.record["system_prompt"] == system


def test_what_the_plugin_does_not_do_is_an_error_that_says_what_to_use(probe):
    from lmms_eval.api.instance import Instance

    from mmadapt.lmms_eval.model import task_sampling
    from mmadapt.lmms_eval.plugin import MmadaptModel, parse_batch_size

    lm = MmadaptModel.from_model(probe.model, probe.tokenizer)
    request = Instance("loglikelihood", ("ctx", "target", None, 0, TASK, "test"), idx=0,
                       metadata={"task": TASK, "doc_id": 0, "repeats": 1})
    with pytest.raises(NotImplementedError, match=r"generate_until variant.*llava_hf"):
        lm.loglikelihood([request])
    with pytest.raises(NotImplementedError, match=r"multi-round.*--model vllm"):
        lm.generate_until_multi_round([request])
    with pytest.raises(ValueError, match=r"num_beams=4.*--gen_kwargs num_beams=1"):
        task_sampling({"num_beams": 4}, max_new_tokens=8, seed=0, task=TASK)
    with pytest.raises(ValueError, match=r"no 'auto'"):
        parse_batch_size("auto")
    with pytest.raises(TypeError, match=r"takes no model_args \['prettrained'\]"):
        MmadaptModel(prettrained=str(probe.model_dir))


def test_sampling_follows_the_task_gen_kwargs():
    from mmadapt.lmms_eval.model import task_sampling

    def resolve(**gen_kwargs):
        return task_sampling(gen_kwargs, max_new_tokens=64, seed=7, task=TASK)

    greedy, ignored = resolve(until=["\n\n"], do_sample=False, temperature=0.7, num_beams=1, image_aspect_ratio="pad")
    assert (greedy.temperature, greedy.max_new_tokens, greedy.stop, greedy.seed) == (0.0, 64, ("\n\n",), 7)
    assert ignored == ["image_aspect_ratio"]
    sampled, _ = resolve(do_sample=True, top_p=0.9, until="Q:", max_new_tokens=3, seed=1)
    assert (sampled.temperature, sampled.top_p, sampled.stop, sampled.max_new_tokens, sampled.seed) == (
        1.0, 0.9, ("Q:",), 3, 1)
    assert resolve(temperature=0.5)[0].temperature == 0.5
    assert resolve(until=["B", "", "A"])[0].stop == ("B", "A")  # the answer is cut before the first (TextStream)


# ---- a training run's train.eval_tasks ------------------------------------------------------------------------------
def test_eval_tasks_are_checked_before_training_starts(probe, tmp_path):
    from mmadapt.lmms_eval.tasks import check_eval_tasks
    from mmadapt.train.config import RunConfig

    with pytest.raises(ValueError, match=r"train.eval_tasks must be a list"):
        RunConfig.from_dict({"train": {"eval_tasks": [""]}})
    with pytest.raises(ValueError, match=r"runs in one process, and this run has 2"):
        check_eval_tasks([TASK], world=2, tokenizer=probe.tokenizer)
    with pytest.raises(FileNotFoundError, match=r"task file .*missing.yaml does not exist"):
        check_eval_tasks([str(tmp_path / "missing.yaml")], world=1, tokenizer=probe.tokenizer)
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    with pytest.raises(ValueError, match=r"nameless.yaml names no task"):
        check_eval_tasks([str(tmp_path / "nameless.yaml")], world=1, tokenizer=probe.tokenizer)
    check_eval_tasks([str(probe.tasks / f"{TASK}.yaml")], world=1, tokenizer=probe.tokenizer)


@pytest.mark.slow
def test_an_unknown_eval_task_name_is_refused_before_training(probe):
    from mmadapt.lmms_eval.tasks import check_eval_tasks

    with pytest.raises(ValueError, match=r"knows no task 'no_such_task'.*lmms-eval tasks list"):
        check_eval_tasks(["no_such_task"], world=1, tokenizer=probe.tokenizer)


def train(probe, out: Path, eval_tasks: list[str]) -> dict:
    from mmadapt.train.config import RunConfig
    from mmadapt.train.run import run

    records = [{"id": f"s{k}", "image": str(path), "conversations": [
        {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": "an answer"}]}
        for k, (path, question) in enumerate(images_and_questions(probe.root))]
    (probe.root / "train.json").write_text(json.dumps(records))
    config = RunConfig.from_dict({
        "model": {"pretrained": str(probe.model_dir)},
        "data": {"train": str(probe.root / "train.json"), "batch_size": 2, "allow_outside_root": True},
        "train": {"steps": 2, "lr": 1e-3, "eval_every": 1, "eval_tasks": eval_tasks, "out": str(out),
                  "progress": False}})
    return run(config)


@pytest.mark.slow
def test_train_eval_tasks_logs_the_scores_of_the_weights_of_each_step_and_changes_no_training(probe, tmp_path):
    task = str(probe.tasks / f"{TASK}.yaml")
    summary = train(probe, tmp_path / "with", [task])
    plain = train(probe, tmp_path / "without", [])
    assert [r["loss"] for r in summary["history"]] == [r["loss"] for r in plain["history"]]  # RNG and modes kept
    logged = [json.loads(line) for line in (tmp_path / "with" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if f"lmms/{TASK}/exact_match" in r] == [1, 2]
    final = json.loads((tmp_path / "with" / "lmms_eval" / "step-0000002.json").read_text())
    model = VisionLanguageModel.from_pretrained(tmp_path / "with" / "model").eval()
    processor = Processor.from_pretrained(tmp_path / "with" / "model")
    direct = [direct_answer(model, processor, path, question) for path, question in images_and_questions(probe.root)]
    assert [s["answer"] for s in final["samples"][TASK]] == direct  # the trained weights of step 2, answered alike
    expected = float(np.mean([a == e for a, e in zip(direct, probe.expected, strict=True)]))
    assert final["scores"][f"lmms/{TASK}/exact_match"] == logged[-1][f"lmms/{TASK}/exact_match"] == expected
    assert final["record"]["model"]["sha256"] == state_sha256(model)
    assert final["record"]["model"]["source"].endswith("step 2 (in memory)")


def test_a_task_file_is_indexed_alone_and_its_folders_other_task_files_never_run(tmp_path):
    """A task file is code (`!function` imports Python from its folder). A folder holds the named task file (its
    function in utils.py beside it, its data file named relative to it) and two other task files whose `!function`
    module writes a marker when imported: one claims the named task's name, one is a task of its own. Indexing the
    named file and loading its task as lmms-eval does reads it whole (its function, its data file resolved from its
    own folder) and never the others: no marker. Indexing the whole folder (lmms-eval's `--include_path`) would have
    reached them."""
    from lmms_eval import utils
    from lmms_eval.tasks import TaskManager

    from mmadapt.lmms_eval.tasks import check_eval_tasks, task_manager, task_names

    folder, marker = tmp_path / "tasks", tmp_path / "MARKER"
    folder.mkdir()
    (folder / "utils.py").write_text("def doc_to_text(doc):\n    return 'Q: ' + doc['question']\n")
    (folder / "data.json").write_text(json.dumps([{"question": "why?", "answer": "because"}]))
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n\n\n"
                                    "def doc_to_text(doc):\n    return ''\n")
    body = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data.json\ntest_split: test\n"
            "output_type: generate_until\ndoc_to_target: answer\n")
    (folder / "named.yaml").write_text(f"task: mmadapt_named\ndoc_to_text: !function utils.doc_to_text\n{body}")
    (folder / "shadow.yaml").write_text(f"task: mmadapt_named\ndoc_to_text: !function evil.doc_to_text\n{body}")
    (folder / "other.yaml").write_text(f"task: mmadapt_other\ndoc_to_text: !function evil.doc_to_text\n{body}")

    tasks = [str(folder / "named.yaml")]
    names, include = task_names(tasks)
    assert names == ["mmadapt_named"] and task_names(tasks)[1] == include  # one private folder per process
    assert folder not in [Path(p) for p in include] and not (set(os.listdir(include[0])) & set(os.listdir(folder)))
    manager = task_manager(include, defaults=False)
    assert manager.all_tasks == ["mmadapt_named"]
    check_eval_tasks(tasks, world=1, tokenizer=object())
    config = utils.load_yaml_config(manager.task_index["mmadapt_named"]["yaml_path"], mode="full")  # as a run loads
    assert config["doc_to_text"]({"question": "why?"}) == "Q: why?"
    assert str(folder / "data.json") in json.dumps(config["dataset_kwargs"])
    assert not marker.exists()

    whole = TaskManager("WARNING", include_path=str(folder), include_defaults=False)
    assert "mmadapt_other" in whole.all_tasks
    utils.load_yaml_config(whole.task_index["mmadapt_other"]["yaml_path"], mode="full")
    assert marker.exists()  # what indexing the whole folder would have let run
