"""RL prompts (`mmadapt.data.prompts`): trl's, EasyR1's and ms-swift's records become the same generation prompt (the
model's template with its generation prompt, the images once) and hand their other keys to the rewards; a prompt
that leaves too little of max_length for its answers is a counted problem, never cut."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import mmadapt
from mmadapt.data import DataProblem, SampleEncoder, char_tokenizer
from mmadapt.data.prompts import PromptDataset, PromptEncoder, is_prompt_record, parse_prompt
from mmadapt.data.samples import IMAGE, Turn

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
QUESTION = "How many shapes are there?"


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    for k, side in enumerate((32, 64)):
        Image.new("RGB", (side, 32), (60 * k, 90, 200)).save(root / f"{k}.png")
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN)
    return SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root), max_length=200)


RECORDS = {
    "trl": {"id": "a", "prompt": QUESTION, "image": "0.png", "solution": "3"},
    "trl messages": {"id": "a", "prompt": [{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": QUESTION}]}],
                     "images": ["0.png"], "solution": "3"},
    "EasyR1": {"id": "a", "problem": f"{IMAGE}{QUESTION}", "answer": "3", "images": ["0.png"]},
    "ms-swift": {"id": "a", "messages": [{"role": "user", "content": f"{IMAGE}{QUESTION}"}], "images": ["0.png"],
                 "solution": "3"},
    "sharegpt": {"id": "a", "conversations": [{"from": "human", "value": f"{IMAGE}{QUESTION}"}], "images": ["0.png"],
                 "solution": "3"},
}


@pytest.mark.parametrize("name", list(RECORDS))
def test_every_format_is_the_same_generation_prompt_with_its_columns(encoder, name):
    prompts = PromptEncoder(encoder, completion_tokens=16)
    record = RECORDS[name]
    assert is_prompt_record(record)
    encoded = prompts.encode(record, 0)
    reference = encoder.prompt_for("a", [Turn("user", f"{IMAGE}{QUESTION}")],
                                   [Image.open(encoder.config.image_root + "/0.png").convert("RGB")])
    assert encoded.id == "a" and encoded.sample.input_ids.tolist() == reference.input_ids.tolist()
    assert torch.equal(encoded.sample.pixel_values, reference.pixel_values)
    assert (encoded.sample.labels == -100).all()  # nothing supervised: the policy writes the answers
    assert encoded.columns == ({"answer": "3"} if name == "EasyR1" else {"solution": "3"})


def test_a_prompt_without_room_for_its_answers_is_dropped_and_counted_never_cut(encoder):
    record = {"id": "long", "problem": f"{IMAGE}" + "why? " * 20, "answer": "3", "images": ["1.png"]}
    ids = PromptEncoder(encoder, completion_tokens=1).encode(record, 0).sample.input_ids
    room = encoder.config.max_length - len(ids)
    assert PromptEncoder(encoder, completion_tokens=room).encode(record, 0).id == "long"  # just fits
    with pytest.raises(DataProblem) as refused:
        PromptEncoder(encoder, completion_tokens=room + 1).encode(record, 0)
    assert refused.value.reason == "too_long" and refused.value.sample_id == "long"
    assert "max_completion_length" in refused.value.detail and "never cut" in refused.value.detail
    dataset = PromptDataset([record, RECORDS["EasyR1"]], PromptEncoder(encoder, completion_tokens=room + 1))
    assert isinstance(dataset[0], DataProblem) and dataset[1].id == "a"  # counted, and the next one is read


@pytest.mark.parametrize("record, words", [
    ({"prompt": "Q", "chosen": "A", "rejected": "B"}, "train.objective: dpo"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}, "end with a user turn"),
    ({"problem": ""}, "non-empty"),
    ({"text": "no prompt here"}, "not an RL prompt"),
    ({"prompt": [{"content": "no role"}]}, "needs 'role'"),
])
def test_what_is_not_an_rl_prompt_says_why(record, words):
    with pytest.raises(DataProblem) as refused:
        parse_prompt(record, 7)
    assert refused.value.reason == "bad_format" and words in refused.value.detail
    assert refused.value.sample_id == "7"


def test_prompts_offer_tools_as_trl_and_verl_records_name_them(encoder):
    """With tools, a record's `tools` (names or OpenAI / trl function schemas) or verl's `extra_info.tools_kwargs`
    says which the prompt offers, listed in its prompt by the template; verl's `reward_model.ground_truth` is the
    `answer` column; the prompt keeps its images and turns; a tool the run lacks is a counted problem naming it."""
    from mmadapt.tools import build_tools

    encoder = SampleEncoder.for_model(mmadapt.build_model(*QWEN), char_tokenizer(),
                                      image_root=encoder.config.image_root, max_length=4096)  # the tool list's room
    tools = build_tools(["zoom", "crop"])
    prompts = PromptEncoder(encoder, completion_tokens=16, tools=tools)
    trl = {"id": "a", "prompt": [{"role": "user", "content": f"{IMAGE}{QUESTION}"}], "images": ["0.png"],
           "solution": "3", "tools": [tools[0].schema()]}
    verl = {"id": "b", "prompt": [{"role": "user", "content": f"{IMAGE}{QUESTION}"}], "images": ["0.png"],
            "data_source": "geo", "reward_model": {"style": "rule", "ground_truth": "3"},
            "extra_info": {"need_tools_kwargs": True, "tools_kwargs": {"crop": {"create_kwargs": {}}}}}
    first, second = prompts.encode(trl, 0), prompts.encode(verl, 1)
    assert first.tools == ("zoom",) and second.tools == ("crop",) and second.columns["answer"] == "3"
    assert len(first.images) == 1 and first.turns == (Turn("user", f"{IMAGE}{QUESTION}"),)
    text = encoder.tokenizer.decode(first.sample.input_ids)
    assert '"name": "zoom"' in text and '"name": "crop"' not in text and "<tools>" in text
    every = prompts.encode({**trl, "tools": None}, 2)
    assert every.tools == ("zoom", "crop")
    with pytest.raises(DataProblem, match=r"its tools \['rotate'\] are not among the run's grpo.tools"):
        prompts.encode({**trl, "tools": ["rotate"]}, 3)
    unlisted = PromptEncoder(encoder, completion_tokens=16, tools=tools, list_tools=False).encode(trl, 0)
    assert "<tools>" not in encoder.tokenizer.decode(unlisted.sample.input_ids)


def test_a_prompt_with_a_video_offering_tools_is_a_counted_problem(encoder):
    from mmadapt.tools import build_tools

    prompts = PromptEncoder(encoder, completion_tokens=16, tools=build_tools(["zoom"]), list_tools=False)
    record = {"id": "v", "problem": "<video>What happens?", "answer": "1", "videos": ["clip.mp4"]}
    with pytest.raises(DataProblem, match=r"video_unsupported.*frames as images"):
        prompts.encode(record, 0)
