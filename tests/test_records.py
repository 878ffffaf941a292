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
