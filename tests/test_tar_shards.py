"""Hostile WebDataset tar shards (`mmadapt.data.stream`): each is a counted problem naming the shard, the key and the
limit, costs header reads (peak Python memory bounded, measured with tracemalloc), and the run goes on with the good
samples, through `mmadapt train` and `mmadapt data check` alike. A plain `.tar` path streams: reading on costs each
sample its own headers, never the headers before it again.

The shards are written block by block (`member`, `sparse_member`), so a few KB can declare what a real tar never
holds: GNU sparse members of 250 MB (tarfile expands their holes to zeros on read), a sample of a thousand members,
a `.json` nested 100,000 deep, a file cut in the middle of a member.
"""

from __future__ import annotations

import io
import json
import tarfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from helpers import TINY_LLAVA, write_run
from PIL import Image

from mmadapt.cli import main
from mmadapt.data import DataProblem
from mmadapt.data.stream import Shard, ShardRecords, StreamingDataset

BLOCK = tarfile.BLOCKSIZE
MiB = 1 << 20
BOUND = 16 * MiB  # peak Python memory of a check or a run on these shards, imports done (measured: a few MiB)


def png(k: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32 + 8 * k, 32), (40 * k % 256, 90, 160)).save(out, format="PNG")
    return out.getvalue()


def member(name: str, data: bytes) -> bytes:
    """One regular tar member: its header block and its data, padded to whole blocks."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info.tobuf(format=tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % BLOCK)


def sparse_member(name: str, declared: int) -> bytes:
    """A GNU sparse member ('S'): one block of data stored, `declared` bytes once its hole is filled with zeros."""
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.GNUTYPE_SPARSE, BLOCK
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[386:398] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)  # the map: BLOCK bytes of data at offset 0 ...
    header[398:410] = tarfile.itn(BLOCK, 12, tarfile.GNU_FORMAT)
    header[483:495] = tarfile.itn(declared, 12, tarfile.GNU_FORMAT)  # ... in a file of `declared` bytes
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + b"\1" * BLOCK


def good(key: str, k: int) -> bytes:
    return member(f"{key}.png", png(k)) + member(f"{key}.txt", f"caption {k}".encode())


def shard(path: Path, *parts: bytes, end: bool = True) -> Path:
    path.write_bytes(b"".join(parts) + (b"\0" * 2 * BLOCK if end else b""))
    return path


NESTED = b"[" * 100_000 + b"]" * 100_000


def crafted(root: Path) -> dict[str, tuple[Path, dict[str, str], dict[str, object]]]:
    """name -> (shard, {key: reason} of its problems, the data settings it is read with)."""
    root.mkdir(parents=True, exist_ok=True)
    goods = [good(f"g{k}", k) for k in range(3)]
    cut = [good(f"t{k}", k) for k in range(4)]
    inside_t2 = len(cut[0]) + len(cut[1]) + BLOCK + 50  # t2.png declares more data than the file holds
    return {
        "sparse": (shard(root / "sparse.tar", goods[0], member("one.txt", b"x"), sparse_member("one.png", 200_000_000),
                         goods[1], *(sparse_member(f"four.{k}.png", 250_000_000) for k in range(4)),
                         member("four.txt", b"y"), goods[2]),
                   {"one": "bad_format", "four": "sample_too_large"}, {}),
        "many": (shard(root / "many.tar", goods[0], *(member(f"many.{k}.txt", b"") for k in range(1000)), goods[1],
                       *(member(f"pics.{k}.png", b"") for k in range(70)), member("pics.txt", b"z"), goods[2]),
                 {"many": "sample_too_large", "pics": "sample_too_large"}, {}),
        "budget": (shard(root / "budget.tar", goods[0], member("big.png", b"\0" * 60_000),
                         member("big.1.png", b"\0" * 60_000), member("big.txt", b"b"), goods[1], goods[2]),
                   {"big": "sample_too_large"}, {"max_sample_bytes": 100_000}),
        "nested": (shard(root / "nested.tar", goods[0], member("deep.png", png(3)), member("deep.json", NESTED),
                         goods[1], goods[2]),
                   {"deep": "bad_format"}, {}),
        "truncated": (shard(root / "truncated.tar", b"".join(cut)[:inside_t2], end=False),
                      {"#2": "unreadable_shard"}, {}),
        "corrupt": (shard(root / "corrupt.tar", *cut[:2], member("t2.png", png(2)), b"\1" * BLOCK, *cut[3:]),
                    {"#2": "unreadable_shard"}, {}),
        "cut_header": (shard(root / "cut_header.tar", (b"".join(cut[:3]) + cut[3][:100]), end=False),
                       {"#2": "unreadable_shard"}, {}),  # t2 too: whether it had more members is lost
    }


DETAILS = {"sparse": ("sparse file declaring 200000000 bytes", "over max_sample_bytes 268435456"),
           "many": ("1000 members, over max_sample_members 128", "70 images, over max_images 64"),
           "budget": ("declare 120001 bytes, over max_sample_bytes 100000",),
           "nested": ("RecursionError",),
           "truncated": ("cannot be read after sample 't1' (2 read)", "unexpected end of data"),
           "corrupt": ("cannot be read after sample 't1' (2 read)", "a cut or corrupt tar header at byte"),
           "cut_header": ("cannot be read after sample 't1' (2 read)", "a cut or corrupt tar header at byte")}


def run_file(tmp_path: Path, train: str, **data: object) -> Path:
    return write_run(tmp_path / "run.yaml", model=TINY_LLAVA,
                     data={"train": train, "batch_size": 2, "max_length": 256, "max_bad_fraction": 0.6, **data},
                     train={"steps": 3, "lr": 1e-3, "progress": False})


def peak_of(call):
    """(what `call()` returns, the peak of the Python memory it allocated on top of what was held before)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = call()
        return out, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A check and a run on a good shard first: what they import is not what a hostile shard costs."""
    tmp = tmp_path_factory.mktemp("warm")
    run = run_file(tmp, str(shard(tmp / "good.tar", *(good(f"g{k}", k) for k in range(3)))))
    assert main(["data", "check", str(run), "--workers", "1"]) == 0
    assert main(["train", str(run), f"train.out={tmp / 'out'}"]) == 0


@pytest.mark.parametrize("name", ["sparse", *(pytest.param(name, marks=pytest.mark.slow) for name in (  # fast tier: one
    "many", "budget", "nested", "truncated", "corrupt", "cut_header"))])
def test_a_hostile_shard_is_counted_problems_and_the_run_trains_on_its_good_samples(name, tmp_path, capsys, warm):
    path, expected, settings = crafted(tmp_path / "shards")[name]
    assert path.stat().st_size < MiB  # a small file ...
    run = run_file(tmp_path, str(path), **settings)
    code, peak = peak_of(lambda: main(["data", "check", str(run), "--workers", "1", "--json",
                                       str(tmp_path / "report.json"), "--max-bad-fraction", "0.6"]))
    out = capsys.readouterr().out
    assert code == 0, out
    assert peak < BOUND, f"data check held {peak / MiB:.0f} MiB"  # ... costs its headers, not what they declare
    report = json.loads((tmp_path / "report.json").read_text())
    found = {p["id"].split(":", 1)[1]: p["reason"] for p in report["problems"]}
    assert found == expected and report["ok"] >= 2
    assert all(p["path"] == str(path) and p["id"].startswith(f"{path.name}:") for p in report["problems"])
    details = " ".join(p["detail"] for p in report["problems"])
    assert all(d in details for d in DETAILS[name]), details
    code, peak = peak_of(lambda: main(["train", str(run), f"train.out={tmp_path / 'out'}"]))
    assert code == 0, capsys.readouterr()
    assert peak < BOUND, f"training held {peak / MiB:.0f} MiB"
    steps = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and sum(s["problems"] for s in steps) >= 1  # the run went on past them, counting


def test_a_shard_truncated_at_its_start_is_one_problem_and_the_stream_reads_the_others(tmp_path, capsys):
    root = tmp_path / "shards"
    root.mkdir()
    shard(root / "a-good.tar", *(good(f"g{k}", k) for k in range(6)))
    (root / "b-cut.tar").write_bytes(good("c0", 0)[:300])  # inside the first header
    (root / "c-empty.tar").write_bytes(b"")
    records = ShardRecords(root)
    assert len(records) == 8  # the counts do not raise: 6 samples, and one problem for each broken shard
    problems = [r for r in records if isinstance(r, DataProblem)]
    assert [(p.sample_id, p.reason) for p in problems] == [("b-cut.tar:#0", "unreadable_shard"),
                                                           ("c-empty.tar:#0", "unreadable_shard")]
    assert "cannot be read at its start" in problems[0].detail and str(root / "b-cut.tar") in str(problems[0])
    run = run_file(tmp_path, str(root / "*.tar"), batch_size=4)  # each batch holds good samples
    assert main(["data", "check", str(run), "--workers", "1", "--max-bad-fraction", "0.6"]) == 0
    assert "unreadable_shard" in capsys.readouterr().out
    assert main(["train", str(run), f"train.out={tmp_path / 'out'}"]) == 0
    steps = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and sum(s["problems"] for s in steps) >= 1


def test_a_refused_sample_reads_none_of_its_members(tmp_path, monkeypatch):
    path, _, _ = crafted(tmp_path)["sparse"]
    opened = []
    real = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: opened.append(m.name) or real(self, m))
    records = list(Shard(path).records())
    assert [r["id"] if isinstance(r, dict) else r.reason for r in records] == [
        "sparse.tar:g0", "bad_format", "sparse.tar:g1", "sample_too_large", "sparse.tar:g2"]
    assert not any(name.startswith(("one.", "four.")) for name in opened)  # their .txt neither
    many, _, _ = crafted(tmp_path)["many"]
    kept = [len(item.members) for item in Shard(many).groups()]
    assert kept == [2, 129, 2, 71, 2]  # the members of a sample over max_sample_members: counted, not kept


def spy_headers(monkeypatch) -> list[int]:
    """A counter of the tar headers read (every `TarFile.next`)."""
    reads = [0]
    real = tarfile.TarFile.next

    def counting(self):
        reads[0] += 1
        return real(self)

    monkeypatch.setattr(tarfile.TarFile, "next", counting)
    return reads


def test_a_tar_path_trains_as_a_stream_and_reads_each_header_once(tmp_path, monkeypatch):
    import mmadapt
    from mmadapt.data import SampleEncoder, char_tokenizer, prepare_tokenizer, training_set
    from mmadapt.data.memory import data_memory
    from mmadapt.data.pipeline import VLMDataset
    from mmadapt.data.stream import StreamLayout

    n = 60
    path = shard(tmp_path / "one.tar", *(good(f"s{k:03d}", k % 5) for k in range(n)))
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama", preset="tiny")
    encoder = SampleEncoder.for_model(model, prepare_tokenizer(model, char_tokenizer()))
    train = training_set(str(path), lambda p: VLMDataset(p, encoder), 0, encoder)
    assert isinstance(train, StreamingDataset) and len(train) == n
    assert isinstance(training_set(str(path), lambda p: VLMDataset(p, encoder), 0, encoder, stream_shards=False),
                      VLMDataset)  # an evaluation set reads it in file order
    assert any("stream buffers" in row for row in data_memory(str(path), num_workers=0).rows)  # `plan` knows
    reads = spy_headers(monkeypatch)
    stream = iter(train.for_rank(0, StreamLayout(1, 0, 1, 1)))
    items = [next(stream) for _ in range(n)]
    assert len({x.id for x in items}) == n
    assert reads[0] <= 2 * n + 2  # one pass over the headers (2 members a sample); indexed: ~n^2 = 3600
    reads[0] = 0
    records = ShardRecords(path)  # a mixture source, an evaluation set, `data check --sample`: read by index
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    assert [records[k]["id"] for k in order] == [f"one.tar:s{k:03d}" for k in order]
    assert reads[0] <= 8 * n  # one pass for the offsets, then a few headers a sample; from the start: ~n^2 / 2


@pytest.mark.parametrize("layout", ["pax", "gnu", "global", "broken"])
def test_a_sample_read_by_index_is_the_sample_read_in_order(layout, tmp_path):
    """Long names (pax or GNU extended headers before a member's own), a global pax header (which a read starting
    past it would miss: such a shard is read in order) and a shard broken mid-way read the same by index."""
    tar_format = tarfile.GNU_FORMAT if layout == "gnu" else tarfile.PAX_FORMAT
    path = tmp_path / "long.tar"
    with tarfile.open(path, "w", format=tar_format,
                      pax_headers={"comment": "a global header"} if layout == "global" else None) as tar:
        for k in range(6):
            for extension, data in (("png", png(k)), ("txt", f"caption {k}".encode())):
                info = tarfile.TarInfo(f"{'d' * 120}/{'key' * 40}{k}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if layout == "broken":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    records = ShardRecords(path)
    in_order = list(records)
    assert len(in_order) == len(records) == (4 if layout == "broken" else 6)
    by_index = [records[k] for k in reversed(range(len(records)))][::-1]
    for ours, theirs in zip(by_index, in_order, strict=True):
        if isinstance(theirs, DataProblem):
            assert isinstance(ours, DataProblem) and str(ours) == str(theirs)
        else:
            assert ours["id"] == theirs["id"] and ours["image"][0].data == theirs["image"][0].data
    offsets = records.shards[0].offsets()
    assert len(offsets) == {"global": 0, "broken": 3}.get(layout, 6)
