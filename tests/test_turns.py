"""Multi-turn rollouts with tools that return images (`mmadapt.train.objectives.turns`, `mmadapt.data.tool_turns`):
the template's own call format and tool messages, a template that drops tool images refused, each image (the
prompts' and those tools return) encoded once and shared by the rollout and the forward, tool tokens never labelled,
the rollout's log-probs equal to the forward's over whole trajectories, failing tools counted, never a crash."""

from __future__ import annotations

import json
import re

import pytest
import torch
from PIL import Image
from skimage import data as skdata
from test_rollout import encoded_pictures, processor_of, scores_and_grads, separate_pictures

import mmadapt
from mmadapt.data import Collator, SampleEncoder, char_tokenizer
from mmadapt.data.prompts import PromptCollator, PromptEncoder
from mmadapt.data.templates import ChatTemplateError
from mmadapt.data.tool_turns import ToolTurns
from mmadapt.data.turns import IMAGE, Turn
from mmadapt.heads import TokenLogps
from mmadapt.loss import IGNORE_INDEX
from mmadapt.sampling import Sampling
from mmadapt.tools import build_tools
from mmadapt.train.objectives.rollout import completion_logps, encode_prompts
from mmadapt.train.objectives.turns import Agent, multi_turn_rollout, scored_trajectories

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")


def failing(box: list) -> str:
    """A tool that always fails.

    Args:
        box: a box
    """
    raise RuntimeError("the tool broke")


class Always(ToolTurns):
    """The template's tool turns, reading every answer as a zoom into the image's top-left quarter (a sampled
    trajectory that calls tools without a trained policy), or as a call of `name`."""

    name = "zoom"

    @property
    def marker(self) -> str:
        return ""

    def parse(self, text):
        return [(self.name, {"box": [0, 0, 32, 32]})]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("turns")
    Image.fromarray(skdata.astronaut()).resize((64, 64)).save(root / "0.png")
    Image.fromarray(skdata.chelsea()).resize((64, 32)).save(root / "1.png")
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).eval()
    encoder = SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root), max_length=700)
    end = encoder.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ending(module, args, output):  # the end of turn made likely at every position, in rollouts and forwards
        return output.index_add(-1, torch.tensor([end]), torch.full((*output.shape[:-1], 1), 6.0))

    model.backbone.get_output_embeddings().register_forward_hook(ending)
    tools = build_tools(["zoom", "test_turns:failing"])
    prompts = PromptEncoder(encoder, completion_tokens=6, tools=tools, list_tools=False)
    records = [{"id": "a", "problem": "<image>What is it?", "answer": "A", "images": ["0.png"]},
               {"id": "b", "problem": "<image>And this?", "answer": "B", "images": ["1.png"]}]
    collate = PromptCollator(Collator.for_model(model, encoder.pad_token_id))
    batch = collate([prompts.encode(r, k) for k, r in enumerate(records)])
    turns = ToolTurns.of(encoder)
    agent = Agent(Always(turns.template, turns.tokenizer, turns.image_text, turns.format),
                  {t.name: t for t in tools}, encoder.processor, max_turns=3, max_tokens=600, max_pixels=32 * 32)
    return model, encoder, batch, agent


def trajectories(model, encoder, batch, agent, g=2, seed=0, **options):
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "meta", "columns", "images", "tools", "turns")}
    return multi_turn_rollout(model, processor_of(model, encoder), inputs, g,
                              Sampling(max_new_tokens=8, temperature=0.9), agent,
                              seeds=torch.arange(2 * g, dtype=torch.int64) * 7919 + seed,
                              encoded=encode_prompts(model, inputs), images=batch["images"], **options), inputs


def test_the_templates_write_and_read_calls_and_tool_messages_in_their_own_format():
    """Qwen3-VL's format through the built-in chatml (hermes JSON), Qwen3.5's own (XML parameters) with Qwen3's real
    tokenizer: a call written by the template is read back, and a tool message holds its image span once."""
    from real_tokenizers import real_tokenizer

    model = mmadapt.build_model(*QWEN)
    for tokenizer, template, form in ((char_tokenizer(), "auto", "hermes_json"),
                                      (real_tokenizer("qwen3"), "qwen3_5", "qwen_xml")):
        encoder = SampleEncoder.for_model(model, tokenizer, chat_template=template, max_length=512)
        turns = ToolTurns.of(encoder)
        assert turns.format == form
        written = turns.answer_text("Looking closer.", [("zoom", json.dumps({"box": [1, 2, 30, 40], "image": 0}))])
        assert turns.marker in written and turns.parse(written) == [("zoom", {"box": [1, 2, 30, 40], "image": 0})]
        suffix = turns.suffix([Turn("tool", f"{IMAGE}zoomed")])
        assert suffix.count(encoder.image_text) == 1 and "zoomed" in suffix and suffix.endswith(
            tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                          add_generation_prompt=True, chat_template=encoder.tokenizer.chat_template)[
                -len("assistant\n"):])
        with pytest.raises(ValueError, match="tool_call"):
            turns.parse(written.replace("</tool_call>", ""))


@pytest.mark.parametrize("form, text, calls", [
    ("llama_json", '{"name": "zoom", "parameters": {"box": [1, 2, 3, 4]}}', [("zoom", {"box": [1, 2, 3, 4]})]),
    ("llama_json", "It is a cat.", []),
    ("hermes_json", 'Look.\n<tool_call>\n{"name": "crop", "arguments": "{\\"box\\": [0, 0, 8, 8]}"}\n</tool_call>'
                    '\n<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call>',
     [("crop", {"box": [0, 0, 8, 8]}), ("zoom", {})]),
    ("qwen_xml", "<tool_call>\n<function=zoom>\n<parameter=box>\n[1, 2, 3, 4]\n</parameter>\n<parameter=note>\nfine "
                 "print\n</parameter>\n</function>\n</tool_call>",
     [("zoom", {"box": [1, 2, 3, 4], "note": "fine print"})]),
])
def test_each_call_format_reads_its_calls(form, text, calls):
    """Llama's JSON calls (`parameters`), Hermes / Qwen3-VL's (arguments as an object or its JSON text, several
    calls), Qwen3.5's XML parameters (JSON values where they parse, else text)."""
    from mmadapt.data.tool_turns import parse_calls

    assert parse_calls(text, form) == calls


@pytest.mark.parametrize("form, text, words", [
    ("hermes_json", '<tool_call>\n{"name": "zoom", "arguments": {"box": [1, 2}\n</tool_call>', "not JSON"),
    ("hermes_json", '<tool_call>\n{"name": "zoom", "arguments": {}}', "not closed"),
    ("hermes_json", '<tool_call>\n{"tool": "zoom"}\n</tool_call>', 'must be {"name": ..., "arguments"'),
    ("qwen_xml", "<tool_call>\n<function=zoom>\n</tool_call>", "<function=NAME>"),
])
def test_a_call_that_cannot_be_read_says_why(form, text, words):
    from mmadapt.data.tool_turns import parse_calls

    with pytest.raises(ValueError, match=re.escape(words)):
        parse_calls(text, form)


DROPPING = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n{%- if message.content is string %}"
            "{{ message.content }}{%- else %}{%- for part in message.content %}{%- if part.type == 'text' %}"
            "{{ part.text }}{%- elif part.type == 'image' and message.role != 'tool' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{%- endif %}{%- endfor %}{%- endif %}"
            "{%- for call in message.tool_calls or [] %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>"
            "{%- endfor %}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_that_drops_the_images_of_tool_messages_is_refused_at_start_naming_it(tmp_path):
    """trl #5663: a template that renders a tool message's text and drops its image parts. A GRPO run with tools
    refuses it when it starts (the objective's `bind`, which building the run's data calls), naming the template
    and the fix; the same template passes without tools."""
    from mmadapt.train import RunConfig
    from mmadapt.train.objectives.grpo.objective import GrpoObjective

    tokenizer = char_tokenizer()
    tokenizer.chat_template = DROPPING
    model = mmadapt.build_model(*QWEN)
    encoder = SampleEncoder.for_model(model, tokenizer, chat_template="tokenizer", chat_template_mismatch="warn")
    common = [f"train.out={tmp_path / 'out'}", "train.objective=grpo", "grpo.rewards=[accuracy]"]
    with pytest.raises(ChatTemplateError, match=r"'tokenizer' drops the image of a tool message.*Fix: a template"):
        GrpoObjective(RunConfig.load(None, [*common, "grpo.tools=[zoom]"])).bind(encoder, model)
    GrpoObjective(RunConfig.load(None, common)).bind(encoder, model)  # no tools: nothing to refuse


def test_a_template_without_tool_calls_is_refused():
    from real_tokenizers import real_tokenizer

    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    encoder = SampleEncoder.for_model(model, real_tokenizer("llama2"), chat_template="vicuna_v1", max_length=256)
    with pytest.raises(ChatTemplateError, match=r"'vicuna_v1'.*Fix: a template with tools"):
        ToolTurns.of(encoder)


def test_each_image_is_encoded_once_and_tool_tokens_carry_no_label(setup):
    """Two prompts x G = 2 trajectories of up to 3 answers, each answer read as a zoom: the prompts' 2 images in one
    encoding, each turn's returned images in one encoding (4 per turn, 2 turns), never again; the scored rows label
    the policy's answers only (every token of a tool message, its image span included, is -100); the tool messages
    are the template's, with the zoomed image at its own span."""
    model, encoder, batch, agent = setup
    seen, hook = encoded_pictures(model)
    try:
        done, inputs = trajectories(model, encoder, batch, agent)
    finally:
        hook.remove()
    assert seen == {"calls": 3, "pictures": 2 + 4 + 4}, (seen, done.problems)
    assert done.pool.num_images == 10 and [len(row) for row in done.images] == [3, 3, 3, 3]
    assert done.calls.tolist() == [2, 2, 2, 2] and not done.problems
    rows = scored_trajectories(inputs, done, encoder.pad_token_id, processor_of(model, encoder))
    for r, segments in enumerate(done.segments):
        labelled = rows["labels"][r][rows["labels"][r] != IGNORE_INDEX]
        assert torch.equal(labelled, torch.cat([ids for ids, policy in segments if policy]))
        assert torch.equal(labelled, done.policy.completions[r][done.policy.mask[r]])
        tool_ids = torch.cat([ids for ids, policy in segments if not policy])
        text = encoder.tokenizer.decode(tool_ids)
        assert text.count("<tool_response>") == 2 and "zoomed" in text
        assert int((tool_ids == encoder.image_token_id).sum()) == 2 * 4  # two 32x32 zooms: 4 tokens each
    images = (rows["input_ids"] == encoder.image_token_id) & (rows["labels"] != IGNORE_INDEX)
    assert not images.any()


def test_whole_trajectories_score_as_the_rollout_saw_them_and_as_separate_encodings(setup):
    """The contract over whole trajectories: the log-probs the rollout saw for each sampled token (a prefill per
    turn, the images handed over) equal the training forward's over the scored rows (<= 1e-5, fp32); the rows with
    the pool encoded once give the log-probs and gradients of rows that each encode their own images (<= 1e-6) and
    exactly those of the step's handed encoding. Blanking the tools' images moves the forward's log-probs."""
    model, encoder, batch, agent = setup
    done, inputs = trajectories(model, encoder, batch, agent, seed=3)
    rows = scored_trajectories(inputs, done, encoder.pad_token_id, processor_of(model, encoder))
    with torch.no_grad():
        forward = completion_logps(model(**rows, head=TokenLogps(0.9)).logps, rows["labels"], done.policy)
    gap = (forward - done.policy.logps).abs()[done.policy.mask]
    assert gap.max() <= 1e-5, gap.max()
    ours, our_grads = scores_and_grads(model, rows, done.policy)
    theirs, their_grads = scores_and_grads(model, separate_pictures(rows, rows), done.policy)
    pool = model.encode_images(rows["pixel_values"], rows["image_grid_thw"])
    handed, handed_grads = scores_and_grads(model, rows, done.policy, visual=pool.take(rows["image_index"]))
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0) and torch.equal(ours, handed)
    assert any("encoder" in n for n in our_grads)
    for name, grad in our_grads.items():
        assert torch.allclose(grad, their_grads[name], atol=1e-6, rtol=1e-5), name
        assert torch.allclose(grad, handed_grads[name], atol=1e-7, rtol=1e-6), name
    prompt_images = int(inputs["images_per_sample"].sum())
    blanked = dict(rows)
    blanked["pixel_values"] = rows["pixel_values"].clone()
    patches = rows["image_grid_thw"].prod(dim=1)
    blanked["pixel_values"][int(patches[:prompt_images].sum()):] = 0
    with torch.no_grad():
        moved = completion_logps(model(**blanked, head=TokenLogps(0.9)).logps, rows["labels"], done.policy)
    assert (moved - done.policy.logps).abs()[done.policy.mask].max() > 1e-3


def test_a_failing_tool_and_an_unreadable_call_are_counted_and_answered_by_a_tool_message(setup):
    """A tool that raises and a call that cannot be read: each a counted problem and a tool message saying so, the
    trajectory going on (never a crash)."""
    import dataclasses

    model, encoder, batch, agent = setup
    broken = Always(agent.turns.template, agent.turns.tokenizer, agent.turns.image_text, agent.turns.format)
    broken.name = "failing"
    done, _ = trajectories(model, encoder, batch, dataclasses.replace(agent, turns=broken))
    assert done.problems == {"tool_error": 8} and done.pool.num_images == 2
    texts = [encoder.tokenizer.decode(torch.cat([ids for ids, policy in row if not policy])) for row in done.segments]
    assert all(t.count("the tool broke") == 2 for t in texts), texts[0]

    class Unreadable(Always):
        def parse(self, text):
            raise ValueError("a <tool_call> is not closed by </tool_call>")

    unreadable = Unreadable(agent.turns.template, agent.turns.tokenizer, agent.turns.image_text, agent.turns.format)
    done, _ = trajectories(model, encoder, batch, dataclasses.replace(agent, turns=unreadable))
    assert done.problems == {"bad_call": 8}
    assert "could not be read" in encoder.tokenizer.decode(done.segments[0][1][0])


def test_a_recorded_trajectory_trains_the_calls_and_answers_never_the_tool_turns(setup, tmp_path):
    """SFT on a recorded trajectory (OpenAI messages: an assistant's tool_calls, a tool message with an image): the
    call as the template writes it and the final answer are supervised; the tool message, its image span and the
    prompt are not; both images reach the sequence at their spans."""
    model, encoder, _, _ = setup
    Image.fromarray(skdata.astronaut()).resize((64, 64)).save(tmp_path / "0.png")
    Image.fromarray(skdata.astronaut()).resize((32, 32)).save(tmp_path / "1.png")
    record = {"id": "t", "images": ["0.png", "1.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}}]},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "zoomed"}]},
        {"role": "assistant", "content": "A"}]}
    sft = SampleEncoder.for_model(model, encoder.tokenizer, image_root=str(tmp_path), max_length=700)
    sample = sft.encode(record, 0)
    tokenizer = encoder.tokenizer
    supervised = tokenizer.decode(sample.input_ids[sample.labels != IGNORE_INDEX])
    assert supervised == ('<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}\n</tool_call>'
                          '<|im_end|>A<|im_end|>'), supervised
    assert sample.num_images == 2 and int((sample.input_ids == encoder.image_token_id).sum()) == sum(
        sample.tokens_per_image)
    assert "<tool_response>" in tokenizer.decode(sample.input_ids)


@pytest.mark.slow  # five launches, three of them torchrun with 2 processes (about 90 s)
def test_ddp_and_fsdp2_with_two_processes_equal_one_process_with_uneven_turns(tmp_path):
    """Trajectories of 1 to 3 answers (a call after each answer of odd length), differing on each rank, with images
    of three sizes: two ranks (DDP, FSDP2: every rank runs as many turns, encodings and decoding steps as the
    busiest, a stand-in where its own ended) equal one process within 1e-5 in loss, rewards, tool calls, answers and
    the gradient norm (relative), at both steps; the eval's 3 prompts fall 2 and 1 on the ranks. Under FSDP2 with
    the whole vision side trained too: every turn's encodings (the vision side on no picture where a rank has none)
    reach the loss and reduce their gradients with the other ranks'."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    records = []
    for k, size in enumerate(((64, 64), (64, 32), (32, 64), (64, 64))):
        Image.fromarray(skdata.astronaut()).resize(size).save(tmp_path / f"{k}.png")
        records.append({"id": f"p{k}", "problem": "<image>What is it?", "answer": "AB"[k % 2], "images": [f"{k}.png"]})
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in records[:3]))
    (tmp_path / "base.yaml").write_text(
        f"data: {{train: {tmp_path / 'p.jsonl'}, eval: {tmp_path / 'eval.jsonl'}, image_root: {tmp_path}, "
        "max_length: 700}\n"
        "train: {steps: 2, lr: 1.0e-3, progress: false, log_every: 1, objective: grpo, eval_every: 2}\n"
        "grpo: {num_generations: 2, max_completion_length: 8, rewards: [accuracy, 'test_grpo:length'], tools: [zoom],"
        " tools_in_prompt: false, max_turns: 3, tool_max_pixels: 1024}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    worker = str(Path(__file__).parent / "turns_worker.py")

    def launch(out, *overrides, procs=1):
        launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                        str(procs)] if procs > 1 else [])
        result = subprocess.run([*launcher, worker, str(tmp_path / "base.yaml"), f"train.out={tmp_path / out}",
                                 *overrides], capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads(line) for line in (tmp_path / out / "log.jsonl").read_text().splitlines()]

    one = launch("one", "data.batch_size=2")
    answers = [record["tools/answers"] for record in one if "tools/answers" in record]
    assert len(answers) == 2 and all(1 < a < 3 for a in answers), answers  # turns differ between trajectories
    vision = ("stages.encoder=full",)  # the whole vision side trained: every turn's encodings reach the loss
    for strategy, trained in (("ddp", ()), ("fsdp", ()), ("fsdp", vision)):
        if trained:
            one = launch("one-vision", "data.batch_size=2", *trained)
        two = launch(f"{strategy}{'-vision' if trained else ''}", "data.batch_size=1",
                     f"distributed.strategy={strategy}", *trained, procs=2)
        steps = [(a, b) for a, b in zip(one, two, strict=True) if "loss" in a]
        assert len(steps) == 2
        for a, b in steps:
            for key in ("loss", "reward", "rewards/test_grpo:length/mean", "tools/calls", "tools/answers",
                        "completion_length/mean", "sampling/sampling_logp_difference/max"):
                assert abs(a[key] - b[key]) <= 1e-5, (strategy, key, a[key], b[key])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])
        evals = [(a, b) for a, b in zip(one, two, strict=True) if "eval_reward" in a]
        assert evals and all(abs(a[k] - b[k]) <= 1e-6 for a, b in evals
                             for k in ("eval_reward", "eval_reward_blanked", "eval_tool_calls")), evals


def test_a_run_with_tools_records_eval_trajectories_that_data_show_renders_and_sft_reads(tmp_path, monkeypatch,
                                                                                         capsys):
    """A GRPO step with zoom and an eval: the eval's greedy trajectories are written to OUT/trajectories/step-N
    (messages records, the prompt's and the tools' images beside them, the reward); `mmadapt data show` renders one
    as the model saw it, the zoomed image at its span inside the tool message, and SFT encodes it with the call
    supervised and the tool message not. Logged: tool calls and answers per trajectory, and the eval's controls."""
    from mmadapt.cli import main
    from mmadapt.train import RunConfig, Trainer
    from mmadapt.train.run import build_run

    monkeypatch.setattr(ToolTurns, "parse", lambda self, text: [("zoom", {"box": [0, 0, 32, 32]})])
    monkeypatch.setattr(ToolTurns, "marker", property(lambda self: ""))
    Image.fromarray(skdata.astronaut()).resize((64, 64)).save(tmp_path / "0.png")
    records = [{"id": f"p{k}", "problem": "<image>What is it?", "answer": "A", "images": ["0.png"]} for k in range(2)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    cfg = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=grpo",
                                "grpo.rewards=[accuracy]", f"data.train={tmp_path / 'p.jsonl'}",
                                f"data.eval={tmp_path / 'p.jsonl'}", f"data.image_root={tmp_path}",
                                "data.batch_size=2", "data.max_length=700", "grpo.num_generations=2",
                                "grpo.max_completion_length=4", "grpo.tools=[zoom]", "grpo.tools_in_prompt=false",
                                "grpo.max_turns=2", "grpo.tool_max_pixels=1024", "train.steps=1", "train.log_every=1",
                                "train.eval_every=1"])
    parts = build_run(cfg)
    end = parts.tokenizer.convert_tokens_to_ids("<|im_end|>")
    parts.model.backbone.get_output_embeddings().register_forward_hook(  # every answer ends at its first token
        lambda module, args, output: output.index_add(-1, torch.tensor([end]), torch.full((*output.shape[:-1], 1),
                                                                                          1e3)))
    history = Trainer(parts.model, cfg, parts.train_data, parts.collate, eval_data=parts.eval_data).fit()["history"]
    step = next(h for h in history if "loss" in h)
    assert step["tools/calls"] == 1.0 and step["tools/answers"] == 2.0
    evals = next(h for h in history if "eval_reward" in h)
    assert {"eval_reward_blanked", "eval_reward_tool_images_blanked"} <= set(evals) and evals["eval_tool_calls"] == 1
    folder = tmp_path / "out" / "trajectories" / "step-00000001"
    recorded = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    assert len(recorded) == 2 and recorded[0]["tool_calls"] == 1 and recorded[0]["answer"] == "A"
    assert [m["role"] for m in recorded[0]["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert recorded[0]["messages"][1]["tool_calls"][0]["function"] == {"name": "zoom",
                                                                      "arguments": {"box": [0, 0, 32, 32]}}
    assert len(recorded[0]["images"]) == 2 and all((folder / name).is_file() for name in recorded[0]["images"])
    assert recorded[0]["messages"][-1] == {"role": "assistant", "content": ""}  # the forced policy's empty answer
    recorded[0]["messages"][-1]["content"] = "A"  # (an empty answer is a counted problem to data show and SFT)
    (folder / "answered.jsonl").write_text(json.dumps(recorded[0]))
    assert main(["data", "show", str(folder / "answered.jsonl"), "--image-root", str(folder), "--n", "1",
                 "--colour", "never"]) == 0
    shown = capsys.readouterr().out
    response = shown[shown.index("<tool_response>"):shown.index("</tool_response>")]
    assert "<image x 4>" in response and "zoomed [0, 0, 32, 32]" in response, shown
    sample = SampleEncoder.for_model(
        parts.model, parts.tokenizer, image_root=str(folder), max_length=700).encode(recorded[0], 0)
    supervised = parts.tokenizer.decode(sample.input_ids[sample.labels != IGNORE_INDEX])
    assert supervised.startswith("<tool_call>") and "tool_response" not in supervised


def test_a_steps_loss_and_gradients_equal_its_trajectories_encoded_separately(tmp_path, monkeypatch):
    """The GRPO step with tools (the whole vision side trained): each picture encoded once - the prompts' 2 in one
    call before the rollout, the 4 zoomed images in one call as they arrive (a hook on the vision tower) - and the
    step's loss and every gradient equal those of the same trajectories with each row encoding its own copy of its
    images in the forward (<= 1e-6): the pool of encodings keeps its graph through the rollout. Fixed advantages
    make the loss non-zero."""
    from mmadapt.train import RunConfig, Trainer
    from mmadapt.train.batches import inputs_of
    from mmadapt.train.run import build_run

    monkeypatch.setattr(ToolTurns, "parse", lambda self, text: [("zoom", {"box": [0, 0, 32, 32]})])
    monkeypatch.setattr(ToolTurns, "marker", property(lambda self: ""))
    for k, size in enumerate(((64, 64), (64, 32))):
        Image.fromarray(skdata.astronaut()).resize(size).save(tmp_path / f"{k}.png")
    records = [{"id": f"p{k}", "problem": "<image>What is it?", "answer": "A", "images": [f"{k}.png"]}
               for k in range(2)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    cfg = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=grpo",
                                "grpo.rewards=[accuracy]", f"data.train={tmp_path / 'p.jsonl'}",
                                f"data.image_root={tmp_path}", "data.batch_size=2", "data.max_length=700",
                                "grpo.num_generations=2", "grpo.max_completion_length=6", "grpo.tools=[zoom]",
                                "grpo.tools_in_prompt=false", "grpo.max_turns=2", "grpo.tool_max_pixels=1024",
                                "stages.encoder=full", "grpo.loss_type=dr_grpo"])
    parts = build_run(cfg)
    end = parts.tokenizer.convert_tokens_to_ids("<|im_end|>")
    parts.model.backbone.get_output_embeddings().register_forward_hook(
        lambda module, args, output: output.index_add(-1, torch.tensor([end]), torch.full((*output.shape[:-1], 1),
                                                                                          6.0)))
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate)
    objective = trainer.objective
    objective.prepare(trainer)
    seen, hook = encoded_pictures(parts.model)
    try:
        batch = objective.training_rows(trainer, [parts.collate([parts.train_data[0], parts.train_data[1]])])[0]
    finally:
        hook.remove()
    done = batch["rollout"]["rollouts"]
    tool_images = int(batch["images_per_sample"].sum()) - 4  # each row shows its prompt's image first
    assert tool_images >= 2 and seen == {"calls": 2, "pictures": 2 + tool_images}, (seen, tool_images)
    batch["rollout"]["advantages"] = torch.tensor([1.0, -0.5, 0.25, -0.75])

    def loss_and_grads(rows):
        parts.model.zero_grad()
        terms = objective.terms(trainer, rows, 1, int(done.mask.sum()))
        terms.loss.backward()
        return terms.loss.detach(), {n: p.grad.clone() for n, p in parts.model.named_parameters()
                                     if p.grad is not None}

    ours, our_grads = loss_and_grads(batch)
    rows = {k: v for k, v in inputs_of(batch).items() if k != "encoded"}  # the forward encodes each row's own copy
    separate = {**separate_pictures(rows, rows), "rollout": batch["rollout"], "meta": batch["meta"]}
    theirs, their_grads = loss_and_grads(separate)
    assert abs(float(ours)) > 1e-4 and abs(float(ours - theirs)) <= 1e-6, (ours, theirs)
    assert our_grads.keys() == their_grads.keys() and any("encoder" in n for n in our_grads)
    assert any(float(g.abs().max()) > 0 for n, g in our_grads.items() if "encoder" in n)
    for name, grad in our_grads.items():
        assert torch.allclose(grad, their_grads[name], atol=1e-6, rtol=1e-5), name


def test_a_plan_imports_no_tool_a_config_names_as_code(tmp_path):
    """`mmadapt plan` builds the objective without importing the run's code: tools named as code are left out (a
    trajectory is bounded by data.max_length whatever its tools), and said."""
    from mmadapt.train import RunConfig
    from mmadapt.train.objectives.grpo.objective import GrpoObjective

    config = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.objective=grpo", "grpo.rewards=[accuracy]",
                                   "grpo.tools=[zoom, 'never_imported.module:tool']"])
    planned, note = GrpoObjective.without_code(config)
    assert planned.sections["grpo"]["tools"] == ["zoom"] and "never_imported.module:tool" in note
    GrpoObjective(planned)  # builds without importing it
    with pytest.raises(ValueError, match="never_imported"):
        GrpoObjective(config)


@pytest.mark.slow  # SFT then GRPO with zoom (about 2.5 min), and the same without tools (about 1 min)
def test_grpo_with_zoom_learns_to_look_again_and_its_reward_rests_on_what_the_tool_shows(tmp_path):
    """`tests/zoom_task.py`: stripes whose orientation the first view cannot show (the A and B first views differ
    by one grey level at most) and a zoom shows plainly. After SFT on the call format with answers at random, GRPO
    with the accuracy reward alone teaches the policy to read the zoomed image; the same policy without tools stays
    at chance (its inputs are the same for A and B), and blanking the images the tool returns brings the policy back
    to chance.

    Measured over seeds 0, 1, 2 x 1 / 2 threads (`python tests/zoom_task.py`): with tools 0.5 before GRPO and
    1.0 after in every run, 0.5 with the tool's images blanked, 1.0 calls per trajectory; without tools 0.5 before
    and after. Bounds: after >= 0.9, at least 0.3 above the policy without tools, which stays within 0.1 of 0.5;
    the tool's images blanked within 0.15 of 0.5."""
    from zoom_task import first_views_differ_by, run

    assert first_views_differ_by(tmp_path) <= 2 / 255 + 1e-6
    looked, direct = run(tmp_path, seed=0), run(tmp_path, seed=0, tools=False)
    start, end = looked["start"], looked["end"]
    assert abs(start["eval_reward"] - 0.5) <= 0.1 and start["eval_tool_calls"] >= 0.9, start
    assert end["eval_reward"] >= 0.9 and end["eval_tool_calls"] >= 0.9, end
    assert abs(direct["end"]["eval_reward"] - 0.5) <= 0.1, direct
    assert end["eval_reward"] - direct["end"]["eval_reward"] >= 0.3, (end, direct)
    assert abs(end["eval_reward_tool_images_blanked"] - 0.5) <= 0.15 and end["eval_reward_blanked"] <= 0.65, end
