"""Numerics toolkit: dumps, comparisons, packing parity and DeepSpeed lint, as regression tests for three real
failures (a bf16 ZeRO-2 port going NaN, packed rows with an integer mask, two accelerators parting).

bf16 + ZeRO-2 NaNs: that port's DeepSpeed config and LLaVA-1.5's shipped ZeRO-2 config are
flagged, the generated safe configs lint clean; a NaN planted in forward or backward shows up in a dump
at the module that produced it. Integer mask: an int32 mask is refused, and an "index instead
of mask" embedding bug is caught by the packed-vs-padded parity check. Two accelerators:
a backward perturbed from one block down is named at that block, with no forward divergence.
Plus: fp32 vs bf16 autocast stays within the default tolerances, wrapped models dump like plain ones.
All on tiny models, CPU, seconds.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from mmadapt import build_model
from mmadapt.cli import main
from mmadapt.data import Collator
from mmadapt.numerics import (
    Tolerances,
    compare,
    deepspeed_config_for_run,
    dump,
    find_nonfinite,
    lint_deepspeed,
    load_dump,
    normalize_name,
    packed_vs_padded,
    safe_deepspeed_config,
)
from mmadapt.numerics.compare import BACKWARD_RTOL, FORWARD_RTOL
from mmadapt.synthetic import synthetic_batch, synthetic_samples

FIXTURES = Path(__file__).parent / "fixtures"
STORY1 = FIXTURES / "deepspeed_story1_zero2.json"
LLAVA_ZERO2 = FIXTURES / "deepspeed_llava15_zero2.json"
DOWN_PROJ = "backbone.model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = build_model("clip", "mlp2x_gelu", "llama")
    return model, synthetic_batch(model, (1, 1))


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    model = build_model("qwen3_5_vit", "qwen_merger", "qwen3_5")
    return model, synthetic_batch(model, (1, 2))


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `factor` in backward (NaN poisons it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_backward_after(module: nn.Module, factor: float):
    """Forward hook: the module's output passes through `_ScaleGrad` (values unchanged). Returns the handle."""
    return module.register_forward_hook(lambda mod, args, out: _ScaleGrad.apply(out, factor))


def compare_with_backward_scaled_after(model: nn.Module, layer: nn.Module, batch: dict, tmp_path: Path) -> object:
    """`compare` of two dumps of one step, the second with the gradient out of `layer` scaled by 1.5
    (two accelerators parting)."""
    clean = dump(model, batch, tmp_path / "clean.json", seed=0)
    handle = scale_backward_after(layer, 1.5)
    try:
        perturbed = dump(model, batch, tmp_path / "perturbed.json", seed=0)
    finally:
        handle.remove()
    return compare(clean, perturbed)


# ---- dumps ----------------------------------------------------------------------------------------
def test_dump_file_rows_and_metadata(qwen, tmp_path):
    model, batch = qwen
    path = tmp_path / "qwen.json.gz"
    result = dump(model, batch, path, seed=0)
    data = json.loads(gzip.decompress(path.read_bytes()))  # strict JSON, no NaN literals
    assert data["format"] == "mmadapt.numerics.dump" and path.stat().st_size < 20_000
    loaded = load_dump(path)
    assert loaded.forward == result.forward and loaded.grads == result.grads
    meta = loaded.meta
    assert meta["seed"] == 0 and meta["torch"] == torch.__version__ and meta["transformers"]
    assert meta["device"] == "cpu" and meta["param_dtypes"] == ["float32"] and meta["autocast"] is None
    assert {"hostname", "created", "loss"} <= meta.keys()
    rows = {r["name"]: r for r in loaded.forward}
    layer = rows["backbone.model.layers.0"]
    assert layer["shape"] == [2, batch["input_ids"].shape[1], model.backbone.config.hidden_size]
    assert layer["dtype"] == "float32" and layer["nan"] == layer["inf"] == 0 and layer["norm"] > 0
    assert {"mean", "absmax", "numel"} <= layer.keys()
    # Backward order: the loss side first, the vision tower's patch embedding last.
    assert loaded.grads[0]["name"] == "backbone.lm_head.weight"
    assert loaded.grads[-1]["name"].startswith("encoder.tower.patch_embed")
    assert len(loaded.grads) == sum(1 for _ in model.parameters())
    assert all(p.grad is None for p in model.parameters())  # gradients left as found


def test_repeated_calls_and_multiple_outputs_get_their_own_rows():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return {"loss": self.head(self.shared(self.shared(x))).sum(), "hidden": x * 2}

    torch.manual_seed(0)
    result = dump(Model(), (torch.randn(3, 4),))
    assert [r["name"] for r in result.forward] == ["shared", "shared#1", "head", "<root>:loss", "<root>:hidden"]
    assert result.forward[1]["call"] == 1 and result.forward[3]["output"] == "output['loss']"


def test_dump_takes_a_scalar_output_and_refuses_outputs_without_loss():
    model = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    assert len(dump(nn.Sequential(model, _Sum()), torch.randn(2, 4)).grads) == 2
    with pytest.raises(TypeError, match=r"without a scalar floating `loss`.*Fix"):
        dump(model, torch.randn(2, 4))


class _Sum(nn.Module):
    def forward(self, x):
        return x.sum()


def test_load_dump_says_what_is_wrong(tmp_path):
    bad = tmp_path / "other.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match=r"not a numerics dump.*Fix"):
        load_dump(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_dump(tmp_path / "missing.json")


def test_activation_checkpointing_adds_no_rows():
    class Block(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.inner, self.checkpointed = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), checkpointed

        def forward(self, x):
            if self.checkpointed:
                return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
            return self.inner(x)

    x = torch.randn(3, 4)
    torch.manual_seed(0)
    plain = nn.Sequential(Block(False), nn.Linear(4, 1), nn.Flatten(0), _Sum())
    checkpointed = copy.deepcopy(plain)
    checkpointed[0].checkpointed = True
    result = compare(dump(plain, x), dump(checkpointed, x))
    assert result.ok and [r.rel for r in result.forward + result.backward] == [0.0] * 9


@pytest.mark.parametrize(("raw", "plain"), [
    ("base_model.model.backbone.q_proj.base_layer.weight", "backbone.q_proj.weight"),
    ("module._orig_mod.layers.0.mlp", "layers.0.mlp"),
    ("layers.0._fsdp_wrapped_module.fc.weight", "layers.0.fc.weight"),
])
def test_normalize_name(raw, plain):
    assert normalize_name(raw) == plain


# ---- packed sequences with an integer mask -----------------------------------------------------
def test_int32_mask_through_packing_masks_and_never_indexes(qwen):
    """The packed run's all-ones int32 mask: converted to bool once at the boundary, so it masks (equal to
    the bool one)."""
    model, _ = qwen
    batch = Collator.for_model(model, 0, max_tokens=256)(synthetic_samples(model, (1, 0, 1)))
    ones = torch.ones_like(batch["attention_mask"], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(model(**{**batch, "attention_mask": ones}, return_logits=True).logits,
                           model(**{**batch, "attention_mask": ones.bool()}, return_logits=True).logits)


def index_with_all_ones_mask(model: nn.Module, dtype: torch.dtype) -> None:
    """Re-create the Megatron port's embedding step: `x[i, mask[i]]` with an all-ones mask of `dtype`.

    An int mask is an index (every position gets token 1's embedding); a bool mask selects every position.
    """
    embed = model.embed

    def embed_with_mask(input_ids, spans, visual):
        embeds = embed(input_ids, spans, visual)
        mask = torch.ones_like(input_ids, dtype=dtype)
        return torch.stack([embeds[i, mask[i]] for i in range(len(embeds))])

    model.embed = embed_with_mask


def test_packed_vs_padded_catches_index_instead_of_mask(qwen):
    model, _ = qwen
    model = copy.deepcopy(model).eval()
    # Text-only samples: with images, mmadapt's injected-features check would already refuse the bug.
    samples = synthetic_samples(model, (0, 0, 0), text_lengths=(9, 14, 5), seed=1)
    assert max(packed_vs_padded(model, samples).values()) <= 1e-5  # correct model

    index_with_all_ones_mask(model, torch.bool)
    assert max(packed_vs_padded(model, samples).values()) <= 1e-5  # a bool mask masks

    index_with_all_ones_mask(model, torch.int32)
    diffs = packed_vs_padded(model, samples)
    assert max(diffs.values()) > 1e-2, diffs  # an int mask indexes: packed samples get the wrong embeddings


# ---- same forward, different backward (two accelerators) ------------------------------------------------
def test_backward_perturbed_from_block_k_is_named_at_block_k(llama, tmp_path):
    model, batch = llama
    k = 0  # the tiny LLaMA has 2 blocks; block 1's gradients stay equal, block 0's and below are scaled
    result = compare_with_backward_scaled_after(model, model.backbone.model.layers[k], batch, tmp_path)
    assert result.first_forward is None and all(r.rel == 0 for r in result.forward)
    assert result.first_backward is not None and result.first_backward.startswith(f"backbone.model.layers.{k}.")
    before = [r for r in result.backward[: [r.name for r in result.backward].index(result.first_backward)]]
    assert before and all(r.rel == 0 for r in before)  # lm_head, final norm, block 1: untouched
    assert not (result.only_a or result.only_b)
    text = result.format()
    assert f"first backward divergence: {result.first_backward}" in text and "first forward divergence:  none" in text


def test_cli_compare_writes_json_and_plot(llama, tmp_path):
    model, batch = llama
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    dump(model, batch, a, seed=0)
    handle = scale_backward_after(model.backbone.model.layers[0], 1.5)
    try:
        dump(model, batch, b, seed=0)
    finally:
        handle.remove()
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    assert main(["numerics", "compare", str(a), str(b), "--json", str(out), "--plot", str(png)]) == 1
    report = json.loads(out.read_text())
    assert report["first_forward"] is None and report["first_backward"].startswith("backbone.model.layers.0.")
    assert report["forward"] and report["backward"] and report["tolerances"]["forward"] == FORWARD_RTOL
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["numerics", "compare", str(a), str(a)]) == 0


def test_cli_dump(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    assert main(["numerics", "dump", str(out), "--encoder", "clip", "--projector", "mlp2x_gelu",
                 "--backbone", "llama", "--images", "1", "1"]) == 0
    assert load_dump(out).grads and "forward rows" in capsys.readouterr().out


# ---- NaNs (the bf16 port), planted in forward and backward ----------------------------------------
def test_forward_nan_shows_in_the_dump_at_its_module(llama):
    model, batch = llama
    clean = dump(model, batch)
    handle = model.get_submodule(DOWN_PROJ).register_forward_hook(lambda mod, args, out: out * float("nan"))
    try:
        poisoned = dump(model, batch)
        traced = find_nonfinite(model, lambda: model(**batch).loss.backward())
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    first = poisoned.first_nonfinite_forward()
    assert first["name"] == DOWN_PROJ and first["nan"] == first["numel"]
    names = [r["name"] for r in poisoned.forward]
    assert all(r["nan"] == 0 for r in poisoned.forward[: names.index(DOWN_PROJ)])
    assert traced.module == DOWN_PROJ and traced.phase == "forward"  # the tracer agrees
    result = compare(clean, poisoned)
    assert result.first_forward == DOWN_PROJ
    assert next(r for r in result.forward if r.name == DOWN_PROJ).reason == "nan/inf counts"


def test_backward_nan_shows_in_the_dump_at_its_module(llama):
    model, batch = llama
    clean = dump(model, batch)
    handle = scale_backward_after(model.get_submodule(DOWN_PROJ), float("nan"))
    try:
        poisoned = dump(model, batch)
    finally:
        handle.remove()
    assert poisoned.first_nonfinite_forward() is None
    first = poisoned.first_nonfinite_grad()
    assert first["name"] == f"{DOWN_PROJ}.weight" and first["nan"] > 0
    result = compare(clean, poisoned)
    assert result.first_forward is None and result.first_backward == f"{DOWN_PROJ}.weight"


# ---- bf16 vs fp32, wrapped vs plain ---------------------------------------------------------------
def test_fp32_vs_bf16_autocast_stays_within_the_default_tolerances(qwen):
    model, batch = qwen
    fp32 = dump(model, batch, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = dump(model, batch, seed=0)
    assert bf16.meta["autocast"] == "bfloat16"
    assert any(r["dtype"] == "bfloat16" for r in bf16.forward)  # autocast really ran in bf16
    result = compare(fp32, bf16)
    assert result.ok, result.format()
    assert max(r.rel for r in result.forward) < FORWARD_RTOL / 4
    assert max(r.rel for r in result.backward) < BACKWARD_RTOL / 2
    assert max(r.rel for r in result.forward) > 0  # the comparison did see bf16 rounding
    # The same numbers with a strict fp32-vs-fp32 tolerance do diverge: the defaults are what lets bf16 pass.
    assert not compare(fp32, bf16, Tolerances(forward=1e-6, backward=1e-6)).ok


class Holder(nn.Module):
    """Stands in for DDP / DeepSpeed's engine: the model lives at `.module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_wrapped_and_lora_models_dump_like_the_plain_model(llama):
    from peft import LoraConfig, get_peft_model

    model, batch = llama
    plain = dump(model, batch)
    wrapped = compare(plain, dump(Holder(model), batch))
    assert wrapped.ok and all(r.rel == 0 for r in wrapped.forward + wrapped.backward)

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert all(not p.detach().any() for n, p in lora.named_parameters() if "lora_B" in n)  # zero-init B
    for p in lora.parameters():
        p.requires_grad_(True)  # base weights trainable too, so every plain gradient row has a counterpart
    peft_dump = dump(lora, batch)
    assert any(r["name"].endswith("q_proj.weight") for r in peft_dump.grads)
    result = compare(plain, peft_dump)
    assert result.ok, result.format()
    assert not (result.only_a or result.only_b) and result.adapters_only  # lora_A/lora_B rows, listed apart
    assert all(r.rel == 0 for r in result.forward + result.backward)
    assert len(result.forward) == len(plain.forward) and len(result.backward) == len(plain.grads)


# ---- DeepSpeed lint -------------------------------------------------------------------------------
def by_severity(findings):
    return ({f.key for f in findings if f.severity == "error"}, {f.key for f in findings if f.severity == "warning"})


def test_story1_deepspeed_config_is_flagged():
    errors, warnings = by_severity(lint_deepspeed(STORY1))
    assert errors == {"grad_accum_dtype", "communication_data_type", "data_types.grad_accum_dtype"}
    assert {"bf16.check_grad_overflow", "bf16.enabled"} <= warnings
    misplaced = next(f for f in lint_deepspeed(STORY1) if f.key == "grad_accum_dtype")
    assert "data_types.grad_accum_dtype" in misplaced.message and "no effect" in misplaced.message
    assert misplaced.fix == 'move it: "data_types": {"grad_accum_dtype": "fp32"}'


def test_llava15_zero2_config_is_flagged():
    errors, warnings = by_severity(lint_deepspeed(LLAVA_ZERO2))
    assert errors == {"communication_data_type", "data_types.grad_accum_dtype"}
    assert "bf16.check_grad_overflow" in warnings
    auto = next(f for f in lint_deepspeed(LLAVA_ZERO2) if f.key == "bf16.enabled")
    assert "bf16.enabled and fp16.enabled" in auto.message


@pytest.mark.parametrize("stage", [2, 3])
def test_safe_configs_lint_clean(stage):
    config = safe_deepspeed_config(stage)
    assert lint_deepspeed(config) == [] and config["zero_optimization"]["stage"] == stage
    with pytest.raises(ValueError, match="stage must be 2 or 3"):
        safe_deepspeed_config(1)


def test_deepspeed_config_for_a_run():
    from mmadapt.train import RunConfig

    run = RunConfig.load(None, ["precision.policy=bf16-autocast", "train.grad_accum=4", "data.batch_size=2"])
    config = deepspeed_config_for_run(run, 3)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 4)
    assert config["bf16"]["enabled"] is True and lint_deepspeed(config) == []


@pytest.mark.parametrize(("config", "errors"), [
    ({"bf16": {"enabled": True, "check_grad_overflow": True, "communication_data_type": "fp32"},
      "data_types": {"grad_accum_dtype": "fp32"}}, {"bf16.communication_data_type", "communication_data_type"}),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}, "communication_data_type": "fp32",
      "data_types": {"grad_accum_dtype": "fp32"}}, {"fp16.enabled"}),
    ({"bf16": {"enabled": True, "check_grad_overflow": True}, "communication_data_type": "bf16",
      "data_types": {"grad_accum_dtype": "bf16"}}, {"communication_data_type", "data_types.grad_accum_dtype"}),
    ({"bf16": {"enabled": True, "check_grad_overflow": True}, "communication_data_type": "auto",
      "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 2}, "stage": 2},
     {"communication_data_type", "stage"}),
    ({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}, set()),  # fp32 training: nothing to flag
])
def test_lint_rules(config, errors):
    assert by_severity(lint_deepspeed(config))[0] == errors


def test_misplaced_key_in_a_pydantic_section_explains_the_consequence():
    findings = lint_deepspeed({"bf16": {"enabled": True, "communication_data_type": "fp32"}})
    misplaced = next(f for f in findings if f.key == "bf16.communication_data_type")
    assert "refuses to start" in misplaced.message and "fix:" in str(misplaced)


def test_cli_deepspeed_commands(tmp_path, capsys):
    assert main(["numerics", "lint-deepspeed", str(STORY1)]) == 1
    assert f"{STORY1}: 3 error(s), 2 warning(s)" in capsys.readouterr().out
    assert main(["numerics", "lint-deepspeed", str(LLAVA_ZERO2)]) == 1
    safe = tmp_path / "zero2.json"
    assert main(["numerics", "deepspeed-config", "--stage", "2", "--out", str(safe)]) == 0
    assert main(["numerics", "lint-deepspeed", str(safe)]) == 0
    assert "no findings" in capsys.readouterr().out
    assert main(["numerics", "deepspeed-config", "--stage", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_optimization"]["stage"] == 3
    assert main(["numerics", "lint-deepspeed", str(tmp_path / "missing.json")]) == 2
