"""Video in the model: Qwen3.5, Qwen3-VL and their MoE variants encode videos as transformers does.

Parity (fp32, <= 1e-5) with `Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`,
`Qwen3VLForConditionalGeneration` and `Qwen3VLMoeForConditionalGeneration` on the same weights for a batch of two
videos of different lengths and sizes plus an image (right padding, int64 mask), including M-RoPE positions equal
to `get_rope_index` for mixed image + video samples; greedy generation with a video equals `generate`; the video
contract (frame spans per sample, span lengths, token types, pixels without tokens and the reverse; fixed-size
encoders and backbones without a video token refuse video); packing with videos equals padding and isolates.
"""

from __future__ import annotations

import pytest
import torch

import mmadapt
from mmadapt import ImageTokenContractError, VisionBatch, VisionLanguageModel
from mmadapt.backbones import BACKBONES
from mmadapt.contract import check_batch, locate
from mmadapt.data import Collator
from mmadapt.encoders import ENCODERS
from mmadapt.synthetic import synthetic_batch, synthetic_video_batch, synthetic_video_samples

ATOL = 1e-5
SPAN_IDS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=248, vision_end_token_id=249)
FAMILIES = {  # backbone: (encoder, transformers config class, transformers model class)
    "qwen3_5": ("qwen3_5_vit", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("qwen3_5_vit", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_vl": ("qwen3_vl_vit", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": ("qwen3_vl_vit", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
}
# two videos of different lengths (4 and 6 frames: 2 and 3 temporal patches) and sizes, plus an image
LAYOUT = (("video", "image"), ("video",))
SHAPES = dict(video_shapes=((4, 32, 48), (6, 48, 32)), image_sides=((32, 32),), text_lengths=(9, 5))


def spread_routers(model: torch.nn.Module) -> None:
    with torch.no_grad():  # routers that prefer different experts for different tokens (initialised to zeros)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    import transformers

    encoder, config_class, model_class = FAMILIES[request.param]
    text = {k: v for k, v in BACKBONES.get(request.param).options("tiny").items() if not k.endswith("token_id")}
    vision = {k: v for k, v in ENCODERS.get(encoder).options("tiny").items() if not k.endswith("_pixels")}
    config = getattr(transformers, config_class)(
        text_config=text, vision_config={**vision, "out_hidden_size": text["hidden_size"]}, **SPAN_IDS)
    torch.manual_seed(0)
    theirs = getattr(transformers, model_class)(config)
    spread_routers(theirs)
    path = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(path)
    return VisionLanguageModel.from_pretrained(path).eval(), theirs.eval()


def hf_inputs(batch: dict, model: VisionLanguageModel) -> dict:
    inputs = {k: v for k, v in batch.items() if k not in ("images_per_sample", "videos_per_sample")}
    inputs["attention_mask"] = batch["attention_mask"].long()  # transformers' int64 mask
    ids = batch["input_ids"]
    inputs["mm_token_type_ids"] = (ids == model.tokens.image_token_id).int() + 2 * (
        ids == model.tokens.video_token_id).int()
    return inputs


def test_logits_loss_and_positions_equal_transformers_for_two_videos_and_an_image(pair):
    ours, theirs = pair
    batch = synthetic_video_batch(ours, LAYOUT, **SHAPES)
    mask = batch["attention_mask"]
    assert mask.sum(1).tolist()[1] != mask.shape[1]  # really padded
    inputs = hf_inputs(batch, ours)
    with torch.no_grad():
        got, expected = ours(**batch), theirs(**inputs)
        assert (got.logits - expected.logits)[mask].abs().max() <= ATOL
        assert abs(got.loss.item() - expected.loss.item()) <= ATOL
        positions, _ = theirs.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   image_grid_thw=batch["image_grid_thw"],
                                                   video_grid_thw=batch["video_grid_thw"],
                                                   attention_mask=inputs["attention_mask"])
        prepared = ours.prepare(VisionBatch.of({k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values",
                                                                      "image_grid_thw", "pixel_values_videos",
                                                                      "video_grid_thw")}))
        assert torch.equal(prepared.position_ids[:, mask], positions[:, mask])
        # the frames matter: the same batch with one video's frames in another order answers otherwise
        swapped = dict(batch)
        rows = batch["video_grid_thw"][0].prod().item() // 2
        pixels = batch["pixel_values_videos"].clone()
        pixels[:rows], pixels[rows : 2 * rows] = batch["pixel_values_videos"][rows : 2 * rows], \
            batch["pixel_values_videos"][:rows]
        swapped["pixel_values_videos"] = pixels
        assert (ours(**swapped).logits - got.logits)[0][mask[0]].abs().max() > 1e-4


def test_greedy_generation_with_a_video_equals_transformers_generate(pair):
    ours, theirs = pair
    batch = synthetic_video_batch(ours, (("image", "video"),), video_shapes=((4, 48, 32),), image_sides=(32,),
                                  text_lengths=(7,), seed=5)
    inputs = {k: v for k, v in hf_inputs(batch, ours).items() if k != "labels"}
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = theirs.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = ours.generate(batch["input_ids"], batch["attention_mask"], batch["pixel_values"],
                            batch["image_grid_thw"], max_new_tokens=8, pixel_values_videos=batch["pixel_values_videos"],
                            video_grid_thw=batch["video_grid_thw"], videos_per_sample=batch["videos_per_sample"])
    assert torch.equal(got, expected[:, batch["input_ids"].shape[1]:])


def qwen(backbone: str = "qwen3_5") -> VisionLanguageModel:
    torch.manual_seed(0)
    encoder = "qwen3_vl_vit" if backbone.startswith("qwen3_vl") else "qwen3_5_vit"
    return mmadapt.build_model(encoder, "qwen_merger", backbone).eval()


def test_the_video_contract_names_the_sample_and_the_fix():
    model = qwen()
    batch = synthetic_video_batch(model, LAYOUT, **SHAPES)
    # one frame span of sample 1 lost (its tokens turned to text): frames and spans disagree
    cut = {**batch, "input_ids": batch["input_ids"].clone()}
    spans = locate(batch["input_ids"], model.tokens.video_token_id)
    last = int((spans.sample == 1).nonzero()[-1])
    start, length = int(spans.start[last]), int(spans.length[last])
    cut["input_ids"][1, start : start + length] = 7
    with pytest.raises(ImageTokenContractError, match=r"sample 1: expected 3 video frame span\(s\), found 2"):
        model(**cut)
    # videos credited to the wrong sample
    with pytest.raises(ImageTokenContractError, match=r"sample 0: expected 5 video frame span"):
        model(**{**batch, "videos_per_sample": torch.tensor([2, 0])})
    # video tokens with no video pixels, and video pixels with no video tokens
    no_pixels = {k: v for k, v in batch.items() if k not in ("pixel_values_videos", "video_grid_thw")}
    with pytest.raises(ImageTokenContractError, match=r"sample 0: 2 video frame span\(s\) but no video frames"):
        model(**no_pixels)
    with pytest.raises(ImageTokenContractError, match="video placeholder token"):
        model.prepare(VisionBatch(no_pixels["input_ids"], no_pixels["attention_mask"]), check=False)
    no_tokens = synthetic_batch(model, (1, 0))
    with pytest.raises(ImageTokenContractError, match="no video frame placeholder tokens"):
        model(**no_tokens, pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"])
    # a frame span one token longer than its frame's tokens (its <|vision_end|> overwritten)
    longer = {**batch, "input_ids": batch["input_ids"].clone()}
    longer["input_ids"][0, int(spans.start[0] + spans.length[0])] = model.tokens.video_token_id
    with pytest.raises(ImageTokenContractError, match=r"sample 0: video frame span at position \d+ has 7 tokens, but "
                                                      r"video frame 0 yields 6"):
        model(**longer)
    # token types: transformers' 2 at video positions, 1 at image positions
    types = hf_inputs(batch, model)["mm_token_type_ids"]
    model(**batch, mm_token_type_ids=types)
    with pytest.raises(ImageTokenContractError, match=r"mm_token_type_ids\[0, \d+\] = 1"):
        model(**batch, mm_token_type_ids=(types > 0).int())
    report = check_batch(model, cut)
    assert not report.ok and "found 2" in report.error


def test_fixed_size_encoders_and_backbones_without_a_video_token_refuse_video():
    video = synthetic_video_batch(qwen(), (("video",),), video_shapes=((2, 32, 32),), image_sides=())
    clip = mmadapt.build_model("clip", "mlp2x_gelu", "qwen3_5").eval()
    batch = synthetic_batch(clip, (1,))
    with pytest.raises(ImageTokenContractError, match="encodes fixed-size images and takes no video"):
        clip(**batch, pixel_values_videos=video["pixel_values_videos"], video_grid_thw=video["video_grid_thw"])
    llama = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "llama").eval()
    assert llama.tokens.video_token_id is None
    batch = synthetic_batch(llama, (1,))
    with pytest.raises(ImageTokenContractError, match="no video placeholder token"):
        llama(**batch, pixel_values_videos=video["pixel_values_videos"], video_grid_thw=video["video_grid_thw"])


@pytest.mark.parametrize("backbone", ["qwen3_5", "qwen3_vl"])
def test_packed_videos_equal_padded_and_samples_stay_isolated(backbone):
    model = qwen(backbone)
    layout = (("video", "image"), (), ("video",), ("image",))
    kwargs = dict(video_shapes=((4, 32, 48), (2, 48, 32)), image_sides=(32, (32, 48)), text_lengths=(9, 14, 5, 3))
    samples = synthetic_video_samples(model, layout, **kwargs)
    pad, pack = Collator.for_model(model, 0), Collator.for_model(model, 0, max_tokens=max(map(len, samples)) + 40)
    packed_batch, padded_batch = pack(samples), pad(samples)
    assert packed_batch["input_ids"].shape[0] < len(samples)
    assert padded_batch["videos_per_sample"].tolist() == [1, 0, 1, 0]
    assert int((padded_batch["mm_token_type_ids"] == 2).sum()) == sum(s.tokens_per_video[0] for s in samples
                                                                       if s.num_videos)

    def per_sample(batch):
        logits, out = model(**batch).logits, {}
        cu = batch.get("cu_seqlens")
        for r, ids in enumerate(batch["meta"]["sample_ids"]):
            if cu is None:
                out[ids[0]] = logits[r, : int(batch["attention_mask"][r].sum())]
                continue
            width = batch["input_ids"].shape[1]
            bounds = [int(c) - r * width for c in cu if r * width <= int(c) <= (r + 1) * width]
            for sample_id, a, b in zip(ids, bounds, bounds[1:], strict=False):
                out[sample_id] = logits[r, a:b]
        return out

    with torch.no_grad():
        padded, packed = per_sample(padded_batch), per_sample(packed_batch)
        for sample_id, logits in padded.items():
            torch.testing.assert_close(packed[sample_id], logits, rtol=0, atol=1e-5)
        changed = synthetic_video_samples(model, layout, **kwargs)
        changed[0].pixel_values_videos = torch.randn_like(changed[0].pixel_values_videos)  # another video
        after = per_sample(pack(changed))
    for sample_id, logits in packed.items():
        diff = (after[sample_id] - logits).abs().max()
        assert diff > 1e-4 if sample_id == "sample-0" else diff <= 1e-6, (sample_id, diff)


def test_a_training_step_with_video_reaches_the_encoder():
    model = qwen().train()
    batch = synthetic_video_batch(model, LAYOUT, **SHAPES)
    loss = model(**batch).loss
    loss.backward()
    grad = model.encoder.tower.blocks[0].attn.qkv.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_a_batch_from_transformers_own_qwen3vl_processor_gives_transformers_logits(tmp_path):
    """The user's path: two short videos and an image through transformers' `Qwen3VLProcessor` (real Qwen tokenizer,
    per-frame timestamps in the text), into `from_pretrained(<a Qwen3-VL directory>)`: the same logits as
    `Qwen3VLForConditionalGeneration` - the frames reach the LLM (before video was modelled they were dropped and the
    logits differed by ~1)."""
    import numpy as np
    import transformers
    from real_tokenizers import real_tokenizer
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    tokenizer = real_tokenizer("qwen3")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = {**{k: v for k, v in BACKBONES.get("qwen3_vl").options("tiny").items() if not k.endswith("token_id")},
            "vocab_size": len(tokenizer)}
    vision = {k: v for k, v in ENCODERS.get("qwen3_vl_vit").options("tiny").items() if not k.endswith("_pixels")}
    torch.manual_seed(0)
    theirs = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        text_config=text, vision_config={**vision, "out_hidden_size": 64}, **ids)).eval()
    theirs.save_pretrained(tmp_path)
    ours = VisionLanguageModel.from_pretrained(tmp_path).eval()
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=8, merge_size=2, min_pixels=256, max_pixels=64 * 64),
        video_processor=Qwen3VLVideoProcessor(patch_size=8, merge_size=2, size={"shortest_edge": 256,
                                                                                "longest_edge": 8 * 48 * 48},
                                              cap_pixels_per_frame=False),
        tokenizer=tokenizer, chat_template="")
    rng = np.random.default_rng(0)
    videos = [rng.integers(0, 255, (4, 32, 48, 3), dtype=np.uint8), rng.integers(0, 255, (6, 48, 32, 3),
                                                                                  dtype=np.uint8)]
    metadata = [VideoMetadata(total_num_frames=len(v), fps=4.0, frames_indices=list(range(len(v)))) for v in videos]
    image = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
    video, picture = "<|vision_start|><|video_pad|><|vision_end|>", "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [f"<|im_start|>user\n{video}{picture}What moves?<|im_end|>\n",
               f"<|im_start|>user\n{video}And here?<|im_end|>\n<|im_start|>assistant\nleft"]
    batch = processor(text=prompts, images=[image], videos=videos, video_metadata=metadata, do_sample_frames=False,
                      padding=True, return_tensors="pt")
    assert "<0.1 seconds>" in tokenizer.decode(batch["input_ids"][0])  # the per-frame timestamps are in the text
    inputs = dict(batch)
    with torch.no_grad():
        expected = theirs(**inputs).logits
        got = ours(**inputs).logits
    mask = batch["attention_mask"].bool()
    assert (got - expected)[mask].abs().max() <= ATOL


def test_check_batch_reports_videos_and_their_frame_spans():
    model = qwen()
    report = check_batch(model, synthetic_video_batch(model, LAYOUT, **SHAPES))
    assert report.ok and [r["videos"] for r in report.rows] == [1, 1] and [r["spans"] for r in report.rows] == [3, 3]
    assert "videos" in str(report).splitlines()[0]
