"""QLoRA (`stages.backbone: qlora`): the backbone's large linear layers stored in NF4 (torchao), LoRA trained on top,
checkpoints without the 4-bit weights, and what the run leaves merged into the source's full-precision weights.

Tiny models (CPU, fp32): their linear layers have 4,096-16,384 weights, so `quantization.scaler_block_size` is 8
(blocks of 64 x 8 = 512 weights) instead of QLoRA's 256. Tolerances: an NF4 layer's output equals `F.linear` over
torchao's own dequantisation within 1e-6, and differs from the full-precision output by no more than that
dequantisation error carried through the layer (|x| @ |W - deq(W)|^T, elementwise); resume, bitwise; the exported
weights equal source + LoRA's B @ A x alpha / r within 1e-6; logits of the exported model and of the base with the
adapters merged within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import LLAVA, QWEN, samples_for, tiny
from torch import nn

from mmadapt import VisionLanguageModel
from mmadapt.backbones import BACKBONES
from mmadapt.data import Collator, char_tokenizer
from mmadapt.lora import StagesSection, lora_modules, merge_lora
from mmadapt.qlora import BaseSourceError, quantize_base
from mmadapt.quantize import QuantizationSection, dequantized, is_nf4, nf4_layout, nf4_loading, to_nf4
from mmadapt.sharded_checkpoint import ModelTensors
from mmadapt.train import RunConfig, Trainer, latest_checkpoint
from mmadapt.train.export import export
from mmadapt.train.stages import load_adapters

SMALL = QuantizationSection(scaler_block_size=8)
# The linear layers each backbone keeps in its precision under QLoRA (BackboneSpec.keep_precision): stated here, so a
# change to a registration is a change to this list too
KEPT = {"llama": ("lm_head",), "qwen3_5": ("lm_head", "in_proj_a", "in_proj_b"),
        "qwen3_5_moe": ("lm_head", "in_proj_a", "in_proj_b", "mlp.gate", "shared_expert_gate"),
        "qwen3_vl": ("lm_head",), "qwen3_vl_moe": ("lm_head", "mlp.gate")}


def test_an_nf4_layer_is_within_the_error_of_torchaos_own_dequantisation():
    torch.manual_seed(0)
    weight, x = torch.randn(256, 128) * 0.02, torch.randn(5, 128)
    nf4 = to_nf4(weight, QuantizationSection())  # QLoRA's blocks: 64 weights, 256 scales
    assert is_nf4(nf4) and nf4.dtype == torch.float32
    decoded = dequantized(nf4)
    ours = nn.functional.linear(x, nn.Parameter(nf4, requires_grad=False))
    torch.testing.assert_close(ours, nn.functional.linear(x, decoded), rtol=0, atol=1e-6)
    bound = x.abs() @ (weight - decoded).abs().T  # the dequantisation error carried through the layer
    error = (ours - nn.functional.linear(x, weight)).abs()
    assert (error <= bound + 1e-6).all() and 0 < error.max() < 0.1 * nn.functional.linear(x, weight).abs().max()
    # QLoRA's storage: 4 bits, an int8 scale per 64, an fp32 scale per 64 x 256 (`bytes_per_weight`)
    stored = sum(t.nbytes for t in (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor))
    assert stored == weight.numel() * QuantizationSection().bytes_per_weight(4)


@pytest.mark.parametrize("name", sorted(KEPT))
def test_each_backbone_keeps_its_stated_layers_and_stores_only_linear_weights_in_4_bits(name):
    spec = BACKBONES.get(name)
    assert spec.keep_precision == KEPT[name]
    lm, _ = spec.build("tiny")
    layout = nf4_layout(lm, spec.keep_precision, SMALL)
    linear = {f"{n}.weight" for n, m in lm.named_modules() if isinstance(m, nn.Linear)}
    assert set(layout.quantized) | set(layout.kept) == linear and not set(layout.quantized) & set(layout.kept)
    declared = {k for k, why in layout.kept.items() if why == "declared"}
    assert declared == {k for k in linear if any(k.removesuffix(".weight").endswith(s) for s in KEPT[name])}
    assert layout.quantized and all(m in {"declared"} for m in layout.kept.values()), layout.kept
    for kept in ("in_proj_a", "in_proj_b", "lm_head"):
        assert not any(kept in k for k in layout.quantized)


def save_base(names, directory: Path, seed: int = 0) -> Path:
    """A tiny model saved as a model directory: the 'pretrained' base QLoRA starts from."""
    tiny(names, seed).save_pretrained(directory, tokenizer=char_tokenizer())
    return directory


def qlora_config(out: Path, *overrides: str, stages: tuple[str, ...] = ("stages.preset=qlora",)) -> RunConfig:
    return RunConfig.load(None, [f"train.out={out}", "train.progress=false", "train.lr=1e-2", *stages,
                                 "quantization.scaler_block_size=8", "lora.r=4", "lora.alpha=8", *overrides])


ADAPTERS_ALONE = ("stages.backbone=qlora", "stages.projector=frozen")  # base + adapters is then the whole run


def qlora_run(base: Path, out: Path, *overrides: str, stages: tuple[str, ...] = ("stages.preset=qlora",)
              ) -> tuple[Trainer, dict]:
    with nf4_loading(SMALL):  # as `mmadapt train` builds it: each NF4 layer quantised as it is read
        model = VisionLanguageModel.from_pretrained(base)
    trainer = Trainer(model, qlora_config(out, *overrides, stages=stages), samples_for(model),
                      Collator.for_model(model, 0), tokenizer=char_tokenizer())
    return trainer, trainer.fit()


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen3_5", "llava"])
def test_qlora_trains_the_adapters_alone_and_leaves_checkpoints_without_the_4bit_weights(names, tmp_path):
    base = save_base(names, tmp_path / "base")
    with nf4_loading(SMALL):
        model = VisionLanguageModel.from_pretrained(base)
    nf4 = {n for n, p in model.named_parameters() if is_nf4(p)}
    spec = model.backbone_spec
    assert nf4 == {f"backbone.{k}" for k in nf4_layout(model.backbone, spec.keep_precision, SMALL).quantized}
    codes = {n: p.quantized_data.clone() for n, p in model.named_parameters() if is_nf4(p)}
    start = {n: p.detach().clone() for n, p in model.named_parameters() if not is_nf4(p)}
    trainer = Trainer(model, qlora_config(tmp_path / "run", "train.steps=12", "train.lr=2e-2", stages=ADAPTERS_ALONE),
                      samples_for(model), Collator.for_model(model, 0), tokenizer=char_tokenizer())
    losses = [r["loss"] for r in trainer.fit()["history"]]
    assert losses[-1] < losses[0] - 0.25, losses  # fell by 0.52-0.92 over seeds 0-2 and 1 / 2 threads

    # only the adapters moved; the NF4 codes did not
    after = {n.replace(".base_layer", ""): p for n, p in model.named_parameters()}
    assert all(torch.equal(after[n.replace(".base_layer", "")].quantized_data, c) for n, c in codes.items())
    moved = {n for n, p in start.items() if not torch.equal(after[n.replace(".base_layer", "")].detach(), p)}
    assert not moved, sorted(moved)[:5]
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    # the checkpoint holds everything but the NF4 weights, and config.json where their originals are
    checkpoint = latest_checkpoint(tmp_path / "run")
    stored = set(ModelTensors(checkpoint).keys())
    every = set(model.state_dict())
    four_bit = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert stored == every - four_bit and len(four_bit) == len(nf4)
    record = json.loads((checkpoint / "config.json").read_text())["quantized_base"]
    assert record["format"] == "nf4" and Path(record["source"]) == base.resolve()
    assert {k.replace(".weight", ".base_layer.weight") for k in record["keys"]} == four_bit

    # OUT/model: the adapters merged into the source's full-precision weights, never into dequantised NF4
    exported = VisionLanguageModel.from_pretrained(tmp_path / "run" / "model").eval()
    reference = VisionLanguageModel.from_pretrained(base)
    load_adapters(reference, tmp_path / "run" / "adapters")  # merged into the base's own weights
    reference.eval()
    source = VisionLanguageModel.from_pretrained(base).state_dict()
    mine, theirs = exported.state_dict(), reference.state_dict()
    for key in record["keys"]:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=1e-6)
        assert not torch.equal(mine[key], source[key])  # LoRA moved it
    for key in set(mine) - set(record["keys"]):
        assert torch.equal(mine[key], source[key]), key  # kept in precision, frozen: the source's bits
    batch = Collator.for_model(exported, 0)(samples_for(exported)[:4])
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, reference(**batch).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("format", ["sharded", "gathered"])
def test_qlora_resumes_bitwise(tmp_path, monkeypatch, format):
    base = save_base(QWEN, tmp_path / "base")
    run = ("train.steps=4", "checkpoint.every=2", f"checkpoint.format={format}")
    _, full = qlora_run(base, tmp_path / "full", *run)
    original = Trainer.save

    def save_then_stop(self, **kwargs):
        original(self, **kwargs)
        if self.step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        qlora_run(base, tmp_path / "cut", *run)
    monkeypatch.setattr(Trainer, "save", original)
    _, resumed = qlora_run(base, tmp_path / "cut", *run, "checkpoint.resume=true")
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in full["history"]]
    assert [r["grad_norm"] for r in resumed["history"]] == [r["grad_norm"] for r in full["history"]]


def test_loading_quantises_each_weight_as_it_is_read(tmp_path, monkeypatch):
    """Inside `nf4_loading` every NF4 weight is read through a file mapping of its own and quantised right after,
    before the next one is read: the host holds one full-precision NF4 layer at a time, never the full-precision
    model, and no mapping keeps the source pages of the NF4 layers (the kept weights' mapping reads none of them)."""
    import mmadapt.quantize as quantize
    from mmadapt.weights import Checkpoint

    base = save_base(QWEN, tmp_path / "base")
    events, read, once, quantise = [], Checkpoint.tensor, Checkpoint.read_once, quantize.to_nf4

    def reading(self, key):
        events.append(("kept", key))
        return read(self, key)

    def reading_once(self, key):  # a mapping of its own: the source's pages go with the tensor
        events.append(("read", key))
        return once(self, key)

    def quantising(weight, section):
        events.append(("nf4", None))
        return quantise(weight, section)

    monkeypatch.setattr(Checkpoint, "tensor", reading)
    monkeypatch.setattr(Checkpoint, "read_once", reading_once)
    monkeypatch.setattr(quantize, "to_nf4", quantising)
    with nf4_loading(SMALL):
        model = VisionLanguageModel.from_pretrained(base)
    quantised = [i for i, (kind, _) in enumerate(events) if kind == "nf4"]
    assert len(quantised) == sum(is_nf4(p) for p in model.parameters()) > 10
    four_bit = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert sorted(events[i - 1] for i in quantised) == sorted(("read", k) for k in four_bit)
    assert not {k for kind, k in events if kind == "kept"} & four_bit
    quantize_base(model, SMALL)  # nothing left to quantise: no second pass
    assert sum(kind == "nf4" for kind, _ in events) == len(quantised)


def test_a_backbone_of_random_weights_is_refused_with_the_fix(tmp_path):
    model = tiny(QWEN)
    with pytest.raises(ValueError, match=r"not read from a checkpoint.*Fix: start from a checkpoint"):
        Trainer(model, qlora_config(tmp_path), samples_for(model), Collator.for_model(model, 0))
    with pytest.raises(ValueError, match=r"stages.encoder must be one of \['frozen', 'full', 'lora'\], got 'qlora'"):
        RunConfig.load(None, ["stages.encoder=qlora"])
    with pytest.raises(ValueError, match=r"stages.projector cannot be 'qlora': only the backbone"):
        StagesSection(projector="qlora").modes()  # built in Python, not read from a file


def test_an_export_refuses_a_base_that_changed_since_training(tmp_path):
    base = save_base(LLAVA, tmp_path / "base")
    qlora_run(base, tmp_path / "run", "train.steps=2")
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes, rewritten: its stamp changed
    with pytest.raises(BaseSourceError, match=r"changed since.*Fix: restore the checkpoint the run started from"):
        export(tmp_path / "run", tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_the_chat_and_serving_loader_opens_a_qlora_run_with_its_adapters_merged(tmp_path):
    from mmadapt.loading import load_for_inference

    base = save_base(LLAVA, tmp_path / "base")
    qlora_run(base, tmp_path / "run", "train.steps=2", stages=ADAPTERS_ALONE)
    for source in (tmp_path / "run", latest_checkpoint(tmp_path / "run")):
        model, tokenizer = load_for_inference(source)
        assert tokenizer is not None and not lora_modules(model)
        assert not any(is_nf4(p) for p in model.parameters())
    trainer, _ = qlora_run(base, tmp_path / "again", "train.steps=1", stages=ADAPTERS_ALONE)
    with pytest.raises(ValueError, match=r"4-bit \(QLoRA\) weights, which a model directory never stores.*Fix"):
        trainer.model.save_pretrained(tmp_path / "saved")
    plain = VisionLanguageModel.from_pretrained(base)
    load_adapters(plain, tmp_path / "run" / "adapters", merge=False)
    merge_lora(plain)
    assert all(torch.equal(a, b) for a, b in zip(plain.backbone.state_dict().values(),
                                                 model.backbone.state_dict().values(), strict=True))


@pytest.mark.parametrize("field,value", [("dtype", "load"), ("format", "gptq"), ("keys", {"a": 1}), ("stamps", None)])
def test_an_altered_quantized_base_record_is_refused(field, value):
    from mmadapt.qlora import QuantizedBase

    record = {"format": "nf4", "block_size": 64, "scaler_block_size": 256, "dtype": "float32", "source": "/x",
              "stamps": [["model.safetensors", 1, 2]], "keys": {"backbone.a.weight": "a.weight"}}
    assert QuantizedBase.from_dict(record).dtype == "float32"
    with pytest.raises(ValueError, match="'quantized_base' record is not one mmadapt writes"):
        QuantizedBase.from_dict({**record, field: value})
