"""Inference from a model directory: the Processor (same code as the dataset path) and `mmadapt chat`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from helpers import lora_run
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
    with pytest.raises(TypeError, match="PIL images, paths or EmbeddedImage"):
        processor("<image>\nWhat?", images=[np.zeros((4, 4, 3))])


def with_image(question: str) -> list[dict]:
    """A question with an image as `mmadapt chat --image` and an OpenAI request give it: the parts [image, text]."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


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
    expected = greedy(model_dir, with_image("Who is this?"), [images / "astronaut.png"])
    assert out.rstrip("\n").split("\n")[-1] == expected.split("\n")[-1]
    assert out.replace("\n", "") == expected.replace("\n", "")  # streamed, then ended with a newline


def test_chat_from_stdin_keeps_the_conversation(model_dir, images, capsys, monkeypatch):
    script = f"/image {images / 'camera.png'}\nWhat is it?\nAnd now?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["chat", str(model_dir), "--max-new-tokens", "8"]) == 0
    first = greedy(model_dir, with_image("What is it?"), [images / "camera.png"], 8)
    second = greedy(model_dir, [*with_image("What is it?"),
                                {"role": "assistant", "content": first}, {"role": "user", "content": "And now?"}],
                    [images / "camera.png"], 8)
    assert capsys.readouterr().out.replace("\n", "") == (first + second).replace("\n", "")


def test_a_chat_session_answers_as_mmadapt_chat_does_and_keeps_the_conversation(model_dir, images, capsys):
    from mmadapt.inference import Chat, Sampling

    camera = images / "camera.png"
    assert main(["chat", str(model_dir), "--image", str(camera), "--max-new-tokens", "8", "What is it?"]) == 0
    printed = capsys.readouterr().out
    chat = Chat.load(model_dir, sampling=Sampling(max_new_tokens=8))
    pieces: list[str] = []
    first = chat.ask("What is it?", images=[camera], on_text=pieces.append)
    assert printed == first + "\n"  # the session's greedy answer is what `mmadapt chat` prints
    assert len(pieces) > 1 and "".join(pieces) == first  # streamed in pieces that make the answer
    second = chat.ask("And now?")  # the first turn's image stays in context
    assert second == greedy(model_dir, [*with_image("What is it?"),
                                        {"role": "assistant", "content": first},
                                        {"role": "user", "content": "And now?"}], [camera], 8)
    assert [(t.role, t.images) for t in chat.turns] == [("user", (camera,)), ("assistant", ()), ("user", ()),
                                                       ("assistant", ())]
    chat.reset()
    assert chat.turns == [] and chat.images == [] and chat.videos == []
    chat.attach(images=[camera])  # what `/image PATH` does: the next turn's image
    assert chat.ask("What is it?") == first and len(chat.turns) == 2


def test_a_chat_samples_reproducibly_from_its_seed_and_restores_the_model_mode(model_dir, images):
    from mmadapt.inference import Chat, Sampling

    model = VisionLanguageModel.from_pretrained(model_dir).train()
    chat = Chat(model, Processor.from_pretrained(model_dir),
                sampling=Sampling(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=3))
    ask = ("<image>\nHi", [images / "astronaut.png"])
    answer = chat.ask(*ask)
    assert model.training and all(m.training for m in model.modules())  # generated in eval mode, mode restored
    chat.reset()
    assert chat.ask(*ask) == answer  # a reset chat samples as a new one


def test_sampling_is_reproducible_with_a_seed(model_dir, images):
    model = VisionLanguageModel.from_pretrained(model_dir).eval()
    inputs = Processor.from_pretrained(model_dir)("<image>\nHi", images=[images / "astronaut.png"])
    runs = [model.generate(**inputs, max_new_tokens=6, temperature=1.0, top_p=0.9,
                           generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*runs)
    greedy_ids = model.generate(**inputs, max_new_tokens=6)
    nucleus_of_one = model.generate(**inputs, max_new_tokens=6, temperature=1.0, top_p=1e-9)
    assert torch.equal(greedy_ids, nucleus_of_one)  # top_p -> 0 keeps only the most likely token


def test_chat_from_an_adapters_directory_and_from_a_base_model_with_adapters(tmp_path, images, capsys):
    """OUT/adapters stands for its run; BASE --adapters OUT/adapters merges peft's files into the base model: both
    answer as OUT/model does, and the merged weights equal OUT/model's (so the adapters did change the model)."""
    from mmadapt.inference import load_for_inference

    base = lora_run(tmp_path, ["stages.encoder=frozen", "stages.projector=frozen", "stages.backbone=lora"])
    run = tmp_path / "run"
    assert (run / "adapters" / "stages.json").is_file() and (run / "adapters" / "backbone").is_dir()
    prompt = ["--image", str(images / "astronaut.png"), "--max-new-tokens", "10", "Who", "is", "this?"]
    answers = []
    for model_args in ([str(run / "model")], [str(run / "adapters")], [str(base), "--adapters", str(run / "adapters")]):
        assert main(["chat", *model_args, *prompt]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] == answers[2]
    merged, _ = load_for_inference(base, run / "adapters")
    trained = VisionLanguageModel.from_pretrained(run / "model").state_dict()
    untrained = VisionLanguageModel.from_pretrained(base).state_dict()
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, untrained[k])]
    assert changed and all(k.startswith("backbone.") for k in changed)
    assert all((v - trained[k]).abs().max() <= 1e-6 for k, v in merged.state_dict().items())


def test_adapters_alone_are_refused_with_the_fix(tmp_path, images, capsys):
    import shutil

    base = lora_run(tmp_path, ["stages.preset=lora"])  # the projector trained fully: not in the adapters
    adapters = tmp_path / "run" / "adapters"
    assert main(["chat", str(base), "--adapters", str(adapters), "Hi"]) == 2
    assert "also trained projector fully" in capsys.readouterr().err
    shutil.copytree(adapters, tmp_path / "copied")
    assert main(["chat", str(tmp_path / "copied"), "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds only LoRA adapters" in err and "--adapters" in err
