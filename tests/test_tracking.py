"""Following a run: `train.report_to` (jsonl, TensorBoard, W&B offline), the step's time split, throughput, peak
memory, the end-of-run summary and the slow-data warning (mmadapt.train.tracking)."""

from __future__ import annotations

import json
import logging
import time

import pytest
from helpers import write_jsonl, write_run
from test_train import QWEN, tiny

from mmadapt.data import Collator
from mmadapt.synthetic import synthetic_samples
from mmadapt.train import RunConfig, Trainer
from mmadapt.train.tracking import speed_table

SCALARS = ("loss", "grad_norm", "lr", "tokens_per_s", "supervised_per_s", "samples_per_s", "images_per_s",
           "peak_memory_mib", "skipped_steps", "bad_samples", "time/data", "time/vision", "time/llm",
           "time/optimizer", "time/step")


def fit(tmp_path, *overrides, data=None):
    model = tiny(QWEN)
    samples = data if data is not None else synthetic_samples(model, [1, 0, 2, 1] * 3,
                                                              text_lengths=[6 + k % 5 for k in range(12)])
    config = RunConfig.load(None, [f"train.out={tmp_path}", "train.progress=false", "train.steps=3",
                                   "data.batch_size=2", "stages.encoder=full", *overrides])
    return Trainer(model, config, samples, Collator.for_model(model, 0)).fit()


def wandb_history(directory) -> list[dict]:
    """The `history` records of an offline W&B run, read back from its .wandb file: a LevelDB-style log (a 7-byte
    file header, 32 KiB blocks of records with a 7-byte header each: crc, length, type FULL / FIRST / MIDDLE /
    LAST) of `wandb_internal_pb2.Record` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    data, block, position, records, pending = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # the block's padding
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.mark.slow
def test_tensorboard_and_wandb_offline_get_every_scalar(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = fit(tmp_path, "train.report_to=[tensorboard, wandb]")
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert set(SCALARS) <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in summary["history"]])
    assert [e.step for e in events.Scalars("time/step")] == [1, 2, 3]
    assert "config" in " ".join(events.Tags()["tensors"])  # the run config, once
    rows = wandb_history(tmp_path)
    assert len(rows) == 3 and set(SCALARS) <= set(rows[0])
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in summary["history"]])
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged] == [r["loss"] for r in summary["history"]]


def test_the_time_split_sums_to_the_step_and_throughput_counts_every_sample(tmp_path):
    history = fit(tmp_path, "train.grad_accum=2")["history"]
    for record in history:
        t = record["time"]
        parts = t["data"] + t["vision"] + t["llm"] + t["optimizer"]
        assert abs(parts - t["step"]) <= 0.05 * t["step"], t
        assert t["vision"] > 0 and t["llm"] > 0  # the encoder trains: its forward and backward are timed
        assert record["samples_per_s"] * t["step"] == pytest.approx(4)  # 2 micro-batches of 2 samples
        assert record["supervised_per_s"] * t["step"] == pytest.approx(record["tokens"])
        assert record["tokens_per_s"] > record["supervised_per_s"] and record["peak_memory_mib"] > 0
    # 3 steps of 4 samples: each of the 12 samples (1, 0, 2, 1 images, three times) once
    assert sum(r["images_per_s"] * r["time"]["step"] for r in history) == pytest.approx(12)


def test_the_summary_table_and_an_unknown_reporter(tmp_path):
    table = speed_table(fit(tmp_path)["speed"])
    assert table.startswith("| step s | data | vision | LLM | optimizer | tokens/s |") and table.count("\n") == 2
    with pytest.raises(ValueError, match=r"train.report_to: unknown \['mlflow'\]; known: \['jsonl', 'tensorboard'"):
        RunConfig.load(None, ["train.report_to=[mlflow]"])


class SlowSamples(list):
    """Samples that each take `DATA_SECONDS` to load on the trainer's clock (a fake clock: the test does not depend
    on how fast this machine computes a step)."""

    delay = 0.0

    def __getitem__(self, index):
        SlowSamples.delay += DATA_SECONDS
        return super().__getitem__(index)


DATA_SECONDS = 10.0  # far above any machine's step time for this tiny model: the data share is > 0.9


def test_a_step_that_waits_for_data_says_so_once(tmp_path, caplog, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr("mmadapt.train.trainer.time",
                        SimpleNamespace(perf_counter=lambda: time.perf_counter() + SlowSamples.delay))
    # a library that configured logging earlier in this process (dictConfig) may have disabled existing loggers
    monkeypatch.setattr(logging.getLogger("mmadapt.train.trainer"), "disabled", False)
    model = tiny(QWEN)
    data = SlowSamples(synthetic_samples(model, [1, 0] * 6, text_lengths=[4] * 12))
    with caplog.at_level(logging.WARNING, logger="mmadapt.train.trainer"):
        fit(tmp_path, "train.steps=5", data=data)
    warnings = [r.getMessage() for r in caplog.records if "for data" in r.getMessage()]
    assert len(warnings) == 1 and "data.num_workers, now 0" in warnings[0] and "packing" in warnings[0]


def test_each_step_logs_its_flops_per_part_and_mfu_against_the_peak(tmp_path):
    from mmadapt.flops import step_flops

    model = tiny(QWEN)
    samples = synthetic_samples(model, [1, 0, 2, 1], text_lengths=[6, 7, 8, 9])
    config = RunConfig.load(None, [f"train.out={tmp_path}", "train.progress=false", "train.steps=2",
                                   "data.batch_size=4", "stages.encoder=full", "train.peak_tflops=0.5"])
    collate = Collator.for_model(model, 0)
    expected = step_flops(model, collate(samples)).step  # one micro-batch of the 4 samples: each step's
    summary = Trainer(model, config, samples, collate).fit()
    for record in summary["history"]:
        assert record["flops"]["total"] == pytest.approx(sum(expected.values()))
        assert record["flops"]["vision"] == pytest.approx(expected["vision"]) and expected["vision"] > 0
        assert record["tflops_per_s"] == pytest.approx(record["flops"]["total"] / record["time"]["step"] / 1e12)
        assert record["mfu"] == pytest.approx(record["tflops_per_s"] / 0.5)
        assert 0 < record["vision_flops_share"] < 1
    assert "mfu" in summary["speed"] and speed_table(summary["speed"]).splitlines()[2].endswith("% |")


def test_no_mfu_on_a_cpu_without_a_peak(tmp_path):
    history = fit(tmp_path)["history"]
    assert all("mfu" not in r and r["tflops_per_s"] > 0 for r in history)


@pytest.mark.slow
def test_mmadapt_train_logs_the_plan_once_mmadapt_plan_has_measured_it(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mmadapt.cli import main

    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path / "cache"))
    records = [{"id": f"s{i}", "conversations": [{"from": "human", "value": "Say a word."},
                                                  {"from": "gpt", "value": "word"}]} for i in range(4)]
    run = write_run(tmp_path / "run.yaml", data={"train": write_jsonl(tmp_path / "train.jsonl", records),
                                                 "batch_size": 2, "max_length": 64},
                    train={"steps": 1, "progress": False, "report_to": ["tensorboard"]})
    assert main(["train", str(run), f"train.out={tmp_path / 'first'}"]) == 0
    assert not (tmp_path / "first" / "plan.json").exists()  # no probe cached: a run does not pay for one
    assert main(["plan", str(run), "--device", "cpu"]) == 0
    assert main(["train", str(run), f"train.out={tmp_path / 'second'}"]) == 0
    plan = json.loads((tmp_path / "second" / "plan.json").read_text())
    assert plan["per_gpu"]["total"] > 0 and plan["device"] == "cpu"
    text = EventAccumulator(str(tmp_path / "second" / "tensorboard")).Reload()
    assert "config" in " ".join(text.Tags()["tensors"])
