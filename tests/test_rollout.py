"""Rollouts for online RL (`mmadapt.train.objectives.rollout`): G answers per prompt with each picture encoded once,
never a vision placeholder generated, and the rows the policy scores give the log-probs (and gradients) of rows that
each encode their own picture."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import mmadapt
from mmadapt.contract import ImageTokenContractError
from mmadapt.data import Collator, SampleEncoder, char_tokenizer
from mmadapt.data.prompts import PromptEncoder
from mmadapt.generation import placeholder_ids
from mmadapt.heads import TokenLogps
from mmadapt.loss import IGNORE_INDEX
from mmadapt.processor import Processor
from mmadapt.sampling import Sampling
from mmadapt.train.objectives.rollout import check_groups, completion_logps, rollout, scored_rows

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
PROMPTS = [
    {"id": "two", "problem": "<image><image>How many shapes?", "answer": "2", "images": ["0.png", "1.png"]},
    {"id": "text", "problem": "Say a number.", "answer": "1"},
    {"id": "one", "problem": "<image>What colour?", "answer": "red", "images": ["1.png"]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    for k, side in enumerate((32, 64)):
        Image.new("RGB", (side, 32), (90 * k, 40, 200)).save(root / f"{k}.png")
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).eval()
    encoder = SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root), max_length=256)
    prompts = PromptEncoder(encoder, completion_tokens=12)
    batch = Collator.for_model(model, encoder.pad_token_id)([prompts.encode(r, k).sample
                                                              for k, r in enumerate(PROMPTS)])
    return model, encoder, {k: v for k, v in batch.items() if k not in ("labels", "meta")}


def processor_of(model, encoder):
    """Answering's processor over `encoder`: the rollout's end ids (`Processor.eos_token_ids`) and pad id."""
    return Processor(encoder, Collator.for_model(model, encoder.pad_token_id))


def encoded_pictures(model):
    """A hook on the vision tower: (calls, pictures encoded)."""
    seen = {"calls": 0, "pictures": 0}

    def count(module, args, output):
        seen["calls"] += 1
        seen["pictures"] += int(args[1].shape[0]) if len(args) > 1 and args[1] is not None else 0

    return seen, model.encoder.register_forward_hook(count)


def separate_pictures(rows, batch):
    """`rows` with each row's own copy of its images and videos (no `image_index` / `video_index`): what G separate
    encodings see."""
    separate = dict(rows)
    for index, pixels, grids in (("image_index", "pixel_values", "image_grid_thw"),
                                 ("video_index", "pixel_values_videos", "video_grid_thw")):
        if index not in separate:
            continue
        chosen = separate.pop(index)
        patches = batch[grids].prod(dim=1)
        starts = torch.cumsum(patches, 0) - patches
        separate[pixels] = torch.cat([batch[pixels][int(starts[i]):int(starts[i] + patches[i])]
                                      for i in chosen.tolist()])
        separate[grids] = batch[grids][chosen]
    return separate


def scores_and_grads(model, rows, done, **given):
    """The per-token log-probs (T = 0.7) of `rows` and the gradients of their sum over the answers."""
    model.zero_grad()
    scored = model(**rows, **given, head=TokenLogps(0.7))
    per_token = completion_logps(scored.logps, rows["labels"], done)
    (per_token * done.mask).sum().backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_shared_equals_separate_and_handed(model, batch, shared, done, pictures):
    """The shared layout encodes each picture once (`pictures`) and gives the log-probs and gradients of G separate
    encodings (<= 1e-6), and exactly those of the pictures encoded beforehand (`encode_prompts`, its graph kept)."""
    from mmadapt.train.objectives.rollout import encode_prompts

    seen, hook = encoded_pictures(model)
    try:
        ours, our_grads = scores_and_grads(model, shared, done)
    finally:
        hook.remove()
    assert seen == {"calls": 1, "pictures": pictures}
    theirs, their_grads = scores_and_grads(model, separate_pictures(shared, batch), done)
    handed, handed_grads = scores_and_grads(model, shared, done, **encode_prompts(model, batch).for_rows(shared))
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    assert torch.equal(ours, handed)
    assert our_grads.keys() == their_grads.keys() == handed_grads.keys() and any("encoder" in n for n in our_grads)
    for name, grad in our_grads.items():
        assert torch.allclose(grad, their_grads[name], atol=1e-6, rtol=1e-5), name
        assert torch.allclose(grad, handed_grads[name], atol=1e-7, rtol=1e-6), name


@pytest.mark.parametrize("g", [2, 4])
def test_each_picture_is_encoded_once_for_the_g_answers_of_its_prompt(setup, g):
    model, encoder, batch = setup
    seen, hook = encoded_pictures(model)
    try:
        done = rollout(model, processor_of(model, encoder), batch, g, Sampling(max_new_tokens=6, temperature=1.0),
                   generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    assert seen == {"calls": 1, "pictures": 3}  # three pictures in the batch, whatever G
    assert done.completions.shape[0] == 3 * g and done.mask[:, 0].all()
    rows = scored_rows(batch, done, encoder.pad_token_id)
    check_groups(rows, g, model.tokens.image_token_id)
    assert rows["image_index"].tolist() == [0, 1] * g + [2] * g  # prompt 0's two pictures, prompt 2's one


def test_no_answer_holds_a_vision_placeholder_even_from_a_head_that_wants_one(setup):
    model, encoder, batch = setup
    banned = placeholder_ids(model.tokens)
    head = model.backbone.get_output_embeddings()

    def favour(module, args, output):
        output = output.clone()
        output[..., banned] += 1e4  # the placeholders are by far the likeliest tokens
        return output

    hook = head.register_forward_hook(favour)
    try:
        done = rollout(model, processor_of(model, encoder), batch, 3, Sampling(max_new_tokens=8, temperature=1.0),
                   generator=torch.Generator().manual_seed(1))
    finally:
        hook.remove()
    assert not torch.isin(done.completions[done.mask], torch.tensor(banned)).any()


def test_scored_rows_equal_rows_that_each_encode_their_own_pictures(setup):
    """The shared layout's per-token log-probs and their gradients equal those of G separate encodings."""
    model, encoder, batch = setup
    done = rollout(model, processor_of(model, encoder), batch, 2, Sampling(max_new_tokens=5, temperature=1.0),
                   generator=torch.Generator().manual_seed(2))
    check_shared_equals_separate_and_handed(model, batch, scored_rows(batch, done, encoder.pad_token_id), done,
                                            pictures=3)  # once each, for six rows


def test_token_logps_are_the_tempered_log_softmax_of_the_full_logits(setup):
    model, encoder, batch = setup
    done = rollout(model, processor_of(model, encoder), batch, 2, Sampling(max_new_tokens=4, temperature=1.0),
                   generator=torch.Generator().manual_seed(3))
    rows = scored_rows(batch, done, encoder.pad_token_id)
    with torch.no_grad():
        scored = model(**rows, head=TokenLogps(0.7, entropy=True))
        ours, entropy = scored.logps, scored.entropy
        logits = model(**{k: v for k, v in rows.items() if k != "labels"}, return_logits=True).logits
    tempered = torch.log_softmax(logits.float() / 0.7, dim=-1)[:, :-1]
    full = tempered.gather(-1, rows["labels"][:, 1:].clamp(min=0)[..., None])[..., 0]
    labelled = rows["labels"][:, 1:] != IGNORE_INDEX
    assert torch.allclose(ours[:, 1:][labelled], full[labelled], atol=1e-5, rtol=0)
    assert (ours[:, 1:][~labelled] == 0).all() and (ours[:, 0] == 0).all()
    their_entropy = -(tempered.exp() * tempered).sum(-1)  # of the distribution each labelled token was drawn from
    assert torch.allclose(entropy[:, 1:][labelled], their_entropy[labelled], atol=1e-5, rtol=0)
    assert (entropy[:, 1:][~labelled] == 0).all() and (entropy[:, 0] == 0).all()


@pytest.mark.parametrize("kind", ["images", "videos"])
def test_the_rollouts_log_probs_equal_the_forward_over_the_rows_it_scores(setup, with_videos, kind):
    """The contract between a rollout and the training forward: at the same weights the log-probs the rollout saw
    for its sampled tokens (prefill once, the cache copied G ways) equal the forward's over the scored rows (G rows
    side by side, each picture shared), within 1e-5 at fp32 (images; videos, an image and a video, text). Rows whose
    pictures are not the rollout's (blanked) are visibly off: what `sampling/sampling_logp_difference` watches in a
    run."""
    model, encoder, batch = setup if kind == "images" else with_videos
    done = rollout(model, processor_of(model, encoder), batch, 3, Sampling(max_new_tokens=6, temperature=0.8),
                   generator=torch.Generator().manual_seed(6))
    rows = scored_rows(batch, done, encoder.pad_token_id)
    with torch.no_grad():
        forward = completion_logps(model(**rows, head=TokenLogps(0.8)).logps, rows["labels"], done)
    assert done.logps.shape == done.completions.shape and (done.logps[~done.mask] == 0).all()
    gap = (forward - done.logps).abs()[done.mask]
    assert gap.max() <= 1e-5, gap.max()
    pixels = "pixel_values" if kind == "images" else "pixel_values_videos"
    moved = {**rows, pixels: torch.zeros_like(rows[pixels])}  # the rows no longer see what the rollout saw
    with torch.no_grad():
        wrong = completion_logps(model(**moved, head=TokenLogps(0.8)).logps, rows["labels"], done)
    assert (wrong - done.logps).abs()[done.mask].max() > 1e-3


def test_a_group_whose_rows_see_different_prompts_is_refused(setup):
    model, encoder, batch = setup
    done = rollout(model, processor_of(model, encoder), batch, 2, Sampling(max_new_tokens=3, temperature=1.0),
                   generator=torch.Generator().manual_seed(4))
    rows = scored_rows(batch, done, encoder.pad_token_id)
    swapped = {**rows, "image_index": rows["image_index"].clone()}
    swapped["image_index"][2] = 2  # group 0's second row shows prompt 2's picture
    with pytest.raises(ImageTokenContractError, match="group 0"):
        check_groups(swapped, 2, model.tokens.image_token_id)


def test_an_answer_sampled_from_its_own_seed_is_the_same_whatever_rows_are_beside_it(setup):
    """What lets ranks and resumed runs sample as one process does: row seeds from the prompt's id, not the batch."""
    from mmadapt.data import Collator
    from mmadapt.train.objectives.rollout import row_seeds

    model, encoder, batch = setup
    prompts = PromptEncoder(encoder, completion_tokens=12)
    alone = Collator.for_model(model, encoder.pad_token_id)([prompts.encode(PROMPTS[2], 2).sample])
    alone = {k: v for k, v in alone.items() if k not in ("labels", "meta")}
    ids = [r["id"] for r in PROMPTS]
    processor, sampling = processor_of(model, encoder), Sampling(max_new_tokens=8, temperature=1.0)
    together = rollout(model, processor, batch, 3, sampling, seeds=row_seeds(0, 5, ids, 3))
    by_itself = rollout(model, processor, alone, 3, sampling, seeds=row_seeds(0, 5, ids[2:], 3))
    assert torch.equal(together.completions[6:], by_itself.completions)
    again = rollout(model, processor, batch, 3, sampling, seeds=row_seeds(0, 6, ids, 3))  # the next step draws anew
    assert not torch.equal(together.completions, again.completions)
    assert len({tuple(row.tolist()) for row in together.completions[:3]}) > 1  # a group's answers differ


def test_row_sampling_draws_from_the_distribution():
    from mmadapt.generation import row_sample

    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0]]).expand(20_000, 4)
    tokens = row_sample(probs, torch.arange(20_000, dtype=torch.int64) * 7919 + 11)
    shares = torch.bincount(tokens, minlength=4) / 20_000
    assert torch.allclose(shares, torch.tensor([0.1, 0.2, 0.7, 0.0]), atol=0.015)  # 4.7 sigma at 20k draws


@pytest.mark.parametrize("parts", [QWEN, ("clip", "mlp2x_gelu", "llama"), ("qwen3_vl_vit", "qwen_merger", "qwen3_vl")])
def test_a_prompt_prefilled_once_with_its_cache_copied_answers_as_g_prefills_do(tmp_path, parts):
    """`generate(repeats=G)`: each prompt prefilled once and its cache (attention keys and values; Qwen3.5's Gated
    DeltaNet conv and recurrent states) copied G ways gives, token for token, the answers of the G rows prefilled
    side by side, and their log-probs within 1e-5 (fp32; the prefill's batch differs, so its sums may round apart);
    each copy then runs on its own (a group's sampled answers differ)."""
    from mmadapt.generation import GenerationStep
    from mmadapt.train.objectives.rollout import INPUTS, group_rows, row_seeds

    records = [{**PROMPTS[0], "problem": "<image>\n<image>\nHow many shapes?"}, *PROMPTS[1:]]  # llava: spans apart
    for k, side in enumerate((32, 64)):
        Image.new("RGB", (side, 32), (90 * k, 40, 200)).save(tmp_path / f"{k}.png")
    torch.manual_seed(0)
    model = mmadapt.build_model(*parts).eval()
    encoder = SampleEncoder.for_model(model, char_tokenizer(), image_root=str(tmp_path), max_length=256)
    prompts = PromptEncoder(encoder, completion_tokens=12)
    batch = Collator.for_model(model, encoder.pad_token_id)([prompts.encode(r, k).sample
                                                              for k, r in enumerate(records)])
    g, seeds = 3, row_seeds(0, 1, [r["id"] for r in PROMPTS], 3)

    def answers(inputs, **extra):
        scores = []

        def keep(step: GenerationStep):
            scores.append(step.logprobs)

        tokens = model.generate(**inputs, **extra, max_new_tokens=10, pad_token_id=encoder.pad_token_id,
                                temperature=1.0, row_seeds=seeds, logprobs=0, on_step=keep)
        return tokens, torch.stack(scores, dim=1)

    once, once_logps = answers({k: v for k, v in batch.items() if k in INPUTS}, repeats=g)
    rows = {**{k: v for k, v in batch.items() if k in ("pixel_values", "image_grid_thw")}, **group_rows(batch, g)}
    side_by_side, their_logps = answers(rows)
    assert once.shape == (len(PROMPTS) * g, 10)
    assert torch.equal(once, side_by_side)
    assert torch.allclose(once_logps, their_logps, atol=1e-5, rtol=0)
    assert len({tuple(row.tolist()) for row in once[:g]}) > 1  # the copies sample apart
    with pytest.raises(ValueError, match="row_seeds has 9 entries for 3 answers"):
        model.generate(**{k: v for k, v in batch.items() if k in INPUTS}, max_new_tokens=2, temperature=1.0,
                       row_seeds=seeds)


@pytest.fixture(scope="module")
def with_videos(tmp_path_factory):
    """Prompts with a video, an image and a video, text only, and an image (Qwen3.5's frames as image-like spans)."""
    from mmadapt.synthetic import moving_square, write_video

    root = tmp_path_factory.mktemp("videos")
    write_video(root / "left.mp4", moving_square(8, 32, 48, direction=(0, -1), start=(8, 40)), fps=8)
    write_video(root / "down.mp4", moving_square(6, 48, 32, direction=(1, 0)), fps=6)
    Image.new("RGB", (64, 32), (200, 40, 90)).save(root / "0.png")
    records = [{"id": "video", "problem": "<video>Which way?", "answer": "left", "videos": ["left.mp4"]},
               {"id": "both", "problem": "<image><video>Same colour?", "answer": "no", "images": ["0.png"],
                "videos": ["down.mp4"]},
               {"id": "text", "problem": "Say a number.", "answer": "1"},
               {"id": "image", "problem": "<image>What colour?", "answer": "red", "images": ["0.png"]}]
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).eval()
    encoder = SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root), max_length=512,
                                      video={"fps": 4, "min_pixels": 16 * 16, "max_pixels": 8 * 64 * 64})
    prompts = PromptEncoder(encoder, completion_tokens=12)
    batch = Collator.for_model(model, encoder.pad_token_id)([prompts.encode(r, k).sample
                                                              for k, r in enumerate(records)])
    assert batch["videos_per_sample"].tolist() == [1, 1, 0, 0] and batch["images_per_sample"].tolist() == [0, 1, 0, 1]
    return model, encoder, {k: v for k, v in batch.items() if k not in ("labels", "meta")}


@pytest.mark.parametrize("g", [2, 4])
def test_videos_and_images_are_encoded_once_for_the_g_answers_and_score_as_separate_encodings(with_videos, g):
    """Images, videos and a text-only prompt in one batch: the rollout and the scored rows each run the vision side
    once over each picture (2 images, 2 videos), whatever G; the scored rows' log-probs and gradients equal rows that
    each encode their own pictures (<= 1e-6), and equal exactly those of the pictures encoded beforehand
    (`encode_prompts`, an RL step's one encoding)."""
    model, encoder, batch = with_videos
    seen, hook = encoded_pictures(model)
    try:
        done = rollout(model, processor_of(model, encoder), batch, g, Sampling(max_new_tokens=5, temperature=1.0),
                   generator=torch.Generator().manual_seed(5))
    finally:
        hook.remove()
    assert seen == {"calls": 1, "pictures": 4}
    shared = scored_rows(batch, done, encoder.pad_token_id)
    check_groups(shared, g, model.tokens.image_token_id)
    assert shared["video_index"].tolist() == [0] * g + [1] * g and shared["image_index"].tolist() == [0] * g + [1] * g
    check_shared_equals_separate_and_handed(model, batch, shared, done, pictures=4)  # once each, for 4 x G rows
    swapped = {**shared, "video_index": shared["video_index"].clone()}
    swapped["video_index"][1] = 1  # group 0's second row shows prompt 1's video
    with pytest.raises(ImageTokenContractError, match="group 0: its rows show different videos"):
        check_groups(swapped, g, model.tokens.image_token_id)


def test_a_rollout_with_qwens_real_tokenizer_ends_at_its_end_of_turn_and_keeps_the_contract(tmp_path):
    """Qwen3's 151k-token tokenizer with Qwen3.5's chat template: the prompts end with the template's generation
    prompt (its opened thinking block), the answers end at `<|im_end|>` (the template's end of turn, an end token
    beside the tokenizer's EOS) and decode to text without special tokens; the sampled answers' own log-probs equal
    the training forward's over the 151k vocabulary (5e-4: float rounding of the log-softmax, 1e-4 measured); a
    batch mixing trl's `solution` and EasyR1's `answer` records is scored row by row."""
    from real_tokenizers import real_tokenizer

    from mmadapt.train.objectives.grpo.view import AnswerScorer
    from mmadapt.train.rewards import reward_specs

    Image.new("RGB", (64, 32), (200, 40, 90)).save(tmp_path / "0.png")
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).eval()
    tokenizer = real_tokenizer("qwen3")
    encoder = SampleEncoder.for_model(model, tokenizer, chat_template="qwen3_5", image_root=str(tmp_path),
                                      max_length=256)
    prompts = PromptEncoder(encoder, completion_tokens=8)
    records = [{"id": "a", "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                    "text": "How many?"}]}],
                "image": "0.png", "solution": "4"},
               {"id": "b", "problem": "What is 2 + 2?", "answer": "4"}]
    encoded = [prompts.encode(r, k) for k, r in enumerate(records)]
    # the template's own generation prompt: Qwen3.5 opens the thinking block for the answer
    assert all(tokenizer.decode(e.sample.input_ids).endswith("<|im_start|>assistant\n<think>\n") for e in encoded)
    from mmadapt.data.prompts import PromptCollator

    batch = PromptCollator(Collator.for_model(model, encoder.pad_token_id))(encoded)
    batch = {k: v for k, v in batch.items() if k not in ("labels", "meta")}
    scorer = AnswerScorer.for_encoder(encoder, reward_specs(["accuracy"]), max_new_tokens=8)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in scorer.eos_token_ids
    done = rollout(model, scorer.processor, batch, 3, Sampling(max_new_tokens=8, temperature=1.0),
                   generator=torch.Generator().manual_seed(7))
    rows = scored_rows(batch, done, scorer.pad_token_id)
    check_groups(rows, 3, model.tokens.image_token_id)
    with torch.no_grad():
        forward = completion_logps(model(**rows, head=TokenLogps()).logps, rows["labels"], done)
    # fp32 log-softmax over 151k logits summed in another order (the prefill's last position against the chunked
    # forward): up to 1e-4 apart measured (|log p| ~ 12), bounded at 5e-4
    assert (forward - done.logps).abs()[done.mask].max() <= 5e-4
    assert model.backbone.get_output_embeddings().weight.shape[0] >= 151_000

    head = model.backbone.get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, output: output.index_add(
        -1, torch.tensor([end]), torch.full((*output.shape[:-1], 1), 1e4)))
    try:  # a head that ends every answer at once
        ended = rollout(model, scorer.processor, batch, 3, Sampling(max_new_tokens=8, temperature=1.0),
                        generator=torch.Generator().manual_seed(8))
    finally:
        hook.remove()
    assert ended.lengths.tolist() == [1] * 6 and not ended.truncated.any()
    assert scorer.texts(ended) == [""] * 6
    assert scorer.score(scorer.texts(ended), batch, 3).total == [0.0] * 6


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32 weights", "bf16 weights"])
def test_the_rollout_cache_keeps_gated_deltanet_states_as_transformers_does_under_bf16_autocast(setup, weights):
    """A bf16 recurrent state would be rounded after every token (RL runs elsewhere answered gibberish). Under bf16
    autocast (the bf16 policy's rollouts; and with bf16 weights, as FSDP2's mixed precision gathers them) Qwen3.5's
    Gated DeltaNet cache holds its recurrent states in fp32 through the prefill, the G-way copy (`repeated`:
    `reorder_cache`) and every decoding step, as transformers' reference keeps them (its torch rule computes in
    fp32); the conv state holds the conv's last inputs in their own dtype (bf16 under autocast: the projection's
    outputs themselves, nothing rounded)."""
    import copy

    from mmadapt.train.objectives.rollout import INPUTS

    model, encoder, batch = setup
    model = copy.deepcopy(model).to(weights)
    seen = []

    def states(module, args, kwargs, output):  # each backbone call's cache: (rows, recurrent dtypes, conv dtypes)
        layers = [layer for layer in output.cache.layers if hasattr(layer, "recurrent_states")]
        seen.append((output.logits.shape[0], {layer.recurrent_states[0].dtype for layer in layers},
                     {layer.conv_states[0].dtype for layer in layers}, len(layers)))

    inputs = model.backbone.model.layers[0].linear_attn.in_proj_qkv
    projected = []
    handles = [model.backbone.register_forward_hook(states, with_kwargs=True),
               inputs.register_forward_hook(lambda m, a, out: projected.append(out.dtype))]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rollout(model, processor_of(model, encoder), {k: v for k, v in batch.items() if k in INPUTS}, 3,
                    Sampling(max_new_tokens=4, temperature=1.0), generator=torch.Generator().manual_seed(0))
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == 4 and seen[0][0] == 3 and all(rows == 9 for rows, *_ in seen[1:])  # prefill, then 3 x G
    assert set(projected) == {torch.bfloat16}
    for _, recurrent, conv, layers in seen:
        assert layers == 3 and recurrent == {torch.float32} and conv == {torch.bfloat16}, seen


# ---- one way to answer: the rollout's end ids, sampling and decoding are answering's --------------------------------
@pytest.fixture(scope="module")
def qwen_real(tmp_path_factory):
    """A tiny Qwen3.5 model with Qwen3's real tokenizer and Qwen3.5's template, a batch of two prompts (one with an
    image) and the GRPO scorer over them (`AnswerScorer`: answering's processor)."""
    from real_tokenizers import real_tokenizer

    from mmadapt.data.prompts import PromptCollator
    from mmadapt.train.objectives.grpo.view import AnswerScorer
    from mmadapt.train.rewards import reward_specs

    root = tmp_path_factory.mktemp("qwen-real")
    Image.new("RGB", (64, 32), (200, 40, 90)).save(root / "0.png")
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).eval()
    encoder = SampleEncoder.for_model(model, real_tokenizer("qwen3"), chat_template="qwen3_5", image_root=str(root),
                                      max_length=256)
    prompts = PromptEncoder(encoder, completion_tokens=16)
    records = [{"id": "a", "problem": "<image>How many?", "image": "0.png", "answer": "4"},
               {"id": "b", "problem": "What is 2 + 2?", "answer": "4"}]
    collate = PromptCollator(Collator.for_model(model, encoder.pad_token_id))
    batch = collate([prompts.encode(r, k) for k, r in enumerate(records)])
    scorer = AnswerScorer.for_encoder(encoder, reward_specs(["accuracy"]), 16,
                                      collator=Collator.for_model(model, encoder.pad_token_id))
    return model, encoder, batch, scorer


def forcing(model, script):
    """A hook on the head making `script[k]` by far the likeliest token of the k-th call (the prefill, then each
    decoding step), for every row."""
    calls = [0]

    def force(module, args, output):
        token = script[min(calls[0], len(script) - 1)]
        calls[0] += 1
        return output.index_add(-1, torch.tensor([token]), torch.full((*output.shape[:-1], 1), 1e4))

    return model.backbone.get_output_embeddings().register_forward_hook(force)


@pytest.mark.parametrize("end", ["<|im_end|>", None], ids=["ended", "cut at max_new_tokens"])
def test_a_rollouts_texts_are_what_answering_returns_for_the_same_ids(qwen_real, end):
    """The same ids (forced by the head: a llama emoji and 你好 split across byte-level BPE tokens, then the end of
    turn and tokens after it) through the rollout (G = 2, sampled) and through `answer_prompts` (greedy, the one
    way a model answers): the same ids up to the end, the same end cut (`Answer.content_ids`), and the same text -
    special tokens removed, the split characters whole, nothing after the end."""
    from mmadapt.answering import PromptInputs, answer_prompts
    from mmadapt.train.objectives.rollout import INPUTS

    model, encoder, batch, scorer = qwen_real
    tokenizer = encoder.tokenizer
    words = tokenizer.encode("The llama 🦙 says 你好", add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in words)  # a character split across tokens
    after = tokenizer.encode(" and more", add_special_tokens=False)
    script = words + ([tokenizer.convert_tokens_to_ids(end)] if end else []) + after
    length = len(words) + (4 if end else 0)  # room after the end; else cut inside the words' tail
    hook = forcing(model, script)
    try:
        done = rollout(model, scorer.processor, batch, 2, Sampling(max_new_tokens=length, temperature=1.0),
                       generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    hook = forcing(model, script)
    try:
        prompt = PromptInputs.of(model, scorer.processor, {k: v for k, v in batch.items() if k in INPUTS})
        answers = answer_prompts(model, scorer.processor, prompt, sampling=Sampling(max_new_tokens=length))
    finally:
        hook.remove()
    expected = "The llama 🦙 says 你好" if end else tokenizer.decode(script[:length]).strip()
    assert scorer.texts(done) == [a.text for a in answers for _ in range(2)] == [expected] * 4
    assert [a.finish_reason for a in answers] == ["stop" if end else "length"] * 2
    for r, answer in enumerate(a for a in answers for _ in range(2)):
        assert done.completions[r][done.mask[r]].tolist() == list(answer.token_ids)
        assert done.truncated[r].item() == (answer.end_token is None)
        assert list(answer.content_ids) == script[:len(words)] if end else list(answer.content_ids) == script[:length]


def test_the_evals_greedy_answers_are_answerings_and_score_as_a_greedy_rollouts(qwen_real):
    """`AnswerScorer.greedy` (the GRPO evals', `mmadapt sees`) answers through `answer_prompts`; its rewards equal
    those of a greedy rollout's texts (one answer per prompt, temperature 0): the path changed, not the answers."""
    model, encoder, batch, scorer = qwen_real
    script = encoder.tokenizer.encode("4<|im_end|>", add_special_tokens=False)
    hook = forcing(model, script)
    try:
        totals = scorer.greedy(model, batch)
    finally:
        hook.remove()
    hook = forcing(model, script)
    try:
        done = rollout(model, scorer.processor, batch, 1, scorer.sampling)
    finally:
        hook.remove()
    assert scorer.sampling.temperature == 0 and totals == [1.0, 1.0]
    assert scorer.score(scorer.texts(done), batch).total == totals
    from mmadapt.answering import PromptInputs, answer_prompts  # the model's own greedy answers, unforced
    from mmadapt.train.objectives.rollout import INPUTS

    prompt = PromptInputs.of(model, scorer.processor, {k: v for k, v in batch.items() if k in INPUTS})
    free = [a.text for a in answer_prompts(model, scorer.processor, prompt, sampling=scorer.sampling)]
    assert free == scorer.texts(rollout(model, scorer.processor, batch, 1, scorer.sampling)) and any(free)


@pytest.mark.parametrize("name, template, end, pad", [("qwen3", "qwen3_5", ["<|im_end|>"], "<|endoftext|>"),
                                                      ("llama2", None, ["</s>"], "</s>")])
def test_the_rollout_ends_and_pads_with_answerings_ids_on_real_tokenizers(name, template, end, pad):
    """One source of end and pad ids: the GRPO scorer's, the rollout's (`generate_settings`) and answering's
    (`Processor.for_model`, what chat / serve / eval use) are one list. Qwen3's tokenizer: its EOS is the template's
    end of turn `<|im_end|>` and its pad `<|endoftext|>`; Llama 2's: `</s>` (the vicuna template's end of turn), also
    its pad (it has none of its own)."""
    from real_tokenizers import real_tokenizer

    from mmadapt.answering import generate_settings
    from mmadapt.train.objectives.grpo.view import AnswerScorer
    from mmadapt.train.rewards import reward_specs

    model = mmadapt.build_model(*(QWEN if template else ("clip", "mlp2x_gelu", "llama")))
    kw = {"chat_template": template} if template else {}
    answering = Processor.for_model(model, real_tokenizer(name), **kw)
    encoder = SampleEncoder.for_model(model, real_tokenizer(name), **kw)
    scorer = AnswerScorer.for_encoder(encoder, reward_specs(["accuracy"]), 8)
    ids = encoder.tokenizer.convert_tokens_to_ids(end)
    settings = generate_settings(scorer.processor, Sampling(max_new_tokens=8, temperature=1.0))
    assert scorer.eos_token_ids == answering.eos_token_ids == settings["eos_token_id"] == ids
    assert scorer.pad_token_id == answering.encoder.pad_token_id == settings["pad_token_id"] == \
        encoder.tokenizer.convert_tokens_to_ids(pad)


@pytest.mark.parametrize("setting, words", [({"repetition_penalty": 1.2}, "repetition_penalty 1.2"),
                                            ({"stop": ("\n",)}, "stop strings"), ({"logprobs": 2}, "logprobs 2")])
def test_a_rollout_refuses_sampling_the_training_forward_would_not_score(setup, setting, words):
    model, encoder, batch = setup
    with pytest.raises(ValueError, match=f"a rollout cannot sample with {words}"):
        rollout(model, processor_of(model, encoder), batch, 2, Sampling(max_new_tokens=2, temperature=1.0, **setting))
