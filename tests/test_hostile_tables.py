"""Crafted Parquet files (issue 54): cells that decode to gigabytes are refused from the footer before anything is
decoded, and a row that does not convert (a text cell that is not UTF-8) is one counted problem; both map-style and
streamed, through `mmadapt train` and `mmadapt data check`, the run going on with the good rows, memory growth bounded
and nothing but the good rows' bytes left in the records cache."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TINY_LLAVA, noise_image, write_run

from mmadapt.cli import main
from mmadapt.data import DataProblem, SampleEncoder, VLMDataset, char_tokenizer, prepare_tokenizer, read_records
from mmadapt.data.stream import ShardRecords
from mmadapt.train.checkpoint import latest_checkpoint

CELL = 16 * 1024 * 1024  # one zstd-compressed cell of zeros: a few hundred bytes stored
SCHEMA = pa.schema([("id", pa.string()), ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                    ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
                    ("blob", pa.binary())])
LLAVA = ["--encoder", "clip", "--projector", "mlp2x_gelu", "--backbone", "llama"]


def png(tmp_path, k: int) -> bytes:
    return noise_image(tmp_path / "noise.png", k, size=16).read_bytes()


def good_rows(tmp_path, n: int) -> pa.Table:
    turns = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Noise."}]
    return pa.Table.from_pylist([{"id": f"good{k}", "image": {"bytes": png(tmp_path, k), "path": None},
                                  "conversations": turns, "blob": b""} for k in range(n)], schema=SCHEMA)


def bomb_rows(n: int) -> pa.Table:
    """n rows whose `blob` cells are each CELL zero bytes: one array, referenced n times (allocated once)."""
    cell = pa.array([bytes(CELL)], pa.binary())
    return pa.table({"id": [f"bomb{k}" for k in range(n)], "image": pa.nulls(n, SCHEMA.field("image").type),
                     "conversations": pa.nulls(n, SCHEMA.field("conversations").type),
                     "blob": pa.chunked_array([cell] * n)}, schema=SCHEMA)


def write_crafted(path, tmp_path, good: int, bombs: int, bombs_first: bool = False):
    """`good` rows in a row group, then `bombs` rows of CELL bytes each in another (or first): zstd, no dictionary."""
    tables = [good_rows(tmp_path, good), bomb_rows(bombs)]
    with pq.ParquetWriter(path, SCHEMA, compression="zstd", use_dictionary=False) as writer:
        for table in reversed(tables) if bombs_first else tables:
            writer.write_table(table)
    return path


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    root = tmp_path_factory.mktemp("crafted")
    files = {"issue": write_crafted(root / "issue.parquet", root, 4, 32),  # the 512 MiB in 32 cells
             "big": write_crafted(root / "big.parquet", root, 4, 96),  # 1.5 GiB declared in one row group
             "train": write_crafted(root / "train.parquet", root, 30, 2),  # 32 MiB declared, 2 rows of 32
             # 1.5 GiB in 96 rows of 696, first: a stream meets them at once
             "gigabytes": write_crafted(root / "gigabytes.parquet", root, 600, 96, bombs_first=True)}
    bad = good_rows(root, 600)
    ids = pa.array([f"good{k}".encode() if k != 300 else b"\xff\xfe not UTF-8" for k in range(600)], pa.binary())
    bad = bad.set_column(0, "id", ids.view(pa.string()))  # a string cell Arrow does not check, as a crafted file
    pq.write_table(bad, root / "utf8.parquet", row_group_size=600)
    files["utf8"] = root / "utf8.parquet"
    ids = pa.array([f"good{k}".encode() if k % 4 else b"\xff bad" for k in range(120)], pa.binary())
    pq.write_table(bad.slice(0, 120).set_column(0, "id", ids.view(pa.string())), root / "utf8_train.parquet")
    files["utf8_train"] = root / "utf8_train.parquet"  # every fourth row: a training run meets them
    return root, files


@pytest.fixture(scope="module")
def encoder():
    import mmadapt

    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama", preset="tiny")
    return SampleEncoder.for_model(model, prepare_tokenizer(model, char_tokenizer()))


def test_the_footer_says_how_large_a_row_group_decodes_and_its_declared_size_is_what_the_test_claims(crafted):
    _, files = crafted
    meta = pq.ParquetFile(files["big"]).metadata
    assert meta.num_row_groups == 2 and meta.row_group(1).total_byte_size > 1.5 * 2**30
    assert files["big"].stat().st_size < 512 * 1024  # 1.5 GiB of cells in a file of a few hundred kB


@pytest.mark.parametrize(("name", "limit"), [("issue", "max_decode_ratio"), ("big", "max_row_group_bytes")])
def test_cells_that_decode_to_gigabytes_are_counted_problems_from_the_footer_map_style_and_streamed(
        crafted, encoder, name, limit, tmp_path, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path / "cache"))
    _, files = crafted
    bombs = 32 if name == "issue" else 96
    for records in (read_records(files[name]), ShardRecords(files[name])):  # converted; streamed from the file
        items = list(records)
        assert len(items) == 4 + bombs and all(isinstance(r, dict) for r in items[:4])
        problems = items[4:]
        assert all(isinstance(p, DataProblem) and p.reason == "table_too_large" for p in problems)
        assert f"{files[name]} row 4: " in str(problems[0]) and limit in str(problems[0])
        assert f"{files[name]} row {3 + bombs}: " in str(problems[-1])
    dataset = VLMDataset(files[name], encoder)
    assert [isinstance(dataset[k], DataProblem) for k in (0, 3, 4, 3 + bombs)] == [False, False, True, True]
    cached = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    assert cached < 1024 * 1024, cached  # the good rows and the problems, not the decoded cells


def test_a_limit_is_a_data_setting_and_flag_and_a_lower_one_refuses_more(crafted, encoder, capsys):
    _, files = crafted
    assert main(["data", "check", str(files["gigabytes"]), *LLAVA]) == 1  # 96 of 696: over 5%, each counted
    out = capsys.readouterr().out
    assert "samples: 696   usable: 600   problems: 96" in out and "table_too_large" in out
    assert main(["data", "check", str(files["train"]), *LLAVA]) == 1  # 2 of 32 rows: over 5%
    out = capsys.readouterr().out
    assert "samples: 32   usable: 30   problems: 2" in out and "max_decode_ratio = 100" in out
    assert main(["data", "check", str(files["train"]), *LLAVA, "--max-decode-ratio", "1e9",
                 "--max-row-group-bytes", str(16 * 2**20), "--max-bad-fraction", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "problems: 2" in out and "over max_row_group_bytes = 16777216" in out


_MEASURE = """
import resource, sys
import pyarrow.parquet, datasets, torch  # imported before the baseline: their code is not the data's memory
from mmadapt.data import read_records
from mmadapt.data.stream import ShardRecords

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for records in (read_records(sys.argv[1]), ShardRecords(sys.argv[1])):
    kinds = [type(r).__name__ for r in records]
assert kinds.count("DataProblem") == 96, kinds
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_reading_cells_declared_at_one_and_a_half_gib_grows_memory_by_tens_of_mib_at_most(crafted, tmp_path):
    """In a process of its own (the peak resident set is a process's): the conversion to the records cache and the
    streamed reader, over the 1.5 GiB row group. Decoding it would grow memory by gigabytes."""
    _, files = crafted
    env = {**__import__("os").environ, "MMADAPT_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_MEASURE), str(files["big"])], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    growth_mib = int(out.stdout.split()[-1])
    assert growth_mib < 48, f"peak memory grew by {growth_mib} MiB"


@pytest.mark.parametrize("streamed", [False, True], ids=["map-style", "streamed"])
def test_mmadapt_train_goes_on_with_the_good_rows_of_a_bomb_and_of_a_bad_utf8_cell(crafted, tmp_path, streamed):
    _, files = crafted
    for name in ("gigabytes", "utf8_train"):
        source = {"stream": str(files[name]), "buffer": 200} if streamed else str(files[name])
        out = tmp_path / name
        write_run(tmp_path / "run.yaml", model=TINY_LLAVA,
                  data={"train": source, "batch_size": 4, "max_bad_fraction": 0.5},
                  train={"steps": 3, "out": out, "progress": False})
        assert main(["train", str(tmp_path / "run.yaml")]) == 0
        state = json.loads((latest_checkpoint(out) / "trainer_state.json").read_text())
        assert state["samples_seen"] == 12 and 0 < state["bad_samples"] < 12, (name, state)  # met and counted
        assert set(state["bad_counts"]) == {"table_too_large" if name == "gigabytes" else "unreadable_row"}


def test_a_text_cell_that_is_not_utf8_is_one_counted_problem_naming_the_file_and_row(crafted, encoder, capsys):
    _, files = crafted
    path = files["utf8"]
    streamed = list(ShardRecords(path))  # the old reader's stream ended at the batch holding row 300
    problems = [r for r in streamed if isinstance(r, DataProblem)]
    assert len(streamed) == 600 and len(problems) == 1 and problems[0].reason == "unreadable_row"
    assert f"{path} row 300: cannot be read (UnicodeDecodeError" in str(problems[0])
    dataset = VLMDataset(path, encoder)
    assert isinstance(dataset[300], DataProblem) and dataset[300].reason == "unreadable_row"
    assert not isinstance(dataset[299], DataProblem) and not isinstance(dataset[301], DataProblem)
    for source in (str(path), str(path.parent / "[u]tf8.parquet")):  # map-style, and the file as a stream
        assert main(["data", "check", source, *LLAVA]) == 0
        out = capsys.readouterr().out
        assert "samples: 600   usable: 599   problems: 1" in out and "unreadable_row" in out


def test_a_refused_layout_leaves_nothing_in_the_records_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path / "cache"))
    pq.write_table(pa.table({"question": ["a"] * 10, "blob": [bytes(1 << 20)] * 10}), tmp_path / "odd.parquet")
    with pytest.raises(ValueError, match="no known column layout"):
        read_records(tmp_path / "odd.parquet")
    assert [f for f in (tmp_path / "cache").rglob("*.arrow")] == []


def test_arrow_files_are_checked_from_their_ipc_metadata_before_any_batch_is_read(tmp_path):
    from mmadapt.data.config import DataConfig

    table = pa.table({"conversations": [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]] * 4,
                      "blob": [bytes(1 << 20)] * 4})
    compressed = tmp_path / "zstd.arrow"
    with pa.OSFile(str(compressed), "wb") as sink, pa.ipc.new_stream(
            sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    with pytest.raises(ValueError, match=r"zstd\.arrow: record batch 0 is compressed") as error:
        read_records(compressed)
    assert "\n" not in str(error.value)
    plain = tmp_path / "plain.arrow"
    with pa.OSFile(str(plain), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(ValueError, match=r"record batch 0 holds \d+ bytes, over max_row_group_bytes = 1048576"):
        read_records(plain, config=DataConfig.of(max_row_group_bytes=1 << 20))
    assert len(read_records(plain)) == 4


def test_every_map_style_dataset_counts_the_unreadable_row_and_reads_the_others(crafted, encoder):
    from mmadapt.data import Mixture, parse_sources
    from mmadapt.data.preference import PreferenceDataset
    from mmadapt.data.prompts import PromptDataset, PromptEncoder

    _, files = crafted
    path = files["utf8"]
    sft, prompts = VLMDataset(path, encoder), PromptDataset(path, PromptEncoder(encoder, completion_tokens=8))
    pairs = PreferenceDataset(path, encoder)  # conversations, not pairs: each row a bad_format, row 300 unreadable
    for dataset in (sft, prompts, pairs):
        assert dataset[300].reason == "unreadable_row" and f"{path} row 300" in str(dataset[300])
    assert not isinstance(sft[301], DataProblem)
    # the neighbours are read and parsed: SFT rows, not prompts or pairs, so their problems are their format's
    assert "the prompt must end with a user turn" in str(prompts[299]) and pairs[299].reason == "bad_format"

    class Unreadable(list):  # a source whose item 1 raises as a bad row would, under any dataset
        def __getitem__(self, index):
            if index == 1:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return super().__getitem__(index)

    from types import SimpleNamespace

    mixture = Mixture(parse_sources([{"path": "a", "weight": 1}]), [Unreadable(SimpleNamespace() for _ in range(3))])
    items = [mixture[k] for k in range(3)]
    bad = [i for i in items if isinstance(i, DataProblem)]
    assert len(bad) == 1 and bad[0].reason == "unexpected_error" and "UnicodeDecodeError" in str(bad[0])


def test_a_row_group_that_cannot_be_read_on_ends_as_counted_problems_naming_the_shard(tmp_path, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path / "cache"))
    turns = [[{"from": "human", "value": f"q{k} " * 50}, {"from": "gpt", "value": "a"}] for k in range(40)]
    path = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"id": [f"r{k}" for k in range(40)], "conversations": turns}), path, row_group_size=20,
                   compression="zstd")
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(1)
    data = bytearray(path.read_bytes())
    data[chunk.data_page_offset + 40 : chunk.data_page_offset + 70] = bytes(30)  # inside row group 1's zstd frame
    path.write_bytes(bytes(data))
    for records in (ShardRecords(path), read_records(path)):  # streamed; converted
        items = list(records)
        assert len(items) == 40 and [r["id"] for r in items[:20]] == [f"r{k}" for k in range(20)]
        assert all(isinstance(p, DataProblem) and p.reason == "unreadable_row" for p in items[20:])
        assert f"{path} row 20: " in str(items[20]) and "cannot be read on" in str(items[20])


@pytest.mark.slow
def test_a_dictionary_page_every_row_repeats_is_counted_as_decoded_not_as_the_footer_says(tmp_path, monkeypatch):
    """pyarrow's writer gives the column 52 bytes in the footer; it decodes to 600 MiB: the decoded batches are
    counted against max_row_group_bytes, and the group's rows are problems, not rows in the cache."""
    import os

    from mmadapt.data.config import DataConfig

    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path / "cache"))
    value = pa.array([os.urandom(1 << 20)], pa.binary())
    blob = pa.DictionaryArray.from_arrays(pa.array([0] * 600, pa.int32()), value)
    turns = pa.array([[{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Yes."}]] * 600)
    path = tmp_path / "dictionary.parquet"
    pq.write_table(pa.table({"conversations": turns, "blob": blob}), path, store_schema=False,
                   dictionary_pagesize_limit=8 << 20, compression="zstd")
    assert pq.ParquetFile(path).metadata.row_group(0).total_byte_size < 2 << 20
    config = DataConfig.of(max_row_group_bytes=64 << 20)
    for records in (ShardRecords(path, config=config), read_records(path, config=config)):
        items = list(records)
        assert len(items) == 600 and all(isinstance(p, DataProblem) for p in items)
        assert items[0].reason == "table_too_large" and "more than its footer says" in str(items[0])
    cached = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    assert cached < 1 << 20, cached
