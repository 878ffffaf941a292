"""The hub's dataset layouts as tiny local Parquet / Arrow / save_to_disk datasets written by `datasets`, images
embedded as bytes (mmadapt.data.tables): the same tokens, labels and pixels as the same samples written as LLaVA JSON
with image files, bad rows counted, and `mmadapt train` on a Parquet file."""

from __future__ import annotations

import io
import json

import datasets
import pyarrow.parquet as pq
import pytest
import torch
from helpers import TINY_LLAVA, write_run
from PIL import Image
from skimage import data as skdata

from mmadapt import build_model
from mmadapt.cli import main
from mmadapt.data import DataProblem, SampleEncoder, VLMDataset, char_tokenizer, prepare_tokenizer, read_records
from mmadapt.train.checkpoint import latest_checkpoint

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
QUESTIONS = [("What is in the picture?", "An astronaut."), ("And the colour?", "White and blue."),
             ("Describe it.", "Coffee in a cup.")]


def photos() -> list[Image.Image]:
    """Real photographs (scikit-image's), at sizes of their own: two JPEG-sized, one grey, one PNG."""
    return [Image.fromarray(skdata.astronaut()).resize((96, 64)), Image.fromarray(skdata.coffee()).resize((64, 96)),
            Image.fromarray(skdata.camera()).resize((64, 64)), Image.fromarray(skdata.chelsea()).resize((128, 96))]


def encoded(image: Image.Image, k: int) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG" if k % 2 else "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four samples: as LLaVA JSON with image files, and the same bytes embedded in each hub layout."""
    root = tmp_path_factory.mktemp("tables")
    (root / "img").mkdir()
    blobs = [encoded(p, k) for k, p in enumerate(photos())]
    for k, blob in enumerate(blobs):
        (root / "img" / f"{k}.bin").write_bytes(blob)
    one_image = [(k, [k]) for k in range(3)] + [(3, [2, 3])]  # the last sample: two images
    llava, onevision, cauldron, messages = [], [], [], []
    for k, images in one_image:
        question, answer = QUESTIONS[k % 3]
        turns = [{"from": "human", "value": "<image>\n" * len(images) + question}, {"from": "gpt", "value": answer},
                 {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]
        llava.append({"id": f"s{k}", "image": [f"img/{i}.bin" for i in images], "conversations": turns})
        cells = [{"bytes": blobs[i], "path": None} for i in images]
        onevision.append({"id": f"s{k}", "images": cells, "conversations": turns, "data_source": "test"})
        cauldron.append({"images": cells, "texts": [{"user": question, "assistant": answer, "source": "t"},
                                                    {"user": "Sure?", "assistant": "Yes.", "source": "t"}]})
        # parts as LLaVA's text reads: each image, then a newline (written as the text's first character)
        parts = [{"type": "image", "text": None}] * len(images) + [{"type": "text", "text": "\n" + question}]
        if len(images) == 2:
            parts.insert(1, {"type": "text", "text": "\n"})
        messages.append({"id": f"s{k}", "images": cells, "messages": [
            {"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]}]})
    (root / "llava.json").write_text(json.dumps(llava))
    images = datasets.Sequence(datasets.Image())
    written = {}
    for name, rows in (("onevision", onevision), ("cauldron", cauldron), ("messages", messages)):
        table = datasets.Dataset.from_list(rows)
        table = table.cast_column("images", images)
        (root / name).mkdir()
        table.to_parquet(str(root / name / "train-00000-of-00001.parquet"))
        written[name] = root / name
    # Each named dataset in the columns it is published with (checked against their dataset cards):
    # LLaVA-OneVision-Data: id, image (one Image), conversations, data_source; one image a row
    single = [{**row, "image": row["images"][0]} for row in onevision[:3]]
    named = {"llava-onevision": ([{k: v for k, v in row.items() if k != "images"} for row in single],
                                 {"image": datasets.Image()}),
             # FineVision: images, texts, source and per-turn quality ratings
             "finevision": ([{**row, "source": "test", "relevance_ratings": [5, 4], "formatting_ratings": [5, 5],
                              "visual_dependency_ratings": [4, 3], "image_correspondence_ratings": [5, 5]}
                             for row in cauldron], {"images": images}),
             # Docmatix: images, texts ({user, assistant, source}), nothing else
             "docmatix": (cauldron, {"images": images}),
             # ShareGPT4V: id, image (a path under the image root), conversations
             "sharegpt4v": ([{"id": r["id"], "image": r["image"][0], "conversations": r["conversations"]}
                             for r in llava[:3]], {})}
    for name, (rows, features) in named.items():
        table = datasets.Dataset.from_list(rows)
        for column, feature in features.items():
            table = table.cast_column(column, feature)
        (root / name).mkdir()
        table.to_parquet(str(root / name / "train-00000-of-00001.parquet"))
        written[name] = root / name
    table = datasets.Dataset.from_list(onevision).cast_column("images", images)
    table.save_to_disk(str(root / "saved"))
    written["save_to_disk"] = root / "saved"
    written["arrow file"] = next((root / "saved").glob("*.arrow"))
    return root, written


@pytest.fixture(scope="module")
def qwen(corpus):
    torch.manual_seed(0)
    model = build_model(*QWEN)
    tokenizer = prepare_tokenizer(model, char_tokenizer())
    return SampleEncoder.for_model(model, tokenizer, chat_template="qwen3_5", image_root=str(corpus[0]))


NAMED = ["llava-onevision", "cauldron", "finevision", "docmatix", "sharegpt4v"]  # each in its own published columns


@pytest.mark.parametrize("layout", ["onevision", "cauldron", "messages", "save_to_disk", "arrow file", *NAMED[2:],
                                    NAMED[0]])
def test_each_hub_layout_gives_the_tokens_labels_and_pixels_of_the_same_llava_json(corpus, qwen, layout):
    root, written = corpus
    reference = VLMDataset(root / "llava.json", qwen)
    table = VLMDataset(written[layout], qwen)
    rows = 3 if layout in ("llava-onevision", "sharegpt4v") else 4  # one image a row: the first three samples
    assert len(table) == rows and len(reference) == 4
    for k in range(rows):
        ours, theirs = table[k], reference[k]
        assert not isinstance(ours, DataProblem), ours
        assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(ours.labels, theirs.labels)
        assert torch.equal(ours.pixel_values, theirs.pixel_values)
        assert torch.equal(ours.image_grid_thw, theirs.image_grid_thw)
    assert rows == 3 or table[3].num_images == 2


@pytest.mark.parametrize("name", NAMED)
def test_each_named_dataset_trains_through_mmadapt_train(corpus, tmp_path, name):
    root, written = corpus
    write_run(tmp_path / "run.yaml", model=TINY_LLAVA,
              data={"train": written[name], "batch_size": 3, "image_root": str(root)},
              train={"steps": 1, "out": tmp_path / "out", "progress": False})
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    state = json.loads((latest_checkpoint(tmp_path / "out") / "trainer_state.json").read_text())
    assert state["samples_seen"] == 3 and state["bad_samples"] == 0


def test_columns_map_a_layout_named_otherwise_and_an_unknown_one_is_one_line(corpus, qwen, tmp_path):
    root, written = corpus
    renamed = datasets.load_from_disk(str(written["save_to_disk"])).rename_columns(
        {"conversations": "conv", "images": "pictures"})
    renamed.to_parquet(str(tmp_path / "renamed.parquet"))
    with pytest.raises(ValueError, match=r"no known column layout in columns \['id', 'pictures', 'conv', "
                                         r"'data_source'\].*data\.columns") as error:
        read_records(tmp_path / "renamed.parquet")
    assert "\n" not in str(error.value)
    mapped = read_records(tmp_path / "renamed.parquet", columns={"conversations": "conv", "images": "pictures"})
    reference = VLMDataset(root / "llava.json", qwen)
    assert torch.equal(VLMDataset(mapped, qwen)[3].pixel_values, reference[3].pixel_values)
    with pytest.raises(ValueError, match=r"columns: names \['talk'\] that the dataset does not have"):
        read_records(tmp_path / "renamed.parquet", columns={"conversations": "talk"})


def test_bad_rows_are_counted_problems_naming_the_row(corpus, qwen, tmp_path, monkeypatch):
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)  # importing lmms_eval (other tests) switches it on
    good = encoded(photos()[0], 0)
    bomb = io.BytesIO()
    Image.new("1", (20000, 20000)).save(bomb, format="PNG")  # 400 megapixels in a few kB
    turns = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "This."}]
    rows = [{"id": "corrupt", "image": {"bytes": good[: len(good) // 2], "path": None}, "conversations": turns},
            {"id": "bomb", "image": {"bytes": bomb.getvalue(), "path": None}, "conversations": turns},
            {"id": "not_png", "image": {"bytes": b"GIF87a but not", "path": None}, "conversations": turns},
            {"id": "escape", "image": {"bytes": None, "path": "../../etc/passwd"}, "conversations": turns},
            {"id": "no_turns", "image": {"bytes": good, "path": None}, "conversations": []},
            {"id": "no_column", "image": {"bytes": good, "path": None}, "conversations": None},  # a null cell
            {"id": "fine", "image": {"bytes": good, "path": None}, "conversations": turns}]
    table = datasets.Dataset.from_list(rows).cast_column("image", datasets.Image())
    # pyarrow writes it: datasets' to_parquet stats every path to size its row groups, and this one must not exist
    pq.write_table(table.data.table, tmp_path / "bad.parquet")
    dataset = VLMDataset(tmp_path / "bad.parquet", qwen)
    found = {d.sample_id: d.reason for d in (dataset[k] for k in range(len(dataset))) if isinstance(d, DataProblem)}
    assert found == {"corrupt": "unreadable_image", "bomb": "image_too_large", "not_png": "unreadable_image",
                     "escape": "path_outside_root", "no_turns": "bad_format", "no_column": "bad_format"}
    assert f"{tmp_path / 'bad.parquet'} row 1 image[0]" in str(dataset[1])  # where: the file, row and column


def test_mmadapt_train_and_data_check_read_a_parquet_dataset(corpus, tmp_path, capsys):
    _, written = corpus
    parquet = next(written["onevision"].glob("*.parquet"))
    assert main(["data", "check", str(parquet), "--encoder", "clip", "--projector", "mlp2x_gelu", "--backbone",
                 "llama"]) == 0
    assert "samples: 4   usable: 4   problems: 0" in capsys.readouterr().out
    write_run(tmp_path / "run.yaml", model=TINY_LLAVA, data={"train": written["onevision"], "batch_size": 4},
              train={"steps": 2, "out": tmp_path / "out", "progress": False})
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    state = json.loads((latest_checkpoint(tmp_path / "out") / "trainer_state.json").read_text())
    assert state["samples_seen"] == 8 and state["bad_samples"] == 0


def test_a_source_is_converted_once_to_the_records_cache_and_pickles_as_its_path(corpus, monkeypatch):
    import pickle

    import mmadapt.data.records as records_module

    _, written = corpus
    first = read_records(written["cauldron"])
    monkeypatch.setattr(records_module, "_file_sha256", lambda *a: pytest.fail("the source was read again"))
    again = read_records(written["cauldron"])
    assert again._rows.arrow == first._rows.arrow and again.layout == "texts"
    payload = pickle.dumps(again)
    assert len(payload) < 1000 and pickle.loads(payload)[3] == again[3]


def test_a_file_that_is_not_parquet_is_one_line_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not a parquet file PAR1")
    assert main(["data", "check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}: not a readable Parquet file") and "\n" not in err
