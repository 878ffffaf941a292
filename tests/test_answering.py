"""One way to answer: the same image, question and sampling give the same answer on every path.

The five paths - `mmadapt chat --image` (the command line), the OpenAI-compatible server (a real uvicorn server, the
`openai` client, image and text parts), the page (`Page.send`), `mmadapt eval` (a one-record file) and the lmms-eval
model - all run `mmadapt.answering.answer_prompts`; a tiny Qwen3.5 model with Qwen's real tokenizer and template,
saved to a temporary directory, must answer each alike, greedily and sampled with a seed (eval answers greedily
only). And `mmadapt chat` has a flag for every sampling setting the page shows, both derived from `Sampling`.
"""

from __future__ import annotations

import argparse
import base64
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import noise_image
from real_tokenizers import real_tokenizer

import mmadapt
from mmadapt import Processor
from mmadapt.cli import main
from mmadapt.controls import REAL
from mmadapt.sampling import Sampling, sampling_settings

QUESTION = "What is in the picture?"
NEW_TOKENS = 8
SAMPLED = Sampling(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=3)
GREEDY = Sampling(max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("answering")
    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()
    tokenizer = real_tokenizer("qwen3")
    Processor.for_model(model, tokenizer, chat_template="qwen3_5")  # Qwen3.5's official template
    model.save_pretrained(root / "model", tokenizer=tokenizer)
    model = mmadapt.VisionLanguageModel.from_pretrained(root / "model").eval()
    return SimpleNamespace(root=root, model_dir=root / "model", model=model,
                           processor=Processor.from_pretrained(root / "model"),
                           png=noise_image(root / "noise.png", seed=0, size=48))


def flags(sampling: Sampling) -> list[str]:
    return [arg for s in sampling_settings() for arg in (s.flag, str(getattr(sampling, s.name)))]


def by_chat(tiny, sampling: Sampling, capsys) -> str:
    capsys.readouterr()
    assert main(["chat", str(tiny.model_dir), "--image", str(tiny.png), *flags(sampling), QUESTION]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def by_server(tiny, sampling: Sampling) -> str:
    openai = pytest.importorskip("openai")
    from mmadapt.serve import BackgroundServer, ServeSettings, create_app

    app = create_app(tiny.model, tiny.processor, ServeSettings(name="tiny"))
    url = "data:image/png;base64," + base64.b64encode(tiny.png.read_bytes()).decode()
    with BackgroundServer(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        done = client.chat.completions.create(
            model="tiny", max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed, extra_body={"repetition_penalty": sampling.repetition_penalty},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": QUESTION}]}])
    return done.choices[0].message.content


def by_page(tiny, sampling: Sampling) -> str:
    pytest.importorskip("gradio")
    from mmadapt.serve import ServeSettings, create_app
    from mmadapt.serve.card import ModelCard
    from mmadapt.serve.page import Page

    app = create_app(tiny.model, tiny.processor, ServeSettings(name="tiny"))
    page = Page(app.state.service, ModelCard.read(None, tiny.model, tiny.processor, name="tiny"), [],
                upload_folders=[tiny.root])
    controls = [getattr(sampling, s.name) for s in sampling_settings()]
    try:
        steps = list(page.send({"text": QUESTION, "files": [str(tiny.png)]}, [], *controls,
                               request=SimpleNamespace(session_hash="answering")))
    finally:
        app.state.service.close()
    return steps[-1][0][-1]["content"]


def by_eval(tiny, capsys) -> str:
    data = tiny.root / "one.jsonl"
    data.write_text(json.dumps({"id": "one", "images": [tiny.png.name], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "a reference"}]}) + "\n")
    predictions = tiny.root / "predictions.jsonl"
    assert main(["eval", str(tiny.model_dir), str(data), "--max-new-tokens", str(NEW_TOKENS),
                 "--predictions", str(predictions)]) == 0
    capsys.readouterr()
    return json.loads(predictions.read_text())[REAL.name]


def by_lmms_eval(tiny, sampling: Sampling) -> str:
    pytest.importorskip("lmms_eval")
    from lmms_eval.api.instance import Instance

    from mmadapt.lmms_eval.plugin import MmadaptModel

    doc = {"image": str(tiny.png), "question": QUESTION}

    def messages(d):
        return [{"role": "user", "content": [{"type": "image", "url": d["image"]},
                                             {"type": "text", "text": d["question"]}]}]

    gen_kwargs = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "do_sample": sampling.temperature > 0, "top_p": sampling.top_p, "seed": sampling.seed,
                  "repetition_penalty": sampling.repetition_penalty}
    lm = MmadaptModel.from_model(tiny.model, tiny.processor.tokenizer)
    lm.task_dict = {"probe": {"test": [doc]}}
    request = Instance("generate_until", (QUESTION, messages, gen_kwargs, 0, "probe", "test"), idx=0,
                       metadata={"task": "probe", "doc_id": 0, "repeats": 1})
    return lm.generate_until([request])[0].text


@pytest.mark.slow  # a server, the page and lmms-eval: about 30 s
def test_chat_server_page_eval_and_lmms_eval_give_one_greedy_answer(tiny, capsys):
    answers = {"chat": by_chat(tiny, GREEDY, capsys), "server": by_server(tiny, GREEDY),
               "page": by_page(tiny, GREEDY), "eval": by_eval(tiny, capsys), "lmms-eval": by_lmms_eval(tiny, GREEDY)}
    assert answers["chat"], "the tiny model's answer is empty: nothing would be compared"
    assert set(answers.values()) == {answers["chat"]}, answers


@pytest.mark.slow
def test_chat_server_page_and_lmms_eval_sample_one_answer_from_one_seed(tiny, capsys):
    answers = {"chat": by_chat(tiny, SAMPLED, capsys), "server": by_server(tiny, SAMPLED),
               "page": by_page(tiny, SAMPLED), "lmms-eval": by_lmms_eval(tiny, SAMPLED)}
    assert answers["chat"] != by_chat(tiny, GREEDY, capsys), "sampling must change the answer to be a test of it"
    assert set(answers.values()) == {answers["chat"]}, answers


def test_the_image_and_question_are_one_prompt_as_the_parts_render_it(tiny):
    """`Chat.ask(question, images=)` (what `mmadapt chat --image` runs) renders the parts [image, text]: the image
    span directly followed by the question, as Qwen's template renders them."""
    from mmadapt.inference import Chat

    chat = Chat(tiny.model, tiny.processor, sampling=Sampling(max_new_tokens=1))
    chat.ask(QUESTION, images=[tiny.png])
    messages, images, _ = chat.prompt()
    asked = tiny.processor(messages, images=images)["input_ids"][0].tolist()
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    assert asked == tiny.processor(parts, images=[tiny.png])["input_ids"][0].tolist()
    text = tiny.processor.tokenizer.decode(asked)
    assert f"<|vision_end|>{QUESTION}" in text


def test_mmadapt_chat_has_a_flag_for_every_sampling_setting_the_page_shows():
    pytest.importorskip("gradio")
    from mmadapt.cli.common import add_sampling_arguments, sampling_from
    from mmadapt.serve.page import sampling_controls

    controls = sampling_controls(max_tokens_limit=512)
    shown = {c.elem_id.replace("-", "_"): c.value for c in controls}
    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    chat_flags = {a.dest for a in parser._actions if a.dest != "help"}
    assert set(shown) == chat_flags and "repetition_penalty" in shown
    assert sampling_from(parser.parse_args([])) == Sampling()  # the same defaults, declared once
    assert shown == {s.name: s.default for s in sampling_settings()}
    given = sampling_from(parser.parse_args(["--repetition-penalty", "1.3", "--top-p", "0.5"]))
    assert (given.repetition_penalty, given.top_p) == (1.3, 0.5)


def test_an_end_of_turn_the_vocabulary_does_not_hold_is_no_end_id():
    """A template whose end of turn is empty or not one token of the vocabulary adds no end id: the tokenizer would
    name its unknown token for it, and every answer would stop at an `<unk>` (Llama's real tokenizer)."""
    from types import SimpleNamespace

    from real_tokenizers import real_tokenizer

    from mmadapt.processor import Processor

    tokenizer = real_tokenizer("llama2")
    for end, expected in [("", [tokenizer.eos_token_id]), ("<|im_end|>", [tokenizer.eos_token_id]),
                          ("</s>", [tokenizer.eos_token_id]), (tokenizer.unk_token, sorted({tokenizer.eos_token_id,
                                                                                           tokenizer.unk_token_id}))]:
        encoder = SimpleNamespace(tokenizer=tokenizer, template=SimpleNamespace(end_of_turn=lambda _, e=end: e))
        processor = Processor.__new__(Processor)
        processor.encoder, processor.tokenizer = encoder, tokenizer
        assert processor.eos_token_ids == expected, end
