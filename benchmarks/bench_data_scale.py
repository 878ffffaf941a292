"""Data at scale: time to the first batch and the memory of the loading processes as the dataset grows.

    python benchmarks/bench_data_scale.py [--sizes 200000,1000000,3200000] [--workdir DIR] [--quick]

For each size, generated datasets of LLaVA records (two turns, one image each, ids and answers that differ per
record): a LLaVA `.json` list with image files, and a Parquet file with each record's image embedded as bytes (the
hub's layout, `image` + `conversations`). Each row of the table is one fresh process doing what `mmadapt train` does
before its first step: read the records, build `VLMDataset`, start a `DataLoader` with 2 workers over
`GlobalBatchSampler`, take the first batch of 8, then 20 more. Measured: seconds to the first batch (cache warm:
the file converted before) and the memory of the main process and of its workers after the 21 batches as PSS
(proportional set size: a page shared by n processes counts 1/n in each, so the sum is what they hold together),
and of that the anonymous part (memory the OS cannot drop and read again, unlike a mapped file's pages), and USS
(their private pages), which alone would mislead: after the fork, the pages the main process and its workers share
copy-on-write count in nobody's USS, so a list of records held by all three looks free until a worker's reference
counting copies it. `list` is
the 0.19 reader (every record a Python object in the main process, copied into the workers as they touch it);
`mapped` is `read_records` now (a memory-mapped Arrow file in the records cache, a Parquet file converted into it).
The first conversion of each file (cold cache) is timed separately. The model is the tiny LLaVA (clip + mlp2x_gelu
+ llama): the model does not matter here, the records do.

Target (issue 45): memory (PSS and USS) and time to the first batch flat in the dataset's size, growth per 100k
records under 10 MiB, against the list reader in the same table. `--quick`: sizes 2,000 and 20,000 (a smoke run).

Measured (2026-12-04, 2 CPUs, idle, warm cache; MiB; growth per 100k records from 0.2M to 3.2M):

    records   file     reader  first batch s  total PSS  of it anon   USS
     200000   json     list             2.80       1121         763   358
     200000   json     mapped           0.13        874         477   364
     200000   parquet  mapped           0.16        890         484   385
    1000000   json     list            11.78       2267        1909   364
    1000000   json     mapped           0.18        939         483   432
    1000000   parquet  mapped           0.17        955         490   449
    3200000   json     list            37.73       5438        5080   380
    3200000   json     mapped           0.20       1002         500   500
    3200000   parquet  mapped           0.23       1111         508   604
    growth:   json list +143.9 MiB PSS, +0.7 MiB USS (its records shared copy-on-write: in nobody's USS), +1.16 s;
              json mapped +4.3 MiB PSS, +4.5 MiB USS, +0.002 s; parquet mapped +7.4 MiB PSS, +7.3 MiB USS, +0.002 s

Both readers of 0.20 meet the target. Parquet read through `datasets`' own cache instead (its stream format, opened
by reading every record batch) grew by 46 MiB per 100k records: the reason sources are converted into the records
cache. What still grows is the opening process's reading of each batch's header (3,125 batches at 3.2M rows).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMAGES = 16  # distinct embedded images, cycled (their bytes differ; their count does not matter to the reader)


def generate(size: int, workdir: Path) -> dict[str, Path]:
    """The LLaVA JSON list (with image files) and the Parquet file with embedded images, written once per size."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    images = workdir / "images"
    images.mkdir(exist_ok=True)
    blobs = []
    for k in range(IMAGES):
        buffer = io.BytesIO()
        Image.fromarray(np.random.default_rng(k).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buffer, "PNG")
        blobs.append(buffer.getvalue())
        (images / f"{k}.png").write_bytes(blobs[-1])
    paths = {"json": workdir / f"llava-{size}.json", "parquet": workdir / f"llava-{size}.parquet"}

    def conversation(i: int) -> list[dict]:
        return [{"from": "human", "value": f"<image>\nWhat is in picture {i}? Answer in a sentence."},
                {"from": "gpt", "value": f"Picture {i} shows noise of seed {i % IMAGES}, {i * 7 % 1000} dots."}]

    if not paths["json"].exists():
        tmp = paths["json"].with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write("[")
            for i in range(size):
                record = {"id": f"r{i}", "image": f"{i % IMAGES}.png", "conversations": conversation(i)}
                f.write(("," if i else "") + json.dumps(record))
            f.write("]")
        tmp.replace(paths["json"])
    if not paths["parquet"].exists():
        image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        turn = pa.struct([("from", pa.string()), ("value", pa.string())])
        schema = pa.schema([("id", pa.string()), ("image", image_type), ("conversations", pa.list_(turn))],
                           metadata={b"huggingface": json.dumps({"info": {"features": {
                               "id": {"dtype": "string", "_type": "Value"}, "image": {"_type": "Image"},
                               "conversations": [{"from": {"dtype": "string", "_type": "Value"},
                                                  "value": {"dtype": "string", "_type": "Value"}}]}}}).encode()})
        tmp = paths["parquet"].with_suffix(".tmp")
        with pq.ParquetWriter(tmp, schema) as writer:
            for start in range(0, size, 50_000):
                rows = range(start, min(size, start + 50_000))
                writer.write_table(pa.table({
                    "id": [f"r{i}" for i in rows],
                    "image": [{"bytes": blobs[i % IMAGES], "path": None} for i in rows],
                    "conversations": [conversation(i) for i in rows]}, schema=schema))
        tmp.replace(paths["parquet"])
    return paths


CHILD = """
import json, os, sys, time
t0 = time.perf_counter()
import psutil, torch
from mmadapt import build_model
from mmadapt.data import Collator, SampleEncoder, VLMDataset, char_tokenizer, prepare_tokenizer, read_records
from mmadapt.train.batches import GlobalBatchSampler
path, reader, images = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = build_model("clip", "mlp2x_gelu", "llama", preset="tiny")
encoder = SampleEncoder.for_model(model, prepare_tokenizer(model, char_tokenizer()), image_root=images)
t_model = time.perf_counter()
records = read_records(path, errors="report")
if reader == "list":
    records = list(records)
dataset = VLMDataset(records, encoder)
sampler = GlobalBatchSampler(len(dataset), micro_batch=8, grad_accum=1, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2, persistent_workers=True,
                                     collate_fn=Collator.for_model(model, encoder.pad_token_id))
batches = iter(loader)
next(batches)
first = time.perf_counter() - t0 - (t_model - t0)
for _ in range(20):
    next(batches)
def rollup(pid):  # proportional memory: shared pages divided among their sharers, so the sum is the total
    values = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        key, _, rest = line.partition(":")
        if key in ("Pss", "Pss_Anon", "Private_Clean", "Private_Dirty"):
            values[key] = int(rest.split()[0]) * 1024
    return values
me = psutil.Process()
workers = me.children(recursive=True)
main, theirs = rollup(me.pid), [rollup(w.pid) for w in workers]
print(json.dumps({"first_batch_s": first, "main_pss": main["Pss"], "workers_pss": sum(w["Pss"] for w in theirs),
                  "anon_pss": main["Pss_Anon"] + sum(w["Pss_Anon"] for w in theirs), "workers": len(workers),
                  "uss": sum(p["Private_Clean"] + p["Private_Dirty"] for p in (main, *theirs))}))
os._exit(0)
"""


def measure(path: Path, reader: str, images: Path, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), reader, str(images)], capture_output=True,
                         text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def convert(path: Path, env: dict) -> float:
    """Seconds for the first `read_records` of `path` (the cache cleared): the one-time conversion."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from mmadapt.data import read_records; "
                    "print(len(read_records(sys.argv[1], errors='report')))", str(path)], check=True, env=env,
                   capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200000,1000000,3200000")
    parser.add_argument("--workdir", default=None, help="where the generated datasets stay (default: a temp dir)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [2_000, 20_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mmadapt-data-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cache = workdir / "cache"
    env = {**os.environ, "MMADAPT_CACHE": str(cache), "HF_DATASETS_CACHE": str(cache / "datasets"),
           "OMP_NUM_THREADS": "1"}
    print(f"2 loader workers, batches of 8, tiny LLaVA (clip + mlp2x_gelu + llama); {os.cpu_count()} CPUs")
    print(f"{'records':>9} {'file':8} {'reader':7} {'convert s':>9} {'first batch s':>13} {'main MiB':>9} "
          f"{'workers MiB':>11} {'total MiB':>9} {'of it anon':>11} {'USS MiB':>8}")
    rows = []
    for size in sizes:
        paths = generate(size, workdir)
        shutil.rmtree(cache, ignore_errors=True)
        for kind, path in paths.items():
            seconds = convert(path, env)
            for reader in (("list", "mapped") if kind == "json" else ("mapped",)):
                m = measure(path, reader, workdir / "images", env)
                main_mib, workers_mib = m["main_pss"] / 2**20, m["workers_pss"] / 2**20
                anon, uss = m["anon_pss"] / 2**20, m["uss"] / 2**20
                rows.append((size, kind, reader, main_mib + workers_mib, anon, uss, m["first_batch_s"]))
                print(f"{size:>9} {kind:8} {reader:7} {seconds if reader == 'mapped' else 0:>9.1f} "
                      f"{m['first_batch_s']:>13.2f} {main_mib:>9.0f} {workers_mib:>11.0f} "
                      f"{main_mib + workers_mib:>9.0f} {anon:>11.0f} {uss:>8.0f}", flush=True)
    print("\ngrowth per 100k records, smallest to largest size (total PSS, its anonymous part, USS, first batch):")
    for kind, reader in sorted({(r[1], r[2]) for r in rows}):
        mine = sorted((r for r in rows if (r[1], r[2]) == (kind, reader)), key=lambda r: r[0])
        (n0, *_, m0, d0, u0, t0), (n1, *_, m1, d1, u1, t1) = mine[0], mine[-1]
        per = (n1 - n0) / 100_000
        print(f"  {kind:8} {reader:7} {(m1 - m0) / per:+8.1f} MiB  {(d1 - d0) / per:+8.1f} MiB  "
              f"{(u1 - u0) / per:+8.1f} MiB  {(t1 - t0) / per:+7.3f} s")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
