"""`mmadapt data check` / `data show` at scale: parallel processes (the same report as one process), `--limit` /
`--sample`, every source (JSON, Parquet, WebDataset shards), and a run file's mixture reported per source."""

from __future__ import annotations

import io
import json

import pytest
from helpers import noise_image, write_jsonl, write_run
from PIL import Image

from mmadapt.cli import main
from mmadapt.data import SampleEncoder, char_tokenizer, check_dataset, prepare_tokenizer, read_records
from mmadapt.data.stream import write_shards

LLAVA = ["--encoder", "clip", "--projector", "mlp2x_gelu", "--backbone", "llama"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    for k in range(4):
        noise_image(root / f"{k}.png", k)
    turns = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Noise."}]
    records = [{"id": f"r{k}", "image": f"{k % 4}.png", "conversations": turns} for k in range(600)]
    for k in range(0, 600, 50):
        records[k] = {**records[k], "image": "missing.png"}  # 12 problems, spread over the chunks
    write_jsonl(root / "big.jsonl", records)
    write_jsonl(root / "small.jsonl", records[:40])
    shard = []
    for k in range(6):
        out = io.BytesIO()
        Image.open(root / f"{k % 4}.png").save(out, format="PNG")
        shard.append({"__key__": f"c{k}", "png": out.getvalue(), "txt": f"caption {k}".encode()})
    write_shards(root / "shards", shard, per_shard=3)
    return root


def test_parallel_processes_give_the_report_of_one_process(files):
    import mmadapt

    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama", preset="tiny")
    encoder = SampleEncoder.for_model(model, prepare_tokenizer(model, char_tokenizer()), image_root=str(files))
    records = read_records(files / "big.jsonl", errors="report")
    one, two = (check_dataset(records, encoder, workers=w).to_dict() for w in (1, 2))
    assert one == two and one["total"] == 600 and one["problems_by_reason"] == {"missing_image": 12}
    assert [p["id"] for p in two["problems"]] == [f"r{k}" for k in range(0, 600, 50)]  # in file order
    part = check_dataset(records, encoder, indices=[0, 1, 50, 99])
    assert (part.total, len(part.problems)) == (4, 2)


def test_limit_and_sample_look_at_part_of_the_data(files, capsys):
    base = ["data", "check", str(files / "big.jsonl"), *LLAVA, "--image-root", str(files), "--workers", "1"]
    assert main([*base, "--limit", "10"]) == 1  # r0 is missing: 10% > 5%
    assert "samples: 10   usable: 9   problems: 1" in capsys.readouterr().out
    assert main([*base, "--sample", "100", "--seed", "3", "--json", str(files / "a.json")]) == 0
    first = json.loads((files / "a.json").read_text())
    assert main([*base, "--sample", "100", "--seed", "3", "--json", str(files / "b.json")]) == 0
    assert first == json.loads((files / "b.json").read_text()) and first["total"] == 100  # seeded: the same draw
    assert main([*base, "--sample", "5", "--limit", "5"]) == 2  # a user error: one line
    assert "give --limit (the first N records) or --sample" in capsys.readouterr().err


def test_a_run_files_mixture_is_checked_per_source_and_shards_are_checked_and_shown(files, capsys):
    run = write_run(files / "run.yaml", model={"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama",
                                               "preset": "tiny"},
                    data={"train": [{"path": str(files / "small.jsonl"), "weight": 1},
                                    {"path": str(files / "shards"), "weight": 1, "name": "captions"}],
                          "image_root": str(files)})
    assert main(["data", "check", str(run), "--json", str(files / "mix.json")]) == 0
    out = capsys.readouterr().out
    assert "== source small\nsamples: 40   usable: 39   problems: 1" in out
    assert "== source captions\nsamples: 6   usable: 6   problems: 0" in out
    assert "== all 2 sources\nsamples: 46   usable: 45   problems: 1" in out
    saved = json.loads((files / "mix.json").read_text())
    assert saved["total"] == 46 and set(saved["sources"]) == {"small", "captions"}
    assert main(["data", "show", str(files / "shards" / "*.tar"), *LLAVA, "--n", "2", "--colour", "never"]) == 0
    shown = capsys.readouterr().out
    assert "caption 0" in shown and "caption 1" in shown and "caption 2" not in shown


def test_the_host_memory_of_data_loading_counts_what_grows_with_the_dataset(files):
    import os

    from mmadapt.data import Mixture, parse_sources
    from mmadapt.data.memory import data_memory

    one = data_memory(str(files / "big.jsonl"), num_workers=2)
    assert dict((n, b) for n, b, _ in one.rows) == {"sampler": 8 * 600}  # the epoch's order, nothing per record else
    assert one.mapped == read_records(files / "big.jsonl").table.arrow.stat().st_size > 0  # the mapped cache file
    mixture = [{"path": str(files / "big.jsonl"), "weight": 3}, {"path": str(files / "small.jsonl"), "weight": 1}]
    mixed = data_memory(mixture, num_workers=2)
    slots = len(Mixture(parse_sources(mixture), [range(600), range(40)]))
    assert dict((n, b) for n, b, _ in mixed.rows) == {"sampler": 8 * slots, "mixture orders": 4 * 640 * 2}
    stream = data_memory({"stream": str(files / "shards"), "buffer": 10}, num_workers=0)
    per_sample = sum(os.path.getsize(p) for p in (files / "shards").glob("*.tar")) // 6
    assert stream.to_json() == {"private": 10 * per_sample, "mapped": 0, "stream buffers": 10 * per_sample}
