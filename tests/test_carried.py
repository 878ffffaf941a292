"""The starting checkpoint's weights of no part (Qwen3.5's `mtp.*`) are carried into every save, bit for bit.

A tiny Qwen3.5 checkpoint saved by transformers gets a multi-token-prediction head named as the hub's checkpoints name
it (`mtp.fc`, `mtp.layers.0.*` a full-attention decoder layer, `mtp.norm`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`; `text_config.mtp_num_hidden_layers`), in bf16 beside the model's fp32. Exact comparisons
only: every carried tensor equal (`torch.equal`) and of the same dtype.
"""

import json
import shutil

import pytest
import torch
from conftest import tiny_options
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mmadapt
from mmadapt import VisionLanguageModel
from mmadapt.backbones import BACKBONES
from mmadapt.carried import CARRIED_FILE, RANDOM_INIT, CarriedWeightsError
from mmadapt.data import Collator
from mmadapt.encoders import ENCODERS
from mmadapt.processor import export_processor
from mmadapt.synthetic import synthetic_samples
from mmadapt.train import RunConfig, Trainer
from mmadapt.train.export import export


def mtp_head(text: dict) -> dict[str, torch.Tensor]:
    """The tensors of a Qwen3.5 MTP head for text config `text`, as the hub's checkpoints name them (bf16)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    config = Qwen3_5TextConfig(**text)
    layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))
    hidden = config.hidden_size
    head = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    head["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)  # fuses [embedding, hidden state] back to hidden
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        head[f"mtp.{norm}.weight"] = torch.randn(hidden)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in head.items()}


def qwen_with_mtp(path, *, sharded: bool = False) -> dict[str, torch.Tensor]:
    """A tiny Qwen3.5 checkpoint in `path` with an MTP head (sharded: its head in a shard of its own, listed in the
    index, as the hub ships large checkpoints); returns the head."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    text = {**tiny_options(BACKBONES, "qwen3_5"), "mtp_num_hidden_layers": 1}
    vision = {**ENCODERS.get("qwen3_5_vit").options("tiny"), "out_hidden_size": text["hidden_size"]}
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                           vision_start_token_id=248, vision_end_token_id=249)
    head = mtp_head(text)
    if not sharded:
        Qwen3_5ForConditionalGeneration(config).save_pretrained(path)
        save_file({**load_file(path / "model.safetensors"), **head}, path / "model.safetensors", {"format": "pt"})
        return head
    Qwen3_5ForConditionalGeneration(config).save_pretrained(path, max_shard_size="200KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    save_file(head, path / "mtp.safetensors", {"format": "pt"})
    index["weight_map"] |= dict.fromkeys(head, "mtp.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return head


def exported_tensors(path) -> dict[str, tuple[torch.Tensor, str]]:
    """Every tensor of a sharded transformers export, read through its index: {name: (tensor, file)}; checks that the
    index and the files agree both ways."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in path.glob("*.safetensors"))  # no file left out of the index, none missing
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    found = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as reader:
            found |= {key: (reader.get_tensor(key), file) for key in reader.keys()}
    assert {k: f for k, (_, f) in found.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t, _ in found.values())
    return found


def assert_carried(head: dict[str, torch.Tensor], tensors: dict) -> None:
    for name, expected in head.items():
        got = tensors[name][0] if isinstance(tensors[name], tuple) else tensors[name]
        assert got.dtype == expected.dtype and torch.equal(got, expected), name


def test_an_export_of_a_trained_run_holds_the_starting_checkpoints_mtp_weights_bit_for_bit(tmp_path, monkeypatch):
    """Start from a Qwen3.5 checkpoint with `mtp.*`, train a step, delete the starting checkpoint (a cleared hub
    cache), export the run in transformers' format: the export holds every `mtp.*` tensor as the checkpoint stored it,
    its record says so, and transformers loads it with no missing or unexpected key (it ignores `mtp.*`)."""
    from transformers import AutoModelForImageTextToText

    source = tmp_path / "hub"
    source.mkdir()
    head = qwen_with_mtp(source)
    model = VisionLanguageModel.from_pretrained(source)
    assert model.carried.names == tuple(sorted(head))  # computed from what the parts read, not from a prefix
    run = tmp_path / "run"
    config = RunConfig.load(None, [f"train.out={run}", "train.progress=false", "train.steps=1", "stages.encoder=full",
                                  "data.batch_size=2"])
    samples = synthetic_samples(model, [1, 0, 1, 1], text_lengths=[5, 6, 7, 8], seed=0)
    monkeypatch.setattr("mmadapt.train.trainer.plot_history", lambda *_: None)  # the loss plot: not tested here
    Trainer(model, config, samples, Collator.for_model(model, 0)).fit()
    assert_carried(head, load_file(next((run / "checkpoints").iterdir()) / CARRIED_FILE))  # the checkpoint's own copy
    assert_carried(head, load_file(run / "model" / CARRIED_FILE))  # and OUT/model's
    shutil.rmtree(source)

    target = export(run, tmp_path / "hf", format="transformers")
    assert_carried(head, exported_tensors(target))
    record = json.loads((target / "mmadapt_export.json").read_text())
    assert record["carried"]["from"] == str(source) and record["carried"]["tensors"] == len(head)
    assert record["carried"]["prefixes"] == {"mtp": len(head)}
    assert any(note.startswith(f"carried {len(head)} tensors from the starting checkpoint {source} unchanged")
               and "mtp.* (15)" in note for note in record["notes"])
    assert json.loads((target / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    hf, info = AutoModelForImageTextToText.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    trained = VisionLanguageModel.from_pretrained(run / "model").state_dict()  # the export is the trained model
    assert torch.equal(hf.state_dict()["lm_head.weight"], trained["backbone.lm_head.weight"])


def test_a_sharded_source_and_a_sharded_export_keep_names_dtypes_bytes_and_the_index(tmp_path):
    """A sharded starting checkpoint (its head in a shard of its own, and a stale buffer under the language model's
    prefix, which is the backbone's and not carried); the export sharded at 100 KB, then read back and exported again:
    the index lists every tensor in its file, and the head is unchanged each time."""
    head = qwen_with_mtp(tmp_path / "hub", sharded=True)
    save_file({"model.language_model.rotary_emb.inv_freq": torch.ones(4)}, tmp_path / "hub" / "stale.safetensors")
    index = json.loads((tmp_path / "hub" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.language_model.rotary_emb.inv_freq"] = "stale.safetensors"
    (tmp_path / "hub" / "model.safetensors.index.json").write_text(json.dumps(index))
    model = VisionLanguageModel.from_pretrained(tmp_path / "hub")
    assert set(model.carried.names) == set(head)
    model.save_pretrained(tmp_path / "hf", format="transformers", max_shard_size="100KB",
                          processor_export=export_processor)
    first = exported_tensors(tmp_path / "hf")
    assert_carried(head, first)
    assert not any(file in {first[k][1] for k in head} for k, (_, file) in first.items() if k not in head)  # own shards
    again = VisionLanguageModel.from_pretrained(tmp_path / "hf")
    again.save_pretrained(tmp_path / "hf-again", format="transformers", processor_export=export_processor)
    assert_carried(head, exported_tensors(tmp_path / "hf-again"))


def test_mmadapt_format_keeps_them_beside_the_weights_and_reads_them_back(tmp_path):
    head = qwen_with_mtp(tmp_path / "hub")
    VisionLanguageModel.from_pretrained(tmp_path / "hub").save_pretrained(tmp_path / "mine")
    assert_carried(head, load_file(tmp_path / "mine" / CARRIED_FILE))
    saved = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert saved["carried"]["tensors"] == len(head) and saved["carried"]["from"] == str(tmp_path / "hub")
    assert not set(head) & set(load_file(tmp_path / "mine" / "model.safetensors"))  # never the model's weights
    again = VisionLanguageModel.from_pretrained(tmp_path / "mine")
    assert again.carried.names == tuple(sorted(head)) and again.carried.origin == str(tmp_path / "hub")


def test_a_starting_checkpoint_changed_after_the_start_is_an_error_not_a_silent_change(tmp_path):
    head = qwen_with_mtp(tmp_path / "hub")
    model = VisionLanguageModel.from_pretrained(tmp_path / "hub")
    weights = tmp_path / "hub" / "model.safetensors"
    save_file({**load_file(weights), "mtp.fc.weight": torch.zeros_like(head["mtp.fc.weight"])}, weights)
    with pytest.raises(CarriedWeightsError, match=r"carried from .*hub are read from .*hub when the model is saved, "
                                                  r"but its files changed since the model was read.*Fix: restore"):
        model.save_pretrained(tmp_path / "hf", format="transformers", processor_export=export_processor)
    assert not (tmp_path / "hf").exists()  # nothing written


@pytest.mark.parametrize("start", ["presets", "no_mtp", "mixed"])
def test_a_model_that_started_from_no_such_checkpoint_says_it_carries_none(start, hf_qwen_dir, tmp_path):
    part = {"name": "qwen3_5", "pretrained": str(hf_qwen_dir)}
    model = {"presets": lambda: mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5"),
             "no_mtp": lambda: VisionLanguageModel.from_pretrained(hf_qwen_dir),
             "mixed": lambda: mmadapt.build_model("qwen3_5_vit", "qwen_merger", part)}[start]()
    expected = {"presets": RANDOM_INIT,
                "no_mtp": f"the starting checkpoint {hf_qwen_dir} had no weights outside the model",
                "mixed": f"its parts did not all start from one checkpoint (encoder random init, projector random "
                         f"init, backbone {hf_qwen_dir}): it carries none"}[start]
    model.save_pretrained(tmp_path / "hf", format="transformers", processor_export=export_processor)
    record = json.loads((tmp_path / "hf" / "mmadapt_export.json").read_text())
    assert record["carried"]["tensors"] == 0 and record["carried"]["note"].startswith(expected)
    assert any(note.startswith(expected) for note in record["notes"])
    assert {p.name for p in (tmp_path / "hf").glob("*.safetensors")} == {"model.safetensors"}  # as before: one file
    model.save_pretrained(tmp_path / "mine")  # mmadapt's format: no file, the reason kept
    assert not (tmp_path / "mine" / CARRIED_FILE).exists()
    assert VisionLanguageModel.from_pretrained(tmp_path / "mine").carried.why.startswith(expected)
