"""`mmadapt plan`: a run's per-device memory before it starts (mmadapt.train.plan).

The counted parts (parameters, gradients, AdamW state, sharding) equal the model's own; the whole prediction equals
the measured tensor peak of a real training step (live tensor bytes, `LiveBytes`, deterministic) for tiny models of
every kind of run. The real-width validations are measurements, in `benchmarks/bench_plan.py`: against `VmHWM` (its
table in benchmarks/README.md), and the examples' plans on the GPUs their headers name against docs/training.md's
table (`--examples`; tests/test_benchmarks.py runs both in their quick form). QLoRA: tests/test_plan_qlora.py.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import write_run

from mmadapt.cli import main
from mmadapt.quantize import is_nf4
from mmadapt.synthetic import synthetic_batch
from mmadapt.train.config import RunConfig
from mmadapt.train.optim import enable_activation_checkpointing, parameter_groups
from mmadapt.train.plan import LiveBytes, parse_size, predict
from mmadapt.train.run import build_model_from
from mmadapt.train.stages import apply_stages
from mmadapt.train.trainer import upcast_trainable

QWEN = {"encoder": "qwen3_5_vit", "projector": "qwen_merger", "backbone": "qwen3_5"}
LONG_LLAMA = {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": {"name": "llama", "preset": "tiny", "options": {
    "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 688}}}
LONG = {"max_length": 1024, "batch_size": 4, "spread": 24}  # spread: each row 24 tokens shorter than the one before
RUNS = {
    "qwen3_5 full": ({"model": QWEN}),
    "qwen3_5 LoRA": ({"model": QWEN, "stages": {"backbone": "lora"}}),
    "llava stage 1": ({"model": {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama"},
                       "stages": {"preset": "llava-stage1"}, "data": {"batch_size": 3}}),
    "qwen3_5 checkpointing, encoder trained": ({"model": QWEN, "stages": {"encoder": "full"},
                                                "train": {"activation_checkpointing": "all"}}),
    "qwen3_5 packed": ({"model": QWEN, "data": {"packing": True, "batch_size": 4, "max_length": 96,
                                               "max_tokens": 192}}),
    "qwen3_vl DeepStack": ({"model": {**QWEN, "encoder": "qwen3_vl_vit", "backbone": "qwen3_vl"}}),
    "qwen3_5_moe": ({"model": {**QWEN, "backbone": "qwen3_5_moe"}}),
    "llava bf16-autocast": ({"model": {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama"},
                             "precision": {"policy": "bf16-autocast"}}),
    # long samples on attention-heavy backbones (issue 33), rows of unequal lengths (padding): the LLM at width 256
    # with 4 heads (attention's share of a layer's bytes at 1,024 tokens as at width 2,048 with 32 heads)
    "llama 4 x 1024, LoRA, checkpointing": ({"model": LONG_LLAMA, "stages": {"preset": "lora"},
                                             "train": {"activation_checkpointing": ["backbone"]}, "data": LONG}),
    "llama 2 x 2048, full": ({"model": LONG_LLAMA, "data": {"max_length": 2048, "batch_size": 2, "spread": 24}}),
    "qwen3_vl 2 x 2048, LoRA": ({"model": {**QWEN, "encoder": "qwen3_vl_vit", "backbone": {
        "name": "qwen3_vl", "preset": "tiny", "options": {"hidden_size": 256, "intermediate_size": 688}}},
        "stages": {"backbone": "lora"}, "data": {"max_length": 2048, "batch_size": 2, "spread": 24}}),
}


@pytest.fixture(autouse=True)
def probe_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path_factory.getbasetemp() / "mmadapt-cache"))


def run_config(spec: dict) -> RunConfig:
    data = {"max_length": 128, "batch_size": 2, **spec.get("data", {})}
    data.pop("spread", None)
    stages = spec.get("stages", {})
    if "preset" not in stages:
        stages = {"encoder": "frozen", "projector": "full", "backbone": "full", **stages}
    return RunConfig.from_dict({"model": spec["model"], "data": data, "stages": stages,
                                "train": spec.get("train", {}), "precision": spec.get("precision", {})})


def built(config: RunConfig):
    torch.manual_seed(0)
    model = build_model_from(config)
    apply_stages(model, config.stages, config.lora, config.quantization)
    upcast_trainable(model)
    return model


def unique_bytes(params) -> int:
    """Bytes of the parameters, each once; an NF4 weight's as its storages hold them (codes, scales, table)."""
    counted = {}
    for p in params:
        if is_nf4(p):
            inner = [getattr(p, name).untyped_storage() for name in p.__tensor_flatten__()[0]]
            counted.update({s.data_ptr(): s.nbytes() for s in inner})
        else:
            counted[id(p)] = p.numel() * p.element_size()
    return sum(counted.values())


def measured_peak(config: RunConfig, plan, spread: int = 0) -> int:
    """Parameters + AdamW's state + the live-tensor peak of a training step after the first, on the plan's
    micro-batch: `batch_size` samples, one image each at the plan's size, text filling `max_length` (`spread`: each
    sample that many tokens shorter than the one before, so that rows are padded)."""
    from mmadapt.data import Collator
    from mmadapt.data.processors import processor_for
    from mmadapt.synthetic import synthetic_samples

    model = built(config)
    if config.train.activation_checkpointing:
        enable_activation_checkpointing(model, config.train.activation_checkpointing)
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model, model, lr=1e-4, weight_decay=0.0, lr_by_part={}))
    d, side = config.data, plan.workload.image_side
    text = d.max_length - processor_for(model).tokens_for_size(side or 0, side or 0) - 2
    sides = None if side is None else [side] * d.batch_size
    if d.packing:
        samples = synthetic_samples(model, [1] * d.batch_size, image_sides=sides, text_lengths=[text] * d.batch_size)
        batch = Collator.for_model(model, 0, max_tokens=d.max_tokens)(samples)
    else:
        batch = synthetic_batch(model, [1] * d.batch_size, image_sides=sides,
                                text_lengths=[text - spread * b for b in range(d.batch_size)])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.precision.policy == "bf16-autocast"):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()  # the first step allocates AdamW's state; the second is every later one
    optimizer.zero_grad(set_to_none=True)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.precision.policy == "bf16-autocast")
    with LiveBytes() as live:
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
    return unique_bytes(model.parameters()) + state + live.peak


@pytest.mark.parametrize("name", list(RUNS))
@pytest.mark.slow
def test_the_prediction_equals_the_measured_tensor_peak_of_a_training_step(name):
    config = run_config(RUNS[name])
    plan = predict(config, gpus=1, device="cpu")
    model = built(config)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert plan.per_gpu["parameters"] == unique_bytes(model.parameters())
    assert plan.per_gpu["gradients"] == unique_bytes(trained)  # fp32 master weights: 4 bytes each
    assert plan.per_gpu["optimizer"] == 2 * unique_bytes(trained) + 2 * max(p.numel() * 4 for p in trained)
    measured = measured_peak(config, plan, RUNS[name].get("data", {}).get("spread", 0))
    # measured at its own length; the plan extrapolates from its three short probe lengths and sweeps the real depth
    assert plan.per_gpu["total"] == pytest.approx(measured, rel=0.15), (plan.table(), measured)


def test_eager_attention_is_planned_quadratic_and_sdpa_linear():
    """Eager attention keeps (B, H, L, L) probabilities per layer: the probe's three lengths show the quadratic term
    and the plan says so, sized as the tensors are; SDPA (no mask for right-padded rows) is linear."""
    eager = {**LONG_LLAMA, "backbone": {**LONG_LLAMA["backbone"], "options": {
        **LONG_LLAMA["backbone"]["options"], "attn_implementation": "eager"}}}
    quadratic = predict(run_config({"model": eager, "data": LONG}), gpus=1, device="cpu")
    linear = predict(run_config({"model": LONG_LLAMA, "data": LONG}), gpus=1, device="cpu")
    assert "linear in length" in linear.attention["backbone"] and "eager" not in linear.attention["backbone"]
    assert "eager" in quadratic.attention["backbone"] and "quadratic in length" in quadratic.attention["backbone"]
    probabilities = 4 * 4 * 1024 * 1024 * 4  # B x H x L x L fp32, the softmax's output each of the 2 layers keeps
    extra = quadratic.activations_without_checkpointing - linear.activations_without_checkpointing
    assert extra == pytest.approx(2 * probabilities, rel=0.1), (extra / probabilities, quadratic.table())


def test_sharding_divides_what_fsdp2_shards_and_ddp_adds_its_buckets():
    config = run_config(RUNS["qwen3_5 full"])
    one, four = predict(config, gpus=1), predict(config, gpus=4)
    assert four.strategy == "fsdp2" and four.per_gpu["parameters"] == one.per_gpu["parameters"] // 4
    assert four.per_gpu["gradients"] == one.per_gpu["gradients"] // 4
    assert four.per_gpu["sharding"] > 0 and four.per_gpu["total"] < one.per_gpu["total"]
    ddp = predict(RunConfig.from_dict({**config.to_dict(), "distributed": {"strategy": "ddp"}}), gpus=4)
    assert ddp.per_gpu["parameters"] == one.per_gpu["parameters"]
    assert ddp.per_gpu["sharding"] == one.per_gpu["gradients"]  # the gradient buckets


def test_checkpointing_keeps_only_block_inputs():
    plan = predict(run_config(RUNS["qwen3_5 checkpointing, encoder trained"]), gpus=1, device="cpu")
    assert plan.activations_with_checkpointing < plan.activations_without_checkpointing / 2
    assert plan.checkpointing == ["backbone", "encoder"]


def test_the_command_prints_a_table_and_json_and_says_whether_it_fits(tmp_path, capsys):
    records = [{"id": f"s{k}", "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hi."}]}
               for k in range(50)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    path = write_run(tmp_path / "run.yaml", model={"encoder": "qwen3_5_vit", "projector": "qwen_merger",
                                                    "backbone": "qwen3_5"},
                     data={"max_length": 128, "batch_size": 2, "train": str(tmp_path / "train.jsonl")})
    assert main(["plan", str(path), "--gpus", "2", "--gpu-memory", "1TiB"]) == 0
    out = capsys.readouterr().out
    assert "2 x cuda 1024.00 GiB, fsdp2" in out and "fits: yes" in out and "margin" in out
    assert "host, per rank (data loading): 0.00 GiB private" in out and "8 B x 50 samples" in out
    assert main(["plan", str(path), "data.batch_size=4", "--gpu-memory", "1MiB", "--json"]) == 4
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is False and report["workload"]["images"] == 4
    assert report["host"]["sampler"] == 8 * 50 and report["host"]["mapped"] > 0
    assert set(report["per_gpu"]) >= {"parameters", "gradients", "optimizer", "activations", "total"}
    assert report["per_gpu"]["total"] >= sum(report["per_gpu"][k] for k in ("parameters", "gradients"))
    assert {s["change"] for s in report["suggestions"]} >= {"train.activation_checkpointing: all", "--gpus 2"}
    assert main(["plan", str(path), "--gpu-memory", "1MiB"]) == 4
    assert "fits: NO" in capsys.readouterr().out
    assert logging.root.manager.disable == logging.NOTSET  # the command quiets its own logging only


def test_a_missing_checkpoint_is_planned_from_its_declared_preset_or_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{backbone: {{name: llama, pretrained: {tmp_path}/vicuna}}, encoder: clip, "
                    "projector: mlp2x_gelu}\n")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "declares no preset: give the preset of its architecture" in err
    path.write_text(f"model: {{backbone: {{name: llama, preset: tiny, pretrained: {tmp_path}/vicuna}}, "
                    "encoder: clip, projector: mlp2x_gelu}\n")
    assert main(["plan", str(path)]) == 0
    assert f"model.backbone.pretrained {tmp_path}/vicuna is not here: planned from preset 'tiny'" in \
        capsys.readouterr().out


def test_a_dpo_run_is_planned_with_two_rows_per_pair_and_one_image():
    from mmadapt.train.plan.workloads import workload

    sft = RunConfig.load(None, ["data.batch_size=3", "data.max_length=512"])
    dpo = RunConfig.load(None, ["data.batch_size=3", "data.max_length=512", "train.objective=dpo"])
    model = build_model_from(sft)
    one, two = workload(sft, model), workload(dpo, model)
    assert (two.rows, two.tokens, two.supervised) == (2 * one.rows, 2 * one.tokens, 2 * one.supervised)
    assert two.images == one.images == 3


def test_sizes_parse():
    assert parse_size("80GiB") == parse_size("80GB") == 80 * 1024**3
    assert parse_size("24576MiB") == 24 * 1024**3
    with pytest.raises(ValueError, match="give a size such as 80GiB"):
        parse_size("lots")


def test_pretrained_parts_and_saved_models_are_planned_without_reading_a_weight(tmp_path, monkeypatch):
    import mmadapt.weights

    config = run_config(RUNS["qwen3_5 full"])
    model = built(config)
    model.save_pretrained(tmp_path / "model")
    expected = predict(config, gpus=1, device="cpu").per_gpu

    def no_weights(*args, **kwargs):
        raise AssertionError("plan read a weight")

    monkeypatch.setattr(mmadapt.weights, "load_part", no_weights)
    whole = run_config({"model": {"pretrained": str(tmp_path / "model")}})
    assert predict(whole, gpus=1, device="cpu").per_gpu["parameters"] == expected["parameters"]
    parts = run_config({"model": {p: {"name": QWEN[p], "pretrained": str(tmp_path / "model")} for p in QWEN}})
    assert predict(parts, gpus=1, device="cpu").per_gpu == expected
    # a pretrained part loads in its `dtype`, here or not here yet (planned from its preset)
    tower = sum(p.numel() * 2 for p in model.encoder.parameters())
    for where in (str(tmp_path / "model"), str(tmp_path / "not-here")):
        bf16 = run_config({"model": {**QWEN, "encoder": {"name": "qwen3_5_vit", "preset": "tiny", "pretrained": where,
                                                         "dtype": "bfloat16"}}})
        assert predict(bf16, gpus=1, device="cpu").parameters_by_dtype["bfloat16"] == tower


def test_a_probe_keeps_fewer_experts_when_they_are_large_with_the_same_plan(monkeypatch):
    import mmadapt.train.plan.probe as plan_module

    config = run_config(RUNS["qwen3_5_moe"])
    every = predict(config, gpus=1, device="cpu")
    monkeypatch.setattr(plan_module, "PROBE_EXPERT_BYTES", 1)  # keep 2 x top-k experts of the tiny model's 8
    probe = plan_module.run_probe(config)
    assert plan_module.probe_model(config).backbone.config.num_experts == 4
    fewer = predict(config, gpus=1, device="cpu", probe=probe)
    assert fewer.per_gpu["parameters"] == every.per_gpu["parameters"]  # counted on the whole model
    assert fewer.per_gpu["total"] == pytest.approx(every.per_gpu["total"], rel=0.05)


def test_half_precision_arithmetic_in_float32_counts_the_same_bytes_and_gives_the_same_dtypes():
    """The probe's `WideArithmetic`: bf16 matmuls, convolutions and attention computed in float32 (fast on CPUs
    without bf16 instructions) leave every count and every dtype as the bf16 step has them; values within bf16
    rounding (atol 0.05 on outputs of order 1)."""
    from mmadapt.train.plan.counting import WideArithmetic

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 16, 4, stride=4, dtype=torch.bfloat16)
    linear = torch.nn.Linear(16, 48, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 16, 16, dtype=torch.bfloat16)

    def step(wide: bool) -> tuple:
        conv.zero_grad(set_to_none=True)
        linear.zero_grad(set_to_none=True)
        with WideArithmetic() if wide else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with LiveBytes() as live:
                h = conv(x).flatten(2).transpose(1, 2)
                q, k, v = linear(h).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.float().square().mean().backward()
        return live.peak, out.detach(), conv.weight.grad, linear.weight.grad

    narrow, wide = step(False), step(True)
    assert wide[0] == narrow[0]
    for a, b in zip(wide[1:], narrow[1:], strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)


def test_the_fit_recovers_a_quadratic_term_and_keeps_lines_linear():
    from mmadapt.train.plan.segments import at, fit

    # a vision tower's images (64, 256, 576 patches, one each) and rows of tokens, packed two samples per row
    images = [{"patches": p, "images": 1, "y": 100 + 50 * p + 3 * p * p} for p in (64, 256, 576)]
    assert fit(images, "patches", lambda p: p["y"], "images") == pytest.approx((100, 50, 3))
    rows = [{"tokens": t, "rows": 1, "y": 7 + 20 * t + 0.5 * t * t} for t in (66, 178, 402)]
    line = fit(rows, "tokens", lambda p: p["y"], "rows")
    assert at(line, (4 * 1024, 1024)) == pytest.approx(7 + 20 * 4096 + 0.5 * 4096 * 1024)  # 4 rows of 1,024
    linear = [{"tokens": t, "rows": 1, "y": 7 + 20 * t + (t % 3)} for t in (66, 178, 402)]  # rounding, not attention
    assert fit(linear, "tokens", lambda p: p["y"], "rows")[2] == 0
    fixed = [{"patches": 576, "images": 1, "y": 576 * 9} for _ in range(3)]  # a fixed-size encoder: per image
    assert fit(fixed, "patches", lambda p: p["y"], "images") == (0.0, 9.0, 0.0)


@pytest.mark.parametrize("parts", [("qwen3_5_vit", "qwen_merger", "qwen3_5"), ("clip", "mlp2x_gelu", "llama")])
def test_the_rollout_cache_is_counted_as_transformers_holds_it(parts):
    """`cache_bytes` (the plan's GRPO rollout) against the cache a real generation leaves: the bytes of every tensor
    of the backbone's cache after a prefill of 6 rows x 20 tokens and 5 steps (Qwen3.5: Gated DeltaNet conv and
    recurrent states beside the attention layer's keys and values), exactly."""
    import mmadapt
    from mmadapt.generation import cache_bytes

    torch.manual_seed(0)
    model = mmadapt.build_model(*parts).eval()
    ids = torch.randint(0, 100, (6, 20))
    with torch.no_grad():
        out = model.backbone(input_ids=ids, use_cache=True)
        for _ in range(5):
            out = model.backbone(input_ids=ids[:, :1], cache=out.cache, use_cache=True)
    held = 0
    for layer in out.cache.layers:
        for name in ("keys", "values"):
            value = getattr(layer, name, None)
            held += value.nbytes if isinstance(value, torch.Tensor) and value.numel() else 0
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            held += sum(t.nbytes for t in (states.values() if isinstance(states, dict) else states or [])
                        if isinstance(t, torch.Tensor))
    assert held > 0 and cache_bytes(model, 6, 25, 4) == held


def test_a_grpo_run_is_planned_with_g_rows_per_prompt_one_image_and_its_rollout():
    from mmadapt.generation import cache_bytes
    from mmadapt.train.plan.workloads import workload

    overrides = ["data.batch_size=2", "data.max_length=512"]
    sft = RunConfig.load(None, overrides)
    grpo = RunConfig.load(None, [*overrides, "train.objective=grpo", "grpo.rewards=[accuracy]",
                                 "grpo.num_generations=8"])
    model = build_model_from(sft)
    one, eight = workload(sft, model), workload(grpo, model)
    assert (eight.rows, eight.tokens) == (8 * one.rows, 8 * one.tokens) and eight.images == one.images == 2
    plan = predict(grpo, gpus=1, device="cpu")
    assert plan.per_gpu["rollout"] >= cache_bytes(model, 16, 512, 4) > 0
    assert predict(grpo, gpus=4, device="cpu").per_gpu["rollout"] == plan.per_gpu["rollout"]  # each rank's own rows
    assert "rollout" in plan.table() and "rollout" not in predict(sft, gpus=1, device="cpu").per_gpu
