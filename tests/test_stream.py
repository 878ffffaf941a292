"""Streaming WebDataset shards (`mmadapt.data.stream`): split across ranks and loader workers without overlap,
shuffled in blocks, resumed exactly.

What is exact is checked exactly: over an epoch every sample is read once across all ranks and workers (through the
real DataLoader with its worker processes); a loader started at step s yields what the uninterrupted loader yields
from step s; a run killed with SIGKILL under torchrun (2 processes, 2 workers each) and resumed logs the losses of
the uninterrupted run bitwise (CPU, fp32, gloo). Problems in a shard (a corrupt image, a record that does not parse,
a sample with neither record nor caption, a decompression bomb) are counted problems naming the shard and the key.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from itertools import islice

import pytest
import torch
from PIL import Image
from skimage import data as skdata

from mmadapt.data import DataProblem, EncodedSample, SampleEncoder, char_tokenizer, prepare_tokenizer
from mmadapt.data.collate import Collator
from mmadapt.data.stream import StreamingDataset, StreamLayout, shard_files, write_shards

PHOTOS = (skdata.astronaut, skdata.coffee, skdata.chelsea, skdata.rocket)


def png(k: int, side: int = 32) -> bytes:
    out = io.BytesIO()
    Image.fromarray(PHOTOS[k % 4]()).resize((side + 16 * (k % 2), side)).save(out, format="PNG")
    return out.getvalue()


def samples(n: int) -> list[dict[str, bytes]]:
    """Half captions (pretraining pairs), half LLaVA records: key, image, and .txt or .json."""
    out = []
    for k in range(n):
        sample = {"__key__": f"s{k:04d}", "png": png(k)}
        if k % 2:
            sample["txt"] = f"photo number {k}".encode()
        else:
            sample["json"] = json.dumps({"conversations": [{"from": "human", "value": f"<image>\nWhat is {k}?"},
                                                           {"from": "gpt", "value": f"Number {k}."}]}).encode()
        out.append(sample)
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_shards(root, samples(32), per_shard=4)  # 8 shards of 4
    return root


@pytest.fixture(scope="module")
def encoder():
    import mmadapt

    torch.manual_seed(0)
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama", preset="tiny")
    return model, SampleEncoder.for_model(model, prepare_tokenizer(model, char_tokenizer()))


def ids(items):
    return [x.id if isinstance(x, EncodedSample) else x.sample_id for x in items]


def loader_ids(data, rank, layout, start_step, steps):
    """The sample ids rank `rank` trains on at steps start_step .. start_step + steps - 1, through a DataLoader."""
    part = data.for_rank(rank, layout, start_step)
    loader = torch.utils.data.DataLoader(part, batch_size=layout.micro_batch, num_workers=layout.workers,
                                         collate_fn=list)
    batches = iter(loader)
    return [ids(next(batches)) for _ in range(steps * layout.grad_accum)]


def test_an_epoch_reads_every_sample_once_across_ranks_and_workers_and_a_resumed_loader_continues(shards, encoder):
    _, enc = encoder
    data = StreamingDataset(str(shards), enc, buffer=3, seed=1)
    assert len(data) == 32 and len(shard_files(str(shards / "*.tar"))) == 8
    layout = StreamLayout(world=2, workers=2, micro_batch=2, grad_accum=2)  # 4 streams of 2 shards
    epoch = 32 // (2 * 2 * 2)
    seen = [i for rank in range(2) for batch in loader_ids(data, rank, layout, 0, epoch) for i in batch]
    # each sample of the epoch once, across 2 ranks x 2 workers
    assert Counter(seen) == Counter({f"shard-{k // 4:05d}.tar:s{k:04d}": 1 for k in range(32)})
    for rank in range(2):
        whole = loader_ids(data, rank, layout, 0, epoch + 3)
        assert loader_ids(data, rank, layout, 3, epoch) == whole[3 * 2 :]  # from step 3: the same batches
    shuffled = [i for batch in loader_ids(data, 0, layout, 0, epoch) for i in batch]
    unshuffled = [i for batch in loader_ids(StreamingDataset(str(shards), enc, buffer=1, seed=1), 0, layout, 0, epoch)
                  for i in batch]
    assert sorted(shuffled) == sorted(unshuffled) and shuffled != unshuffled  # the buffer reorders, nothing else
    one = StreamLayout(world=1, workers=0, micro_batch=4, grad_accum=1)
    assert len(set(i for b in loader_ids(data, 0, one, 0, 8) for i in b)) == 32  # one process, no workers


def test_too_few_shards_for_the_readers_and_a_missing_stream_are_one_line(shards, encoder, tmp_path):
    _, enc = encoder
    with pytest.raises(ValueError, match=r"has 8 shards, fewer than its 12 readers \(2 ranks x 6 loader processes"):
        StreamingDataset(str(shards), enc).for_rank(0, StreamLayout(2, 6, 1, 1))
    with pytest.raises(FileNotFoundError, match=r"names no \.tar or \.parquet shard"):
        StreamingDataset(str(shards / "nothing-*.tar"), enc)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_shards(mixed, samples(2), per_shard=2)
    (mixed / "rows.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"mixes \['.parquet', '.tar'\] shards"):
        StreamingDataset(str(mixed), enc)
    import tarfile

    (tmp_path / "empty").mkdir()
    tarfile.open(tmp_path / "empty" / "nothing.tar", "w").close()
    with pytest.raises(ValueError, match="holds no samples in its 1 shards"):
        StreamingDataset(str(tmp_path / "empty"), enc).for_rank(0, StreamLayout(1, 0, 1, 1))
    from mmadapt.train import RunConfig

    with pytest.raises(ValueError, match=r"buffer .* must be an integer >= 1"):
        RunConfig.from_dict({"data": {"train": {"stream": str(shards), "buffer": 0}}})


def test_bad_samples_in_a_shard_are_counted_problems_naming_the_shard_and_the_key(tmp_path, encoder, monkeypatch):
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)  # importing lmms_eval (other tests) switches it on
    _, enc = encoder
    bomb = io.BytesIO()
    Image.new("1", (20000, 20000)).save(bomb, format="PNG")
    good = samples(2)
    bad = [{"__key__": "corrupt", "png": png(0)[:200], "txt": b"broken"},
           {"__key__": "bomb", "png": bomb.getvalue(), "txt": b"huge"},
           {"__key__": "unparsed", "png": png(1), "json": b"{not json"},
           {"__key__": "lonely", "png": png(2)},
           good[0], good[1]]
    write_shards(tmp_path, bad, per_shard=6)
    data = StreamingDataset(str(tmp_path), enc, buffer=1)
    items = list(enumerate(islice(data.for_rank(0, StreamLayout(1, 0, 1, 1)), 6)))
    found = {x.sample_id: x.reason for _, x in items if isinstance(x, DataProblem)}
    assert found == {"shard-00000.tar:corrupt": "unreadable_image", "shard-00000.tar:bomb": "image_too_large",
                     "shard-00000.tar:unparsed": "bad_format", "shard-00000.tar:lonely": "bad_format"}
    assert sum(isinstance(x, EncodedSample) for _, x in items) == 2
    batch = Collator.for_model(encoder[0], enc.pad_token_id)([x for _, x in items])
    assert len(batch["meta"]["problems"]) == 4 and batch["input_ids"].shape[0] == 2


def test_a_caption_sample_and_a_record_sample_give_the_tokens_of_their_llava_json(tmp_path, encoder):
    from mmadapt.data import VLMDataset

    _, enc = encoder
    pairs = samples(2)
    write_shards(tmp_path / "shards", pairs, per_shard=2)
    for k in range(2):
        (tmp_path / f"s{k}.png").write_bytes(pairs[k]["png"])
    as_json = [{"id": "shard-00000.tar:s0000", "image": "s0.png", "conversations": json.loads(pairs[0]["json"])[
        "conversations"]}, {"id": "shard-00000.tar:s0001", "image": "s1.png", "conversations": [
            {"from": "human", "value": "<image>\n"}, {"from": "gpt", "value": "photo number 1"}]}]
    (tmp_path / "same.json").write_text(json.dumps(as_json))
    reference = VLMDataset(tmp_path / "same.json", SampleEncoder.for_model(
        encoder[0], prepare_tokenizer(encoder[0], char_tokenizer()), image_root=str(tmp_path)))
    streamed = list(enumerate(islice(StreamingDataset(str(tmp_path / "shards"), enc, buffer=1).for_rank(
        0, StreamLayout(1, 0, 1, 1)), 2)))
    for (_, got), want in zip(streamed, (reference[0], reference[1]), strict=True):
        assert got.id == want.id
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)
        assert torch.equal(got.pixel_values, want.pixel_values)


KILLED = """
import os, signal, sys
from mmadapt.train.trainer import Trainer
real = Trainer.train_step
def dying(self, micro, clock=None):
    if self.step == {kill_at} and os.environ.get("RANK") == "0":  # rank 0, which writes the log: step {kill_at} is in
        os.kill(os.getpid(), signal.SIGKILL)  # it; mid-epoch, after the step-{every} checkpoint
    return real(self, micro, clock)
Trainer.train_step = dying
from mmadapt.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_streaming_run_killed_under_torchrun_resumes_bitwise(shards, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(json.dumps({
        "model": {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama", "preset": "tiny"},
        "data": {"train": {"stream": str(shards), "buffer": 3}, "batch_size": 2, "num_workers": 2,
                 "max_length": 256},
        "train": {"steps": 4, "lr": 1e-3, "progress": False}, "checkpoint": {"every": 2}}))
    (tmp_path / "killed.py").write_text(KILLED.format(kill_at=3, every=2))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

    def launch(script, out, *extra):
        entry = [str(tmp_path / "killed.py")] if script else ["-m", "mmadapt"]
        return subprocess.run([*torchrun, *entry, "train", str(run), f"train.out={tmp_path / out}", *extra],
                              capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})

    whole = launch(False, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = launch(True, "cut")
    assert killed.returncode != 0 and ("SIGKILL" in killed.stderr or str(-signal.SIGKILL) in killed.stderr), (
        killed.stderr[-3000:])
    assert [json.loads(line)["step"] for line in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()] == [1, 2, 3]
    resumed = launch(False, "cut", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def losses(out):
        return [json.loads(line)["loss"] for line in (tmp_path / out / "log.jsonl").read_text().splitlines()]

    assert len(losses("whole")) == 4 and losses("cut") == losses("whole")  # bitwise


def test_a_resume_that_reads_the_stream_otherwise_is_refused(shards, tmp_path):
    from mmadapt.train import RunConfig
    from mmadapt.train.run import run

    def config(*overrides):
        return RunConfig.from_dict({
            "model": {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama", "preset": "tiny"},
            "data": {"train": {"stream": str(shards), "buffer": 3}, "batch_size": 2, "max_length": 256,
                     **dict(overrides)},
            "train": {"steps": 2, "progress": False, "out": str(tmp_path / "out")}, "checkpoint": {"every": 2}})

    assert run(config())["steps"] == 2
    resumed = RunConfig.from_dict({**config(("batch_size", 4)).to_dict(), "checkpoint": {"resume": True}})
    with pytest.raises(ValueError, match=r"the same step would mean other samples\. Fix: resume with the same ranks"):
        run(resumed)


@pytest.fixture(scope="module")
def parquet_shards(tmp_path_factory):
    """The 32 samples as 8 Parquet shards of 4 rows (LLaVA-OneVision's columns, the images embedded), 2 row groups
    each."""
    import datasets
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("parquet_shards")
    rows = [{"id": f"s{k:04d}", "image": {"bytes": png(k), "path": None}, "conversations": [
        {"from": "human", "value": f"<image>\nWhat is {k}?"}, {"from": "gpt", "value": f"Number {k}."}]}
        for k in range(32)]
    for shard in range(8):
        table = datasets.Dataset.from_list(rows[4 * shard : 4 * shard + 4]).cast_column("image", datasets.Image())
        pq.write_table(table.data.table, root / f"part-{shard:05d}.parquet", row_group_size=2)
    return root


def test_parquet_shards_stream_like_tar_shards_and_read_as_the_dataset_reads(parquet_shards, encoder):
    from mmadapt.data import read_records
    from mmadapt.data.tables import TableRecords

    _, enc = encoder
    data = StreamingDataset(str(parquet_shards / "*.parquet"), enc, buffer=3, seed=1)
    assert len(data) == 32
    layout = StreamLayout(world=2, workers=2, micro_batch=2, grad_accum=2)
    seen = [i for rank in range(2) for batch in loader_ids(data, rank, layout, 0, 4) for i in batch]
    assert Counter(seen) == Counter({f"s{k:04d}": 1 for k in range(32)})
    for rank in range(2):
        assert loader_ids(data, rank, layout, 3, 2) == loader_ids(data, rank, layout, 0, 5)[3 * 2 :]
    streamed = read_records(str(parquet_shards / "*.parquet"))  # in file order, from any row (row groups skipped)
    dataset = TableRecords(parquet_shards)
    assert len(streamed) == len(dataset) == 32
    for k in (0, 3, 17, 31):
        ours, theirs = streamed[k], dataset[k]
        assert ours["conversations"] == theirs["conversations"] and ours["image"][0].data == theirs["image"][0].data
