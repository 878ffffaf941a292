"""Pre-quantised bitsandbytes 4-bit checkpoints (`mmadapt.bnb`): loaded as transformers loads them, trained with
QLoRA (the 4-bit weights untouched and left out of checkpoints), refused under FSDP2 and for full / LoRA training,
and exported merged into the dequantised 4-bit weights.

The checkpoints are made here the way the hub's `*-bnb-4bit` ones are: transformers quantises a tiny Llama with
`BitsAndBytesConfig` (NF4, double quantisation) on the CPU and `save_pretrained` writes it.
"""

import json
from unittest import mock

import pytest
import torch

import mmadapt
from mmadapt.data import Collator
from mmadapt.directory import EXPORT_RECORD
from mmadapt.synthetic import synthetic_samples
from mmadapt.train import RunConfig, Trainer, apply_stages
from mmadapt.train.config import StagesSection


def _import_bnb():
    """bitsandbytes, imported offline: on a CPU with AVX512-BF16 its import looks for a kernel on the Hugging Face
    Hub (the `kernels` package), which a test must never download."""
    hub = pytest.importorskip("huggingface_hub.constants")
    with mock.patch.object(hub, "HF_HUB_OFFLINE", True):
        return pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install "
                                   "'mmadapt[qlora]'): the bnb-4bit checkpoint path cannot be tested")


bitsandbytes = _import_bnb()

from mmadapt import bnb  # noqa: E402  (after bitsandbytes' offline import)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, image_token_id=255)  # mmadapt's llama preset "tiny"
IDS = torch.tensor([[1, 5, 9, 200, 17, 3, 42]])


@pytest.fixture(scope="module")
def bnb_dir(tmp_path_factory):
    """A tiny Llama saved in full precision (DIR/fp) and as transformers writes it quantised (DIR/bnb)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("bnb")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(root / "fp")
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(root / "fp", quantization_config=quantization,
                                         device_map="cpu").save_pretrained(root / "bnb")
    return root / "bnb"


def _llama():
    from mmadapt.backbones import BACKBONES

    return BACKBONES.get("llama")


def test_the_checkpoint_is_the_hub_layout(bnb_dir):
    config = json.loads((bnb_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes"
    keys = mmadapt.weights.Checkpoint.open(bnb_dir).keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert {f"{q}.absmax", f"{q}.quant_map", f"{q}.nested_absmax", f"{q}.nested_quant_map",
            f"{q}.quant_state.bitsandbytes__nf4"} <= set(keys)
    assert len(bnb.quantized_layers(keys)) == 14 and "lm_head.weight" not in bnb.quantized_layers(keys)


FP4_BF16 = dict(bnb_4bit_quant_type="fp4", bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_use_double_quant=False)


@pytest.mark.parametrize("variant", ["nf4, double quantisation", "fp4, bfloat16 storage"])
def test_backbone_logits_equal_transformers(bnb_dir, tmp_path, variant):
    """mmadapt's backbone read from the bnb checkpoint holds the modules transformers builds from it: its logits equal
    `AutoModelForCausalLM.from_pretrained(dir)`'s exactly, through both of bitsandbytes' CPU paths (training:
    dequantise then matmul; inference without gradients: its fused 4-bit kernel where the CPU has one)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if variant.startswith("fp4"):
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, **FP4_BF16)
        AutoModelForCausalLM.from_pretrained(bnb_dir.parent / "fp", quantization_config=quantization,
                                             device_map="cpu").save_pretrained(tmp_path / "fp4")
        bnb_dir = tmp_path / "fp4"
    lm, _ = _llama().from_pretrained(str(bnb_dir))
    reference = AutoModelForCausalLM.from_pretrained(bnb_dir, device_map="cpu")
    ours = [m for m in lm.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert len(ours) == 14 and type(lm.lm_head) is torch.nn.Linear
    storage = torch.bfloat16 if variant.startswith("fp4") else torch.uint8
    assert all(m.weight.dtype == storage and m.weight.quant_type == variant[:3] for m in ours)
    assert "quantization_config" not in lm.config.to_dict()  # how it was stored is no part of the architecture
    lm.train(), reference.train()
    torch.testing.assert_close(lm(IDS).logits, reference(IDS).logits, rtol=0, atol=0)
    lm.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS).logits, reference(IDS).logits, rtol=0, atol=0)


def _model(bnb_dir):
    torch.manual_seed(0)
    return mmadapt.build_model("clip", "mlp2x_gelu", {"name": "llama", "pretrained": str(bnb_dir)})


def _trained(bnb_dir, out, *overrides):
    model = _model(bnb_dir)
    config = RunConfig.load(None, [f"train.out={out}", "train.progress=false", "train.steps=4", "train.lr=5e-2",
                                   "lora.r=4", "lora.dropout=0.0", "data.batch_size=4", "stages.backbone=qlora",
                                   *overrides])
    samples = synthetic_samples(model, [1, 1, 1, 1], text_lengths=[6, 9, 5, 8], seed=0)
    codes = {n: p.detach().clone() for n, p in model.backbone.named_parameters() if bnb.is_params4bit(p)}
    trainer = Trainer(model, config, samples, Collator.for_model(model, 0))
    return model, trainer.fit(), codes, samples


def test_qlora_trains_over_the_4bit_layers_and_exports_merged_into_them(bnb_dir, tmp_path, caplog):
    """One process: peft's bitsandbytes LoRA layer wraps each Linear4bit; the loss falls; the 4-bit codes do not
    change and no checkpoint holds them; the record says the source and the format; the export (a warning, a note)
    is the adapters merged into the dequantised 4-bit weights, its logits equal to the trained model's unmerged ones
    within 1e-4 (float32 rounding of the two orders of summation)."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    from mmadapt.train.export import export

    model, summary, codes, samples = _trained(bnb_dir, tmp_path / "run")
    assert sum(isinstance(m, LoraLinear4bit) for m in model.backbone.modules()) == 14
    losses = [r["loss"] for r in summary["history"]]
    assert losses[-1] < losses[0], losses
    after = {n.replace(".base_layer", ""): p for n, p in model.backbone.named_parameters() if bnb.is_params4bit(p)}
    assert after.keys() == codes.keys() and all(torch.equal(after[n], codes[n]) for n in codes)
    assert all(p.abs().sum() > 0 for n, p in model.backbone.named_parameters() if "lora_B" in n)  # trained
    record = model.quantized_base
    assert (record.format, record.source, record.block_size, record.scaler_block_size) == (
        "bnb-4bit", str(bnb_dir.resolve()), 64, 256)
    checkpoint = max((tmp_path / "run" / "checkpoints").iterdir())
    keys = mmadapt.weights.Checkpoint.open(checkpoint).keys()
    assert keys and not [k for k in keys if "q_proj.base_layer.weight" in k or "absmax" in k]
    assert json.loads((checkpoint / "config.json").read_text())["quantized_base"]["format"] == "bnb-4bit"

    with caplog.at_level("WARNING", logger="mmadapt.qlora"):
        export(tmp_path / "run", tmp_path / "hf", format="transformers")
    assert bnb.DEQUANTIZED_NOTE in caplog.text
    assert bnb.DEQUANTIZED_NOTE in json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())["notes"]
    export(tmp_path / "run", tmp_path / "merged")
    merged = mmadapt.VisionLanguageModel.from_pretrained(tmp_path / "merged")
    batch = Collator.for_model(model, 0)(samples)
    model.train()  # dropout 0; bitsandbytes' dequantise-then-matmul path, as in training
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, model(**batch).logits, rtol=0, atol=1e-4)


def test_a_frozen_4bit_base_is_recorded_and_exported_dequantised(bnb_dir, tmp_path):
    """Stage 1 (the projector alone) over a bnb-4bit base: the base stays as read, its record written, and the export
    is the dequantised base with the trained projector: equal logits within 1e-4."""
    from mmadapt.train.export import export

    model, _, _, samples = _trained(bnb_dir, tmp_path / "run", "stages.backbone=frozen")
    assert model.quantized_base.format == "bnb-4bit" and bnb.quant_settings(model.backbone)[0] == 64
    export(tmp_path / "run", tmp_path / "merged")
    merged = mmadapt.VisionLanguageModel.from_pretrained(tmp_path / "merged")
    batch = Collator.for_model(model, 0)(samples)
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, model(**batch).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_full_and_lora_are_refused_on_a_4bit_base(bnb_dir, mode):
    model = _model(bnb_dir)
    with pytest.raises(ValueError, match=rf"stages.backbone: {mode} cannot train a backbone read from a pre-quantised "
                                         r"bitsandbytes 4-bit checkpoint.*Fix: stages.backbone: qlora"):
        apply_stages(model, StagesSection(backbone=mode))


def test_fsdp_is_refused_before_any_weight_is_read(bnb_dir, tmp_path, monkeypatch):
    """`distributed.strategy: fsdp` (or `auto` with 2 processes) stops in one line before a weight is read; `ddp` and
    one process under `auto` go on; a model that somehow holds 4-bit layers is refused by `wrap` too."""
    from mmadapt.train import distributed
    from mmadapt.train.run import build_model_from

    line = r"cannot train the pre-quantised bitsandbytes checkpoint .*quant_state is required.*strategy: ddp"
    bnb.refuse_fsdp([None, str(bnb_dir)], "ddp", 2)
    bnb.refuse_fsdp([str(bnb_dir)], "auto", 1)
    bnb.refuse_fsdp([str(bnb_dir.parent / "fp")], "fsdp", 2)
    with pytest.raises(ValueError, match=line):
        bnb.refuse_fsdp([str(bnb_dir)], "auto", 2)
    config = RunConfig.load(None, [f"train.out={tmp_path}", "distributed.strategy=fsdp", "stages.backbone=qlora",
                                   "model.encoder=clip", "model.projector=mlp2x_gelu", "model.backbone.name=llama",
                                   f"model.backbone.pretrained={bnb_dir}"])
    monkeypatch.setattr(mmadapt.weights.Checkpoint, "tensor", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=line) as refused:
        build_model_from(config)
    assert "\n" not in str(refused.value)
    monkeypatch.undo()
    model = _model(bnb_dir)
    two = distributed.DistContext(rank=0, world=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"cannot shard a bitsandbytes 4-bit backbone.*quant_state is required"):
        distributed.wrap(model, two, "fsdp", "fp32")


def _quantized_llava(source, target, skip):
    from transformers import BitsAndBytesConfig, LlavaForConditionalGeneration

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip)
    LlavaForConditionalGeneration.from_pretrained(source, quantization_config=quantization,
                                                  device_map="cpu").save_pretrained(target)
    return target


def test_a_whole_llava_directory_loads_its_language_model_in_4bits(hf_llava_dir, tmp_path):
    """A llava-hf bnb-4bit directory (the vision tower and projector kept in precision, as the hub's are) loads
    through mmadapt.convert: the language model's linear layers are Linear4bit and its text logits equal
    transformers'. One whose vision tower is 4-bit too is refused in one line before any part is read."""
    from transformers import LlavaForConditionalGeneration

    kept = _quantized_llava(hf_llava_dir, tmp_path / "kept",
                            ["model.vision_tower", "model.multi_modal_projector", "lm_head"])
    model = mmadapt.VisionLanguageModel.from_pretrained(kept)
    assert sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.modules()) == 14
    assert not any(bnb.is_params4bit(p) for p in [*model.encoder.parameters(), *model.projector.parameters()])
    reference = LlavaForConditionalGeneration.from_pretrained(kept, device_map="cpu")
    model.backbone.train(), reference.train()
    torch.testing.assert_close(model.backbone(IDS).logits, reference(input_ids=IDS).logits, rtol=0, atol=0)

    everything = _quantized_llava(hf_llava_dir, tmp_path / "all", ["lm_head"])
    with pytest.raises(ValueError, match=r"stores \d+ layers outside the language model in 4 bits.*"
                                         r"llm_int8_skip_modules"):
        mmadapt.VisionLanguageModel.from_pretrained(everything)


@pytest.fixture(scope="module")
def bnb_run(tmp_path_factory, bnb_dir):
    """A LLaVA run over the bnb-4bit Llama (QLoRA) on scikit-image's photos, as `mmadapt train` reads it."""
    from test_distributed import PHOTOS, write_photos

    root = tmp_path_factory.mktemp("bnb_run")
    write_photos(root)
    records = [{"id": f"s{i}", "image": f"{list(PHOTOS)[i % 4]}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?" + " please" * (i % 3)},
        {"from": "gpt", "value": list(PHOTOS)[i % 4]}]} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "base.yaml").write_text(
        f"model: {{encoder: clip, projector: mlp2x_gelu, backbone: {{name: llama, pretrained: {bnb_dir}}}}}\n"
        f"data: {{train: {root / 'train.jsonl'}, image_root: {root / 'images'}, max_length: 256}}\n"
        "train: {steps: 3, lr: 1.0e-3, progress: false}\nstages: {backbone: qlora}\nlora: {r: 4}\n")
    return root


@pytest.mark.slow
def test_ddp_equals_one_process_and_fsdp_is_refused_with_two_processes(bnb_run):
    """torchrun, 2 gloo processes: DDP's losses equal one process's (the global batch the same) within 1e-5, the
    4-bit weights not broadcast, and its checkpoint resumes in one process; FSDP2 stops on every rank with the one
    line, before any weight is read."""
    from test_distributed import launch, records

    one = records(bnb_run, "one", "data.batch_size=2", "train.grad_accum=2", "train.full_logits=true")
    ddp = records(bnb_run, "ddp", "data.batch_size=2", "distributed.strategy=ddp", "checkpoint.every=2", procs=2)
    assert len(one) == len(ddp) == 3
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 for a, b in zip(one, ddp, strict=True)), (one, ddp)
    # its step-2 checkpoint (no 4-bit weights in it) resumes in one process: the base read again from the source
    resumed = records(bnb_run, "ddp", "data.batch_size=2", "train.grad_accum=2", "--resume")
    assert abs(resumed[2]["loss"] - one[2]["loss"]) <= 1e-5, (resumed, one)
    refused = launch(bnb_run, "fsdp", "data.batch_size=2", "distributed.strategy=fsdp", procs=2)
    assert refused.returncode != 0
    assert "quant_state is required" in refused.stderr and "distributed.strategy: ddp" in refused.stderr, \
        refused.stderr[-3000:]
    assert not (bnb_run / "fsdp" / "checkpoints").exists()
