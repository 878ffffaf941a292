"""A JSON / JSONL file as memory-mapped records (mmadapt.data.records): read back exactly, converted once, shared by
path and by content, and opened without holding its records as Python objects."""

from __future__ import annotations

import json
import pickle
import tracemalloc

import pytest

import mmadapt.data.records as records_module
from mmadapt.data import DataProblem, read_records


def llava_records(n: int) -> list[dict]:
    return [{"id": f"s{i}", "image": f"img/{i}.png", "conversations": [
        {"from": "human", "value": "<image>\nQu'est-ce que c'est ? \u00e9\u4e2d\U0001f600" if i % 3 else "Hi"},
        {"from": "gpt", "value": "x" * (i % 40) + f" {i / 7}"}]} for i in range(n)]


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 24], ids=["tiny chunks", "1 kB chunks", "one chunk"])
@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_records_read_back_equal_to_the_files_own_parse_at_any_chunk_boundary(tmp_path, monkeypatch, chunk, suffix):
    monkeypatch.setattr(records_module, "READ_BYTES", chunk)
    monkeypatch.setattr(records_module, "BATCH_ROWS", 64)  # several record batches
    data = [*llava_records(300), {"id": "n", "messages": [], "deep": [[[1, 2.5e-300, None, True, -0.0]]]}]
    path = tmp_path / f"d{suffix}"
    if suffix == ".json":
        path.write_text("\ufeff \n" + json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    else:
        path.write_text("\n".join(json.dumps(r, ensure_ascii=chunk == 7) for r in data) + "\n\n", encoding="utf-8")
    records = read_records(path)
    assert len(records) == len(data) and list(records) == data
    assert records[-1] == data[-1] and records[5:8] == data[5:8]
    with pytest.raises(IndexError):
        records[len(data)]


def test_a_file_is_converted_once_found_again_by_its_stat_and_again_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in llava_records(10)))
    first = read_records(path)

    def no_reading(*args):
        raise AssertionError("the file was read again")

    with monkeypatch.context() as m:
        m.setattr(records_module, "_file_sha256", no_reading)
        m.setattr(records_module, "_convert", no_reading)
        again = read_records(path)
    assert again.arrow == first.arrow and list(again) == list(first)
    path.write_text("\n".join(json.dumps(r) for r in llava_records(11)))
    changed = read_records(path)
    assert changed.arrow != first.arrow and len(changed) == 11


def test_the_same_bytes_elsewhere_share_the_cache_and_problems_name_their_own_file(tmp_path, monkeypatch):
    lines = json.dumps(llava_records(1)[0]) + "\n{broken\n"
    a, b = tmp_path / "a.jsonl", tmp_path / "b" / "a.jsonl"
    b.parent.mkdir()
    a.write_text(lines)
    b.write_text(lines)
    converted, convert = [], records_module._convert
    monkeypatch.setattr(records_module, "_convert", lambda *args: converted.append(args) or convert(*args))
    ra, rb = read_records(a, errors="report"), read_records(b, errors="report")
    assert ra.arrow == rb.arrow and len(converted) == 1
    assert isinstance(rb[1], DataProblem) and str(rb[1]).startswith("sample 'line 2': bad_format: " + str(b) + ":2:")
    with pytest.raises(ValueError, match=f"^{b}:2: not valid JSON"):
        read_records(b)


def test_records_pickle_as_their_cache_path_for_loader_workers(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(llava_records(2000)))
    records = read_records(path)
    payload = pickle.dumps(records)
    assert len(payload) < 500 and pickle.loads(payload)[1999] == records[1999]


def test_opening_converted_records_allocates_nothing_that_grows_with_the_file(tmp_path):
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text("\n".join(json.dumps(r) for r in llava_records(100)))
    large.write_text("\n".join(json.dumps(r) for r in llava_records(50_000)))  # about 9 MB of JSON
    read_records(small), read_records(large)  # converted
    peaks = []
    for path in (small, large):
        tracemalloc.start()
        records = read_records(path)
        assert records[len(records) - 1]["id"]
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    # Python objects allocated to open the file and read its last record: a few kB either way, against 9 MB of text
    assert peaks[1] < peaks[0] + 64 * 1024 and peaks[1] < 256 * 1024, peaks


def test_a_change_that_keeps_the_size_and_mtime_is_noticed(tmp_path):
    """`cp -p` and `tar x` give a changed file its old modification time: the cache must not give the old records
    (records) or the old sample count (a tar shard's)."""
    import os
    import time

    from mmadapt.data.stream import _cached_count, write_shards

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"a{i}"}) for i in range(10)))
    stat = path.stat()
    assert [r["id"] for r in read_records(path)][:2] == ["a0", "a1"]
    time.sleep(0.05)  # past the clock tick of the first write (the kernel's timestamps are coarse)
    path.write_text("\n".join(json.dumps({"id": f"b{i}"}) for i in range(10)))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert [r["id"] for r in read_records(path)][:2] == ["b0", "b1"]

    one, two = ({"__key__": k, "txt": b"caption"} for k in ("a", "b"))
    shard = write_shards(tmp_path / "one", [one, two], per_shard=2)[0]  # two samples
    stat = shard.stat()
    assert _cached_count(shard) == 2
    time.sleep(0.05)
    other = write_shards(tmp_path / "two", [one, {**two, "__key__": "a"}], per_shard=2)[0]  # one sample, same size
    assert other.stat().st_size == stat.st_size
    shard.write_bytes(other.read_bytes())
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _cached_count(shard) == 1


@pytest.mark.slow
def test_a_truncated_large_json_is_named_without_parsing_it_again(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "BATCH_ROWS", 64)
    text = json.dumps(llava_records(60_000), indent=1)  # about 15 MB
    whole, cut = tmp_path / "whole.json", tmp_path / "cut.json"
    whole.write_text(json.dumps(llava_records(30_000), indent=1))
    cut.write_text(text[: len(text) // 2])  # as large, cut in the middle of an item
    (tmp_path / "small.json").write_text(json.dumps(llava_records(3)))
    read_records(tmp_path / "small.json")  # the modules a conversion imports, imported before measuring
    peaks = []
    for path in (whole, cut):
        tracemalloc.start()
        try:
            read_records(path)
        except ValueError as e:
            error = str(e)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    line = text[: len(text) // 2].count("\n") + 1
    assert error.startswith(f"{cut}:{line}:") and "not valid JSON (Unterminated string" in error and "\n" not in error
    # naming the error costs nothing beyond converting a whole file (a chunk, the checksum's reads); parsing the file
    # again held 7.7x the file
    assert peaks[1] < peaks[0] + (1 << 20), peaks


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_record_nested_100000_deep_is_a_counted_problem_or_one_line(tmp_path, suffix):
    deep = "[" * 100_000 + "]" * 100_000
    good = json.dumps(llava_records(1)[0])
    path = tmp_path / f"deep{suffix}"
    if suffix == ".jsonl":
        path.write_text(f"{good}\n{{\"id\": \"deep\", \"x\": {deep}}}\n{good}\n")
        records = read_records(path, errors="report")
        assert len(records) == 3 and isinstance(records[1], DataProblem)
        assert "nested too deeply" in str(records[1]) and f"{path}:2:" in str(records[1])
    else:
        path.write_text(f"[{good},\n{deep}]")
        with pytest.raises(ValueError, match=f"^{path}:2:1: nested too deeply") as error:
            read_records(path)
        assert "\n" not in str(error.value)
