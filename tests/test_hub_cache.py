"""A hub dataset named `hub:OWNER/NAME[/SUBSET][@SPLIT]` read from the local hub cache, offline
(mmadapt.data.tables.HubDataset): a fake cache laid out as huggingface_hub writes it (`datasets--OWNER--NAME/refs/main`
holding a commit, `snapshots/<commit>/` with a README whose `configs:` YAML names two subsets, Parquet shards written
by `datasets`). The subset's split gives the records and tokens of its Parquet file read directly; shards are one
source in order; the network is never touched; a dataset not cached, an unknown subset or split, and a dataset script
are one-line errors that say how to fix them."""

from __future__ import annotations

import io
import socket

import datasets
import pytest
import torch
from PIL import Image
from skimage import data as skdata

from mmadapt import build_model
from mmadapt.data import SampleEncoder, VLMDataset, char_tokenizer, prepare_tokenizer, read_records
from mmadapt.data.tables import HubDataset, hub_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"
README = """---
configs:
- config_name: ai2d
  data_files:
  - split: train
    path: ai2d/train-*
  - split: test
    path: ai2d/test-*
- config_name: chart
  data_files:
  - split: train
    path: chart/train-*
  - split: test
    path: chart/test-*
---
# A cauldron in miniature
"""
SHARDS = {("ai2d", "train"): [2, 1], ("ai2d", "test"): [1], ("chart", "train"): [1], ("chart", "test"): [2]}
"""(subset, split) -> rows per shard: ai2d's train split is two shards of different lengths."""
OUTSIDE = {"absolute": "{outside}", "up": "../../../../elsewhere/*.parquet", "remote": "hf://datasets/acme/other/x.parquet",
           "url": "https://example.com/train.parquet", "link": "data/*.parquet"}
"""Datasets whose README names files outside the dataset: each refused (the link: a data file linking outside)."""


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def snapshot_of(cache, repo_id: str):
    """An empty snapshot of `repo_id` in `cache`, as huggingface_hub lays one out (refs/main names the commit)."""
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


def write_shard(path, subset: str, split: str, shard: int, rows: int) -> None:
    photo = png(Image.fromarray(skdata.astronaut()).resize((32 + 16 * shard, 32)))
    table = datasets.Dataset.from_list([{"images": [{"bytes": photo, "path": None}], "texts": [
        {"user": f"{subset} {split} shard {shard} row {r}?", "assistant": "Yes.", "source": "t"}]}
        for r in range(rows)]).cast_column("images", datasets.Sequence(datasets.Image()))
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(str(path))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The hub cache: acme/cauldron (two subsets, README configs), acme/plain (no configs: data/{split}-* files),
    acme/scripted (a dataset script)."""
    root = tmp_path_factory.mktemp("hf_home")
    cache = root / "hub"
    snapshot = snapshot_of(cache, "acme/cauldron")
    (snapshot / "README.md").write_text(README)
    for (subset, split), shards in SHARDS.items():
        for k, rows in enumerate(shards):
            write_shard(snapshot / subset / f"{split}-{k:05d}-of-{len(shards):05d}.parquet", subset, split, k, rows)
    plain = snapshot_of(cache, "acme/plain")
    write_shard(plain / "data" / "train-00000-of-00001.parquet", "plain", "train", 0, 2)
    scripted = snapshot_of(cache, "acme/scripted")
    (scripted / "scripted.py").write_text("import datasets  # a loader mmadapt must never run\n")
    write_shard(scripted / "data" / "train-00000-of-00001.parquet", "scripted", "train", 0, 1)
    outside = root / "elsewhere" / "train-00000-of-00001.parquet"  # a file of no dataset, that none may read
    write_shard(outside, "outside", "train", 0, 1)
    for name, path in OUTSIDE.items():
        snapshot = snapshot_of(cache, f"acme/{name}")
        write_shard(snapshot / "data" / "train-00000-of-00001.parquet", name, "train", 0, 1)
        if name == "link":
            (snapshot / "data" / "train-00001-of-00001.parquet").symlink_to(outside)
        path = path.format(outside=outside)
        (snapshot / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_files:\n"
                                            f"  - split: train\n    path: {path}\n---\n")
    return root


@pytest.fixture
def hub(cache, monkeypatch):
    """The fake cache as the environment names it, offline, with any connection attempt recorded and refused."""
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(f"test: no network ({args})")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)  # a name looked up is the network touched, found or not
    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield cache / "hub"
    assert attempts == [], f"the network was touched: {attempts}"


@pytest.fixture(scope="module")
def encoder(cache):
    torch.manual_seed(0)
    model = build_model("qwen3_5_vit", "qwen_merger", "qwen3_5")
    return SampleEncoder.for_model(model, prepare_tokenizer(model, char_tokenizer()), chat_template="qwen3_5")


def questions(records) -> list[str]:
    return [r["conversations"][0]["value"] for r in records]


def test_a_subset_and_split_give_the_records_and_tokens_of_its_parquet_file(hub, encoder):
    named = read_records("hub:acme/cauldron/chart@test")
    direct = read_records(hub / "datasets--acme--cauldron" / "snapshots" / COMMIT / "chart" /
                          "test-00000-of-00001.parquet")
    assert named.source == "hub:acme/cauldron/chart@test" and len(named) == len(direct) == 2
    for ours, theirs in zip(named, direct, strict=True):
        assert ours["conversations"] == theirs["conversations"]
        assert [i.data for i in ours["image"]] == [i.data for i in theirs["image"]]
        assert ours["image"][0].name.startswith("hub:acme/cauldron/chart@test row ")  # problems name the source
    assert questions(named) == ["<image>\nchart test shard 0 row 0?", "<image>\nchart test shard 0 row 1?"]
    ours, theirs = VLMDataset(named, encoder), VLMDataset(direct, encoder)
    for k in range(2):
        assert torch.equal(ours[k].input_ids, theirs[k].input_ids) and torch.equal(ours[k].labels, theirs[k].labels)
        assert torch.equal(ours[k].pixel_values, theirs[k].pixel_values)


def test_the_split_defaults_to_train_and_shards_are_one_source_in_order(hub):
    records = read_records("hub:acme/cauldron/ai2d")
    assert questions(records) == ["<image>\nai2d train shard 0 row 0?", "<image>\nai2d train shard 0 row 1?",
                                  "<image>\nai2d train shard 1 row 0?"]
    assert [r["id"] for r in records] == ["0", "1", "2"]  # one source: rows numbered across the shards
    assert questions(read_records("hub:acme/cauldron/ai2d@test")) == ["<image>\nai2d test shard 0 row 0?"]


def test_without_configs_the_default_subset_follows_the_file_names(hub):
    assert questions(read_records("hub:acme/plain")) == ["<image>\nplain train shard 0 row 0?",
                                                         "<image>\nplain train shard 0 row 1?"]


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_a_dataset_not_in_the_cache_names_the_cache_searched_and_the_download(hub):
    with pytest.raises(ValueError, match=r"not .*in the local hub cache") as error:
        read_records("hub:acme/absent/ai2d@train")
    text = one_line(error)
    assert str(hub) in text and "hf download --repo-type dataset acme/absent" in text


def test_an_unknown_subset_lists_the_known_ones(hub):
    with pytest.raises(ValueError, match=r"no subset 'charts' in acme/cauldron; its subsets: \['ai2d', 'chart'\]") \
            as error:
        read_records("hub:acme/cauldron/charts@train")
    one_line(error)
    with pytest.raises(ValueError, match=r"several subsets and none is the default; its subsets: \['ai2d', 'chart'\]"):
        read_records("hub:acme/cauldron@train")


def test_an_unknown_split_lists_the_known_ones(hub):
    with pytest.raises(ValueError, match=r"no split 'validation' in subset 'chart' of acme/cauldron; its splits: "
                                         r"\['train', 'test'\]") as error:
        read_records("hub:acme/cauldron/chart@validation")
    one_line(error)


def test_a_dataset_script_is_refused_and_never_run(hub):
    with pytest.raises(ValueError, match=r"acme/scripted is a dataset script \(scripted.py\), and mmadapt never runs "
                                         "a dataset's code") as error:
        read_records("hub:acme/scripted")
    one_line(error)


def test_the_name_is_parsed_into_its_parts_and_a_malformed_one_shows_the_form():
    assert HubDataset.parse("hub:HuggingFaceM4/the_cauldron/ai2d@test") == \
        HubDataset("HuggingFaceM4/the_cauldron", "ai2d", "test")
    assert HubDataset.parse("hub:HuggingFaceM4/the_cauldron") == HubDataset("HuggingFaceM4/the_cauldron", None, "train")
    assert str(HubDataset.parse("hub:a/b@x")) == "hub:a/b@x"
    for bad in ("hub:the_cauldron", "hub:a/b/c/d", "hub:a//c", "hub:a/b@", "hub:a/b@x@y"):
        with pytest.raises(ValueError, match=r"a hub dataset is written hub:OWNER/NAME\[/SUBSET\]\[@SPLIT\]"):
            HubDataset.parse(bad)


def test_the_cache_is_read_from_the_environment_when_used(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache() == tmp_path / "elsewhere"


@pytest.mark.parametrize("name", OUTSIDE)
def test_a_readme_naming_files_outside_the_dataset_is_refused_in_one_line_offline(hub, name, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")  # not relied on: the reader resolves nothing remote (hub asserts no socket)
    with pytest.raises(ValueError, match=r"README\.md") as error:
        read_records(f"hub:acme/{name}")
    text = one_line(error)
    assert ("outside" in text or "not a path inside the dataset" in text) and "mmadapt reads only" in text
    if name == "link":
        assert "elsewhere" in text


def test_the_hub_reader_opens_no_socket_without_the_offline_switches(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert len(read_records("hub:acme/cauldron/ai2d@train")) == 3  # the `hub` fixture fails on any connection


def test_a_save_to_disk_state_naming_files_outside_the_directory_is_refused(tmp_path):
    import json
    import shutil

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"texts": [{"user": "Hi?", "assistant": "Yes."}]}]).save_to_disk(str(saved))
    assert len(read_records(saved)) == 1
    data = next(saved.glob("*.arrow"))
    shutil.copy(data, tmp_path / "other.arrow")
    state = json.loads((saved / "state.json").read_text())
    for name in ("../other.arrow", str(tmp_path / "other.arrow"), "link.arrow"):
        (saved / "link.arrow").unlink(missing_ok=True)
        (saved / "link.arrow").symlink_to(tmp_path / "other.arrow")
        state["_data_files"] = [{"filename": name}]
        (saved / "state.json").write_text(json.dumps(state))
        with pytest.raises(ValueError, match=r"state\.json") as error:
            read_records(saved)
        text = one_line(error)
        assert "mmadapt reads only" in text and (name in text or "resolves to" in text)
