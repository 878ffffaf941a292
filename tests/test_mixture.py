"""Mixtures of training sources (`data.train` as a list; `mmadapt.data.mixture`).

The draw is checked exactly where it is exact (an epoch holds each source's share; a source's samples come once
before any comes twice; the draw is a function of seed and step, so a resumed run and any world size draw the same)
and statistically where it is random: the share of a source among the first n draws of an epoch is hypergeometric,
inside the binomial's 4 sigma (p = 3/4, n = 1,024: 4 sigma = 0.054; the hypergeometric's sigma is smaller). A
mixture's training run logs samples, problems and loss per source, the sources' token-weighted losses equal the
step's loss (1e-5 relative, fp32), and a run stopped and resumed equals the uninterrupted run bitwise (CPU, fp32).
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from helpers import TINY_LLAVA, noise_image, write_jsonl, write_run

from mmadapt.data import Mixture, Source, parse_sources
from mmadapt.train import RunConfig, latest_checkpoint
from mmadapt.train.batches import GlobalBatchSampler
from mmadapt.train.trainer import Trainer


class Item:
    def __init__(self, index: int) -> None:
        self.index, self.source = index, None


class Records(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Item:
        if not 0 <= index < self.size:
            raise IndexError(index)
        return Item(index)


def mixture(sizes, seed=0, **share):
    sources = [Source(f"{name}.jsonl", **({key: value[k]} if key else {}))
               for k, name in enumerate("abc"[: len(sizes)]) for key, value in [next(iter(share.items()), (None, 0))]]
    return Mixture(sources, [Records(n) for n in sizes], seed=seed)


def drawn(data, indices):
    return [(data[i].source, data[i].index) for i in indices]


# ---- the sources -------------------------------------------------------------------------------------------------
def test_data_train_takes_a_path_or_a_list_of_sources_and_a_bad_list_is_one_line(tmp_path):
    assert parse_sources("x/a.jsonl") == (Source("x/a.jsonl", name="a"),)
    assert parse_sources(["hub:o/n/sub@test"])[0].name == "o/n/sub@test"
    assert [s.to_dict() for s in parse_sources(["a.json", {"path": "d/b.parquet", "samples": 5}])] == [
        {"path": "a.json", "name": "a"}, {"path": "d/b.parquet", "samples": 5, "name": "b"}]
    bad = {"weight and samples": ([{"path": "a", "weight": 1, "samples": 2}], "gives both weight and samples"),
           "mixed": ([{"path": "a", "weight": 1}, "b"], r"weights are missing for \['b'\]"),
           "names": (["x/a.json", "y/a.json"], r"two sources are named \['a'\]"),
           "key": ([{"path": "a", "weigth": 1}], r"unknown keys \['weigth'\]"),
           "weight": ([{"path": "a", "weight": 0}], "weight must be a number > 0"),
           "samples": ([{"path": "a", "samples": 1.5}], "samples must be an integer >= 1"),
           "empty": ([], "must be a path or a list of sources")}
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            RunConfig.from_dict({"data": {"train": value}})
        with pytest.raises(ValueError) as raised:
            parse_sources(value)
        assert "\n" not in str(raised.value), name
    config = RunConfig.from_dict({"data": {"train": [{"path": "rel/a.json", "weight": 3}, {"path": "b", "weight": 1}]}})
    assert config.resolved().data.train[0] == {"path": str(tmp_path.cwd() / "rel/a.json"), "weight": 3}


def test_an_epoch_holds_each_sources_share_and_a_source_gives_every_sample_once_before_any_twice():
    data = mixture([40, 40], weight=[3, 1])
    assert (len(data), data.counts) == (80, [60, 20])
    two_epochs = Counter(drawn(data, range(160)))
    assert {n for (source, _), n in two_epochs.items() if source == "b"} == {1}  # b: 20 a epoch, all 40 in two
    assert sorted(i for source, i in two_epochs if source == "b") == list(range(40))
    assert {n for (source, _), n in two_epochs.items() if source == "a"} == {3}  # a: 60 an epoch, 120 = 3 passes
    first_pass = [i for source, i in drawn(data, range(40))]  # a's first 40 draws: each of its samples once
    assert sorted(first_pass) == list(range(40))
    counted = mixture([5, 7], samples=[12, 3])
    assert (len(counted), counted.counts) == (15, [12, 3])
    assert Counter(s for s, _ in drawn(counted, range(15))) == {"a": 12, "b": 3}
    assert mixture([5, 7]).counts == [5, 7]  # neither: each source's size (the sources one after the other)


def test_weights_3_to_1_draw_in_that_ratio_and_the_draw_is_a_function_of_seed_and_step():
    data = mixture([3000, 1000], weight=[3, 1], seed=5)
    sampler = GlobalBatchSampler(len(data), micro_batch=16, grad_accum=2, seed=5, epoch_indices=True)
    steps = [sampler.indices(s) for s in range(2 * sampler.steps_per_epoch)]
    first = [i for step in steps[:32] for micro in step for i in micro]  # 1,024 draws
    share = sum(data.locate(i)[0] == 0 for i in first) / len(first)
    assert abs(share - 0.75) < 4 * math.sqrt(0.75 * 0.25 / len(first))
    epoch = [i for step in steps[: sampler.steps_per_epoch] for micro in step for i in micro]
    assert Counter(data.locate(i)[0] for i in epoch) == {0: 3000, 1: 1000}  # an epoch: exactly its shares
    second = [i for step in steps[sampler.steps_per_epoch :] for micro in step for i in micro]
    assert min(second) >= len(data)  # epoch 1's indices: its own draw of the sources
    resumed = GlobalBatchSampler(len(data), micro_batch=16, grad_accum=2, seed=5, start_step=200, epoch_indices=True)
    assert next(iter(resumed)) == steps[200][0]
    ranks = [GlobalBatchSampler(len(data), micro_batch=8, grad_accum=2, seed=5, rank=r, world=2,
                                epoch_indices=True).indices(200) for r in range(2)]
    assert sorted(i for r in ranks for m in r for i in m) == sorted(i for m in steps[200] for i in m)
    again = mixture([3000, 1000], weight=[3, 1], seed=5)  # a fresh process (a worker, a resumed run): the same
    assert drawn(again, epoch[:64]) == drawn(data, epoch[:64])
    assert drawn(mixture([3000, 1000], weight=[3, 1], seed=6), epoch[:64]) != drawn(data, epoch[:64])


# ---- a training run ----------------------------------------------------------------------------------------------
def sources(tmp_path):
    turns = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise, a lot of it."}]
    for name, size, seed in (("big", 24, 0), ("small", 8, 100)):
        records = []
        for k in range(size):
            noise_image(tmp_path / f"{name}{k}.png", seed + k)
            text = turns if name == "big" else [turns[0], {"from": "gpt", "value": "A short one."}]
            records.append({"id": f"{name}{k}", "image": f"{name}{k}.png", "conversations": text})
        records[3]["image"] = "missing.png"  # a counted problem in each source
        write_jsonl(tmp_path / f"{name}.jsonl", records)
    return [{"path": str(tmp_path / "big.jsonl"), "weight": 3}, {"path": str(tmp_path / "small.jsonl"), "weight": 1}]


def train(tmp_path, out, *overrides):
    from mmadapt.train.run import run

    write_run(tmp_path / "run.yaml", model=TINY_LLAVA,
              data={"train": sources(tmp_path), "image_root": str(tmp_path), "batch_size": 4, "max_bad_fraction": 0.5},
              train={"steps": 8, "out": str(out), "progress": False, "lr": 1e-3},
              checkpoint={"every": 4})
    return run(RunConfig.load(tmp_path / "run.yaml", list(overrides)))


def logged(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_a_mixture_trains_logs_samples_problems_and_loss_per_source_and_resumes_bitwise(tmp_path, monkeypatch):
    full = train(tmp_path, tmp_path / "full")
    records = logged(tmp_path / "full")
    for record in records:
        per = record["sources"]
        assert set(per) == {"big", "small"} and sum(v["samples"] for v in per.values()) == 4
        tokens = sum(v["tokens"] for v in per.values())
        assert tokens == record["tokens"]
        mean = sum(v["loss"] * v["tokens"] for v in per.values() if v["tokens"]) / tokens
        assert mean == pytest.approx(record["loss"], rel=1e-5)
    seen = Counter()
    for record in records:
        seen.update({name: v["samples"] for name, v in record["sources"].items()})
    assert seen == {"big": 24, "small": 8}  # 8 steps of 4: the epoch's 32 slots, 24 of big and 8 of small
    problems = sum(v["problems"] for r in records for v in r["sources"].values())
    assert problems == full["bad_samples"] == 2  # big3 and small3, each drawn once in the epoch

    original = Trainer.save

    def save_then_stop(self, **kwargs):
        original(self, **kwargs)
        if self.step == 4:
            raise KeyboardInterrupt  # stopped right after its step-4 checkpoint

    monkeypatch.setattr(Trainer, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, tmp_path / "cut")
    monkeypatch.setattr(Trainer, "save", original)
    train(tmp_path, tmp_path / "cut", "checkpoint.resume=true")
    resumed = logged(tmp_path / "cut")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records]  # bitwise
    assert [r["sources"] for r in resumed] == [r["sources"] for r in records]
    state = json.loads((latest_checkpoint(tmp_path / "cut") / "trainer_state.json").read_text())
    assert state["sources"] == {name: {"samples": seen[name], "problems": sum(
        r["sources"][name]["problems"] for r in records)} for name in ("big", "small")}


def test_the_chunked_losss_token_losses_equal_the_full_logits():
    from mmadapt.loss import causal_lm_loss, logits_token_losses

    torch.manual_seed(0)
    hidden, head = torch.randn(2, 7, 16), torch.nn.Linear(16, 50)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, :3] = -100
    labels[1, 5:] = -100
    filled = torch.full((2, 7), 9.0)
    loss = causal_lm_loss(hidden, head, labels, rows=3, token_losses=filled)
    reference = logits_token_losses(head(hidden), labels)
    torch.testing.assert_close(filled, reference, rtol=1e-5, atol=1e-6)
    assert filled[1, 4:].abs().sum() == 0 and filled[0, :2].abs().sum() == 0  # nothing predicted there
    assert float(loss.detach()) == pytest.approx(float(filled.sum() / (labels[:, 1:] != -100).sum()), rel=1e-6)
    wrapped = torch.nn.Sequential(head)  # not a plain Linear (a LoRA-wrapped head): the checkpointed path
    again = torch.zeros(2, 7)
    causal_lm_loss(hidden, wrapped, labels, rows=3, token_losses=again)
    torch.testing.assert_close(again, reference, rtol=1e-5, atol=1e-6)


def test_packed_rows_split_their_token_losses_by_sample(tmp_path):
    train(tmp_path, tmp_path / "packed", "train.steps=2", "data.packing=true", "data.max_tokens=512")
    for record in logged(tmp_path / "packed"):
        per = record["sources"]
        tokens = sum(v["tokens"] for v in per.values())
        assert tokens == record["tokens"]
        mean = sum(v["loss"] * v["tokens"] for v in per.values() if v["tokens"]) / tokens
        assert mean == pytest.approx(record["loss"], rel=1e-5)
