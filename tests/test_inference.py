"""Inference from a model directory: the Processor (same code as the dataset path) and `mmadapt chat`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import mmadapt
from mmadapt import Processor, VisionLanguageModel
from mmadapt.cli import main
from mmadapt.data import Collator, SampleEncoder, char_tokenizer

COMBOS = [("qwen3_5_vit", "qwen_merger", "qwen3_5"), ("clip", "mlp2x_gelu", "llama")]


@pytest.fixture(scope="module", params=COMBOS, ids=["qwen", "llava"])
def model_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    model, tokenizer = mmadapt.build_model(*request.param).eval(), char_tokenizer()
    Processor.for_model(model, tokenizer)  # adds the span tokens, as training does
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path, tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from skimage import data

    path = tmp_path_factory.mktemp("images")
    Image.fromarray(data.astronaut()[::8, ::8]).save(path / "astronaut.png")
    Image.fromarray(np.stack([data.camera()[::16, ::8]] * 3, -1)).save(path / "camera.png")
    return path


def test_processor_batches_equal_the_dataset_path(model_dir, images):
    processor = Processor.from_pretrained(model_dir)
    records = [{"id": "a", "image": "astronaut.png", "conversations": [
                   {"from": "human", "value": "<image>\nWho is this?"}, {"from": "gpt", "value": "An astronaut."}]},
               {"id": "b", "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                          "text": "And this?"}]}],
                "images": ["camera.png"]}]
    model = VisionLanguageModel.from_pretrained(model_dir)
    encoder = SampleEncoder.for_model(model, processor.tokenizer, image_root=str(images))
    expected = Collator.for_model(model, encoder.pad_token_id)([encoder.encode_prompt(r, k)
                                                                for k, r in enumerate(records)])
    got = processor(["<image>\nWho is this?", [{"role": "user", "content": [{"type": "image"},
                                                                             {"type": "text", "text": "And this?"}]}]],
                    images=[[images / "astronaut.png"], [Image.open(images / "camera.png")]])
    assert set(got) == set(expected) - {"labels", "meta"}
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key
    assert got["attention_mask"].dtype == torch.bool and not got["attention_mask"][:, 0].logical_not().any()


def test_processor_errors_are_clear(model_dir, images):
    processor = Processor.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"1 <image> placeholder\(s\) for 0 image\(s\)"):
        processor("<image>\nWhat?")
    with pytest.raises(TypeError, match="PIL images or paths"):
        processor("<image>\nWhat?", images=[np.zeros((4, 4, 3))])


def greedy(model_dir, conversation, image_paths, max_new_tokens=12):
    model = VisionLanguageModel.from_pretrained(model_dir).eval()
    processor = Processor.from_pretrained(model_dir)
    inputs = processor(conversation, images=image_paths)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=processor.eos_token_ids,
                         pad_token_id=processor.encoder.pad_token_id)
    return processor.decode(out[0])


def test_chat_one_shot_answer_is_generate_and_the_last_line(model_dir, images, capsys):
    assert main(["chat", str(model_dir), "--image", str(images / "astronaut.png"), "--max-new-tokens", "12",
                 "Who", "is", "this?"]) == 0
    out = capsys.readouterr().out
    expected = greedy(model_dir, "<image>\nWho is this?", [images / "astronaut.png"])
    assert out.rstrip("\n").split("\n")[-1] == expected.split("\n")[-1]
    assert out.replace("\n", "") == expected.replace("\n", "")  # streamed, then ended with a newline


def test_chat_from_stdin_keeps_the_conversation(model_dir, images, capsys, monkeypatch):
    script = f"/image {images / 'camera.png'}\nWhat is it?\nAnd now?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["chat", str(model_dir), "--max-new-tokens", "8"]) == 0
    first = greedy(model_dir, "<image>\nWhat is it?", [images / "camera.png"], 8)
    second = greedy(model_dir, [{"role": "user", "content": "<image>\nWhat is it?"},
                                {"role": "assistant", "content": first}, {"role": "user", "content": "And now?"}],
                    [images / "camera.png"], 8)
    assert capsys.readouterr().out.replace("\n", "") == (first + second).replace("\n", "")


def test_sampling_is_reproducible_with_a_seed(model_dir, images):
    model = VisionLanguageModel.from_pretrained(model_dir).eval()
    inputs = Processor.from_pretrained(model_dir)("<image>\nHi", images=[images / "astronaut.png"])
    runs = [model.generate(**inputs, max_new_tokens=6, temperature=1.0, top_p=0.9,
                           generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*runs)
    greedy_ids = model.generate(**inputs, max_new_tokens=6)
    nucleus_of_one = model.generate(**inputs, max_new_tokens=6, temperature=1.0, top_p=1e-9)
    assert torch.equal(greedy_ids, nucleus_of_one)  # top_p -> 0 keeps only the most likely token
