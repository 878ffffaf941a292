"""NonFiniteTracer: names the first module with a NaN/Inf in forward or backward, and leaves no trace.

Small `nn.Sequential` models check each rule; a tiny CLIP + LLaMA model checks the same on real
transformers modules (tuple / `ModelOutput` returns, kwargs inputs).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from mmadapt import build_model
from mmadapt.numerics import NonFiniteTracer, find_nonfinite, normalize_module_name, tensor_stats
from mmadapt.synthetic import synthetic_batch

DOWN_PROJ = "backbone.model.layers.1.mlp.down_proj"
ACT_FN = "backbone.model.layers.1.mlp.act_fn"
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class Scale(nn.Module):
    """Multiplies by `value` (nan plants a NaN in every element)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.value


class SetFirst(nn.Module):
    """Overwrites the first element with `value` (one non-finite value)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.view(-1)[0] = self.value
        return y


class InplaceNaN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(float("nan"))


class _PoisonGradFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, value: float) -> torch.Tensor:
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.full_like(grad, ctx.value), None


class PoisonGrad(nn.Module):
    """Identity in forward; its backward returns a gradient full of `value`."""

    def __init__(self, value: float = float("nan")) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PoisonGradFn.apply(x, self.value)


class Wrapper(nn.Module):
    """Stands in for DDP (`module.`), torch.compile (`_orig_mod.`) or a PEFT holder (`model.`)."""

    def __init__(self, attribute: str, inner: nn.Module) -> None:
        super().__init__()
        self.attribute = attribute
        self.add_module(attribute, inner)

    def forward(self, *args, **kwargs):
        return getattr(self, self.attribute)(*args, **kwargs)


def mlp(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), *middle, nn.Linear(8, 3))


def inputs() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def run(model: nn.Module, x: torch.Tensor, **options) -> NonFiniteTracer:
    with NonFiniteTracer(model, **options) as tracer:
        model(x).sum().backward()
    return tracer


def hooks(model: nn.Module) -> dict[tuple[str, str], list[int]]:
    return {(name, d): list(getattr(m, d)) for name, m in model.named_modules() for d in HOOK_DICTS}


def assert_no_hooks(model: nn.Module, before: dict | None = None) -> None:
    """No module hooks at all, or exactly those in `before` (transformers registers some of its own)."""
    left = {key: ids for key, ids in hooks(model).items() if ids}
    assert left == {key: ids for key, ids in (before or {}).items() if ids}, "hooks left behind"
    assert not [n for n, p in model.named_parameters() if p._backward_hooks], "parameter hooks left behind"


def loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def vlm():
    torch.manual_seed(0)
    model = build_model("clip", "mlp2x_gelu", "llama").eval()
    return model, synthetic_batch(model, (1, 1))


# ---- forward --------------------------------------------------------------------------------------
def test_forward_nan_names_the_module_and_its_finite_inputs():
    tracer = run(mlp(nn.ReLU(), Scale(float("nan")), nn.Tanh()), inputs())
    report = tracer.first
    assert report is tracer.first_forward
    assert (report.phase, report.module, report.module_type, report.where) == ("forward", "2", "Scale", "output")
    assert (report.shape, report.dtype, report.nonfinite, report.nan, report.total) == ((5, 8), "float32", 40, 40, 40)
    assert report.inputs_finite and report.input_stats[0]["nonfinite"] == 0
    assert report.input_stats[0]["norm"] > 0 and report.input_stats[0]["min"] >= 0  # after the ReLU
    assert "first non-finite forward output: 2 (Scale)" in str(report)
    assert "produced inside this module" in str(report)


def test_forward_inf_counted_apart_from_nan():
    report = run(mlp(SetFirst(float("inf"))), inputs()).first_forward
    assert (report.module, report.nonfinite, report.nan, report.total) == ("1", 1, 0, 40)
    assert "(0 NaN, 1 Inf)" in str(report)


def test_forward_nan_in_a_transformers_model(vlm):
    model, batch = vlm
    model = copy.deepcopy(model)
    model.get_submodule(DOWN_PROJ).register_forward_hook(lambda module, args, out: out * float("nan"))
    with NonFiniteTracer(model) as tracer:
        model(**batch).loss.backward()
    report = tracer.first
    assert report is tracer.first_forward
    assert (report.phase, report.module, report.module_type) == ("forward", DOWN_PROJ, "Linear")
    assert report.shape[-1] == model.backbone.config.hidden_size and report.nonfinite == report.total
    assert report.inputs_finite and not report.nonfinite_params
    assert tracer.first_backward is not None  # the NaN loss poisons the backward too; `first` prefers forward


def test_nonfinite_inputs_point_outside_submodules():
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.second(self.first(x) * float("nan"))  # functional op between the children

    report = run(Parent(), inputs()).first_forward
    assert report.module == "second" and not report.inputs_finite
    assert "outside any submodule" in str(report)


def test_nonfinite_parameters_are_listed():
    model = mlp()
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    report = run(model, inputs()).first_forward
    assert report.module == "1" and report.inputs_finite and report.nonfinite_params == ["weight"]


def test_inplace_poison_reports_the_input_as_finite_before_the_call():
    report = run(mlp(InplaceNaN()), inputs()).first_forward
    assert (report.module, report.module_type) == ("1", "InplaceNaN")
    stats = report.input_stats[0]
    assert stats["modified_in_place"] and stats["finite_before_call"] and stats["nonfinite"] == 40
    assert report.inputs_finite


def test_nested_outputs_name_the_tensor():
    class Pair(nn.Module):
        def forward(self, x):
            return {"finite": x, "scaled": (x.clone(), x * float("inf"))}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            out = self.pair(x)
            return out["finite"] + out["scaled"][0]

    report = run(Model(), inputs().requires_grad_()).first_forward
    assert (report.module, report.where, report.nan) == ("pair", "output['scaled'][1]", 0)


# ---- backward -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_backward_names_the_output_and_its_consumer(value):
    tracer = run(mlp(PoisonGrad(value), nn.Tanh()), inputs())
    report = tracer.first
    assert tracer.first_forward is None and report is tracer.first_backward
    assert (report.phase, report.module, report.module_type, report.consumers) == ("backward", "0", "Linear", ["1"])
    assert report.nonfinite == report.total == 40 and report.nan == (40 if value != value else 0)
    assert "first non-finite backward gradient: w.r.t. output of 0 (Linear)" in str(report)


def test_backward_nan_in_a_transformers_model(vlm):
    model, batch = vlm
    model = copy.deepcopy(model)
    mlp_block = model.get_submodule(ACT_FN.rsplit(".", 1)[0])
    mlp_block.act_fn = nn.Sequential(mlp_block.act_fn, PoisonGrad())
    with NonFiniteTracer(model) as tracer:
        model(**batch).loss.backward()
    assert tracer.first_forward is None
    report = tracer.first
    assert (report.phase, report.module, report.module_type) == ("backward", f"{ACT_FN}.0", "SiLUActivation")
    assert report.consumers == [f"{ACT_FN}.1"]
    assert report.input_stats[0]["nonfinite"] == report.total


class _PoisonWeightGradFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (weight,) = ctx.saved_tensors
        return grad * weight, torch.full_like(weight, float("inf"))


class PoisonWeightGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PoisonWeightGradFn.apply(x, self.weight)


def test_parameter_gradient_is_checked():
    report = run(mlp(PoisonWeightGrad()), inputs()).first
    assert (report.phase, report.module, report.where, report.call) == ("backward", "1", "parameter weight", None)
    assert report.nonfinite == 8 and report.nan == 0
    assert "w.r.t. parameter weight of 1 (PoisonWeightGrad)" in str(report)


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.inner, self.use_reentrant = inner, use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant):
    model = mlp(Checkpointed(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), PoisonGrad(), nn.Linear(8, 8)), use_reentrant))
    report = run(model, inputs().requires_grad_()).first
    assert (report.phase, report.module, report.consumers) == ("backward", "1.inner.1", ["1.inner.2"])
    assert_no_hooks(model)


def test_loss_side_nan_has_no_consumer():
    model = mlp()
    with NonFiniteTracer(model) as tracer:
        (model(inputs()).sum() * float("nan")).backward()
    report = tracer.first
    assert (report.phase, report.module, report.consumers) == ("backward", "1", [])
    assert "functional code between modules" in str(report)


def test_all_events_in_firing_order_without_stop_at_first():
    tracer = run(mlp(Scale(float("nan")), nn.Linear(8, 8)), inputs(), stop_at_first=False)
    forward = [e.module for e in tracer.events if e.phase == "forward"]
    assert forward == ["1", "2", "3"]  # the root returns "3"'s tensor: reported once, innermost
    backward = [(e.module, e.where, e.consumers) for e in tracer.events if e.phase == "backward"]
    assert backward[0] == ("3", "parameter weight", [])  # its forward input was NaN
    assert ("0", "output", ["1"]) in backward  # Scale's backward multiplies by NaN


# ---- no false positives, no side effects ----------------------------------------------------------
def test_clean_run_is_silent_and_bitwise_identical(vlm):
    model, batch = vlm
    loss, grads = loss_and_grads(model, batch)
    before = hooks(model)  # after a forward: transformers adds its output-recording hooks on the first call
    with NonFiniteTracer(model) as tracer:
        traced_loss, traced_grads = loss_and_grads(model, batch)
    assert tracer.first is None and tracer.events == []
    assert_no_hooks(model, before)
    assert torch.equal(loss, traced_loss) and grads.keys() == traced_grads.keys()
    assert all(torch.equal(grads[name], traced_grads[name]) for name in grads)


def test_inplace_ops_keep_autograd_and_results():
    model = mlp(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True))
    x = inputs().requires_grad_()
    model(x).sum().backward()
    expected = [p.grad.clone() for p in (x, *model.parameters())]
    model.zero_grad(set_to_none=True)
    x.grad = None
    assert run(model, x).first is None
    assert all(torch.equal(a, b.grad) for a, b in zip(expected, (x, *model.parameters()), strict=True))


def test_hooks_removed_when_the_body_raises():
    model = mlp(nn.Identity())
    x = inputs().requires_grad_()
    with pytest.raises(ZeroDivisionError), NonFiniteTracer(model):
        model(x)
        assert model[1]._forward_hooks
        1 / 0  # noqa: B018
    assert_no_hooks(model)
    assert not x._backward_hooks  # the leaf went through Identity and got a gradient hook inside


def test_backward_after_exit_is_not_traced():
    model = mlp(PoisonGrad())
    with NonFiniteTracer(model) as tracer:
        out = model(inputs())
    out.sum().backward()
    assert tracer.first is None


def test_find_nonfinite_and_phase_switches():
    model = mlp(PoisonGrad(), Scale(float("nan")))
    x = inputs()
    assert find_nonfinite(model, lambda: model(x).sum().backward()).phase == "forward"
    backward = find_nonfinite(model, lambda: model(x).sum().backward(), forward=False)
    assert (backward.phase, backward.module, backward.where) == ("backward", "3", "parameter weight")
    assert find_nonfinite(model, lambda: model(x).sum().backward(), backward=False).module == "2"
    with pytest.raises(ValueError, match="nothing to trace"):
        NonFiniteTracer(model, forward=False, backward=False)


def test_tracer_is_reusable_but_not_reentrant():
    model = mlp(Scale(float("nan")))
    tracer = NonFiniteTracer(model)
    with tracer, pytest.raises(RuntimeError, match="already active"), tracer:
        pass
    assert_no_hooks(model)
    with tracer:
        model(inputs())
    assert tracer.first.module == "1"


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_forward_only_modes(mode):
    model = mlp(Scale(float("nan")))
    with mode(), NonFiniteTracer(model) as tracer:
        model(inputs())
    assert tracer.first.module == "1"
    assert_no_hooks(model)


# ---- names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "plain"), [
    ("layers.0.mlp", "layers.0.mlp"),
    ("module.layers.0", "layers.0"),
    ("module._orig_mod.layers.0", "layers.0"),
    ("base_model.model.backbone.lm_head", "backbone.lm_head"),
    ("module.base_model.model.layers.0", "layers.0"),
    ("layers.0._fsdp_wrapped_module.mlp._checkpoint_wrapped_module.fc", "layers.0.mlp.fc"),
    ("layers.module.fc", "layers.module.fc"),  # only a leading `module` is a wrapper
    ("module", ""),
])
def test_normalize_module_name(raw, plain):
    assert normalize_module_name(raw) == plain


@pytest.mark.parametrize("wrap", [
    lambda m: Wrapper("module", m),
    lambda m: Wrapper("_orig_mod", m),
    lambda m: Wrapper("base_model", Wrapper("model", m)),
    lambda m: Wrapper("module", Wrapper("base_model", Wrapper("model", m))),
])
def test_wrapped_models_report_plain_names(wrap):
    assert run(wrap(mlp(nn.ReLU(), Scale(float("nan")))), inputs()).first.module == "2"


def test_wrapped_transformers_model_reports_plain_name(vlm):
    model, batch = vlm
    model = copy.deepcopy(model)
    model.get_submodule(DOWN_PROJ).register_forward_hook(lambda module, args, out: out * float("nan"))
    wrapped = Wrapper("module", model)
    with NonFiniteTracer(wrapped, backward=False) as tracer:
        wrapped(**batch)
    assert tracer.first.module == DOWN_PROJ


def test_tensor_stats_skip_nonfinite_entries():
    stats = tensor_stats(torch.tensor([3.0, -4.0, float("nan"), float("inf")]), "x")
    assert (stats["nonfinite"], stats["nan"], stats["min"], stats["max"]) == (2, 1, -4.0, 3.0)
    assert stats["mean_abs"] == 3.5 and stats["norm"] == 5.0
    assert tensor_stats(torch.full((2,), float("nan")))["norm"] is None
