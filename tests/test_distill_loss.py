"""On-policy distillation's arithmetic: `generalized_jsd` equals trl 1.16's `GKDTrainer.generalized_jsd_loss` in value
and gradient (fp32, 1e-5) for beta 0, 0.5, 1 and temperature 1, 0.7 with masked (-100) positions and every
reduction; beta 0 is KL(teacher || student) and beta 1 KL(student || teacher); `chunked_generalized_jsd` from hidden
states equals it in value and in the gradients of the student's states and head (plain and LoRA), and its peak
memory over forward and backward is a few chunks' (C, V) logits, where the unchunked path holds (N, V) ones.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mmadapt.train.objectives.distill import chunked_generalized_jsd, generalized_jsd
from mmadapt.train.objectives.distill.loss import chunk_divergence

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")

ATOL = 1e-5
B, L, V = 3, 5, 11
BETAS = [0.0, 0.5, 1.0]
TEMPERATURES = [1.0, 0.7]


def logits_and_labels() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L, V) student and teacher logits, (B, L) labels with -100 at prompt / padding positions (row 2: none kept
    but one)."""
    g = torch.Generator().manual_seed(0)
    student, teacher = 3 * torch.randn(B, L, V, generator=g), 3 * torch.randn(B, L, V, generator=g)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[0, :2] = -100
    labels[1, -1] = -100
    labels[2, 1:] = -100
    return student, teacher, labels


def trl_jsd(student, teacher, labels, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    from trl.experimental.gkd import GKDTrainer

    student = student.clone().requires_grad_(True)
    loss = GKDTrainer.generalized_jsd_loss(student, teacher, labels, **kwargs)
    loss.sum().backward()
    return loss.detach(), student.grad


def our_jsd(student, teacher, mask, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    student = student.clone().requires_grad_(True)
    loss = generalized_jsd(student, teacher, mask, **kwargs)
    loss.sum().backward()
    return loss.detach(), student.grad


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_equals_trls_gkd_loss(beta, temperature):
    """batchmean over the kept positions: value and gradient w.r.t. the student's logits equal trl's."""
    student, teacher, labels = logits_and_labels()
    ref_loss, ref_grad = trl_jsd(student, teacher, labels, beta=beta, temperature=temperature)
    loss, grad = our_jsd(student, teacher, labels != -100, beta=beta, temperature=temperature)
    assert ref_loss > 0.1
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("masked", [True, False])
def test_every_reduction_equals_trls(reduction, masked):
    """Each reduction, with and without a mask (without: trl's batchmean divides by B), beta 0.5, temperature 0.7."""
    student, teacher, labels = logits_and_labels()
    ref_loss, ref_grad = trl_jsd(student, teacher, labels if masked else None, beta=0.5, temperature=0.7,
                                 reduction=reduction)
    loss, grad = our_jsd(student, teacher, labels != -100 if masked else None, beta=0.5, temperature=0.7,
                         reduction=reduction)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=0)


def test_beta_0_is_forward_kl_and_beta_1_reverse_kl():
    """trl's convention, by hand: beta 0 = KL(teacher || student), beta 1 = KL(student || teacher) (per position,
    summed over V); beta 0.5 is symmetric in the two."""
    student, teacher, _ = logits_and_labels()
    s, t = student.log_softmax(-1), teacher.log_softmax(-1)
    forward, reverse = (t.exp() * (t - s)).sum(-1), (s.exp() * (s - t)).sum(-1)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=0.0, reduction="none").sum(-1), forward)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=1.0, reduction="none").sum(-1), reverse)
    assert not torch.allclose(forward, reverse)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta=0.5, reduction="none"),
                               generalized_jsd(teacher, student, beta=0.5, reduction="none"))


def test_no_kept_position_gives_zero_like_trl():
    student, teacher, labels = logits_and_labels()
    labels[:] = -100
    ref_loss, _ = trl_jsd(student, teacher, labels)
    loss, grad = our_jsd(student, teacher, labels != -100)
    assert loss.item() == 0.0 == ref_loss.item()
    assert not grad.any()


def test_bad_inputs_are_named():
    student, teacher, labels = logits_and_labels()
    with pytest.raises(ValueError, match="same tokenizer"):
        generalized_jsd(student, teacher[..., :-1])
    with pytest.raises(ValueError, match="same positions"):
        generalized_jsd(student, teacher[:, :-1])
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        generalized_jsd(student, teacher, labels)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        generalized_jsd(student, teacher, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generalized_jsd(student, teacher, temperature=0.0)
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        generalized_jsd(student, teacher, reduction="avg")


# ---- chunked from hidden states ----------------------------------------------------------------------------------
N, D, D_T, VOCAB, CHUNK = 61, 6, 8, 50, 8


class Head(nn.Module):
    """An output head as a model holds it (`lm_head`), so peft can put LoRA on it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(width, VOCAB)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(states)


def heads(lora: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    student, teacher = Head(D), Head(D_T)
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        student = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"]), student)
        with torch.no_grad():
            student.lm_head.lora_B.default.weight.normal_()  # peft starts B at 0: make the adapter count
    return student, teacher


def states() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return 2 * torch.randn(N, D, generator=g), 2 * torch.randn(N, D_T, generator=g)


def student_gradients(loss: torch.Tensor, student_states: torch.Tensor, head: nn.Module) -> dict[str, torch.Tensor]:
    trained = {name: p for name, p in head.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, [student_states, *trained.values()])
    return dict(zip(["states", *trained], grads, strict=True))


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_chunked_equals_full_logits(beta, temperature, lora):
    """The chunked sum over N positions (chunks of 8, the last shorter), divided by N as a step divides it by its
    tokens, equals `generalized_jsd`'s batchmean over the full (N, V) logits, and so do the gradients of the
    student's states and of every trained head weight (LoRA's A and B, the base frozen, when the head has an
    adapter). (The sums, about 140, differ by one fp32 ulp, 1.5e-5.)"""
    student_head, teacher_head = heads(lora)
    student_states, teacher_states = (s.requires_grad_(i == 0) for i, s in enumerate(states()))
    chunked = chunked_generalized_jsd(student_states, student_head, teacher_states, teacher_head, beta=beta,
                                      temperature=temperature, chunk_size=CHUNK) / N
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_states)
    full = generalized_jsd(student_head(student_states), teacher_logits, beta=beta, temperature=temperature)
    assert full > 0.1
    torch.testing.assert_close(chunked, full, atol=ATOL, rtol=0)
    ours, reference = student_gradients(chunked, student_states, student_head), student_gradients(
        full, student_states, student_head)
    trained = {"lm_head.lora_A.default.weight", "lm_head.lora_B.default.weight"} if lora else {
        "lm_head.weight", "lm_head.bias"}
    assert set(ours) == set(reference) == {"states", *trained}
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], atol=ATOL, rtol=0, msg=name)
    assert all(p.grad is None for p in teacher_head.parameters())


def test_chunked_with_no_position_is_zero_through_the_head():
    student_head, teacher_head = heads(lora=False)
    loss = chunked_generalized_jsd(torch.zeros(0, D), student_head, torch.zeros(0, D_T), teacher_head, chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0 and not student_head.lm_head.weight.grad.any()


def test_chunked_bad_inputs_are_named():
    student_head, teacher_head = heads(lora=False)
    student_states, teacher_states = states()
    with pytest.raises(ValueError, match="same tokenizer"):
        chunked_generalized_jsd(student_states, student_head, teacher_states, nn.Linear(D_T, VOCAB + 1))
    with pytest.raises(ValueError, match="same N positions"):
        chunked_generalized_jsd(student_states, student_head, teacher_states[:-1], teacher_head)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_generalized_jsd(student_states, student_head, teacher_states, teacher_head, chunk_size=0)


class PeakMemory(TorchDispatchMode):
    """The peak of the bytes held by the tensors that operations make while the mode is active, forward and backward
    alike: each new storage counts from the operation that makes it until its last tensor dies (autograd keeping a
    tensor for the backward keeps it alive); an output that aliases an input's storage (a view) adds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, live tensors]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for tensor in (x for x in tree_leaves(out) if isinstance(x, torch.Tensor)):
            self.hold(tensor, inputs)
        return out

    def hold(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        key = tensor.untyped_storage().data_ptr()
        if key == 0 or (key in inputs and key not in self.live):
            return
        entry = self.live.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(tensor, self.release, key)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


def peak_bytes(loss_of, n: int) -> int:
    """The peak of `PeakMemory` over the forward and the backward of `loss_of(student_states, student_head,
    teacher_states, teacher_head)` at n positions."""
    student_head, teacher_head = heads(lora=False)
    g = torch.Generator().manual_seed(2)
    student_states = torch.randn(n, D, generator=g, requires_grad=True)
    teacher_states = torch.randn(n, D_T, generator=g)
    with PeakMemory() as memory:
        loss_of(student_states, student_head, teacher_states, teacher_head).backward()
    return memory.peak


def test_chunked_peak_memory_is_a_chunks_not_n_by_v():
    """Peak memory O(C x V + N x D): over the forward and the backward (which recomputes one chunk's logits at a
    time) the chunked path holds at most 16 chunk-sized (C, V) fp32 buffers besides a few (N, D) ones (the states'
    gradient); the full logits' path, and the same chunks without the checkpoint (every chunk's logits kept for the
    backward), each hold more than the (N, V) logits, which the same probe sees."""
    n, chunk_bytes, logits_bytes = 32 * CHUNK, CHUNK * VOCAB * 4, 32 * CHUNK * VOCAB * 4

    def chunked(*args):
        return chunked_generalized_jsd(*args, beta=0.5, temperature=0.7, chunk_size=CHUNK)

    def unchunked(student_states, student_head, teacher_states, teacher_head):
        with torch.no_grad():
            teacher_logits = teacher_head(teacher_states)
        return generalized_jsd(student_head(student_states), teacher_logits, beta=0.5, temperature=0.7,
                               reduction="sum")

    def without_checkpoint(student_states, student_head, teacher_states, teacher_head):
        return sum(chunk_divergence(student_states[k : k + CHUNK], student_head, teacher_states[k : k + CHUNK],
                                    teacher_head, 0.5, 0.7) for k in range(0, n, CHUNK))

    assert peak_bytes(chunked, n) <= 16 * chunk_bytes + 3 * n * D * 4
    assert peak_bytes(unchunked, n) > logits_bytes
    assert peak_bytes(without_checkpoint, n) > logits_bytes


def test_the_probe_sees_the_backwards_recomputed_chunks():
    """The probe counts what the backward makes (the checkpoint's recomputed (C, V) logits), not only the forward."""
    student_head, teacher_head = heads(lora=False)
    student_states, teacher_states = states()
    loss = chunked_generalized_jsd(student_states.requires_grad_(True), student_head, teacher_states, teacher_head,
                                   chunk_size=CHUNK)
    with PeakMemory() as memory:
        loss.backward()
    assert memory.peak >= CHUNK * VOCAB * 4


def test_chunked_takes_bf16_heads_and_returns_fp32():
    """bf16 heads and states: the divergence is computed from the logits upcast to fp32 (a fp32 scalar equal to the
    full path on the same upcast logits), and the gradients come back in the states' and weights' bf16."""
    student_head, teacher_head = (h.to(torch.bfloat16) for h in heads(lora=False))
    student_states, teacher_states = (s.to(torch.bfloat16) for s in states())
    student_states.requires_grad_(True)
    chunked = chunked_generalized_jsd(student_states, student_head, teacher_states, teacher_head, beta=1.0,
                                      chunk_size=CHUNK) / N
    full = generalized_jsd(student_head(student_states).float(), teacher_head(teacher_states).float().detach(),
                           beta=1.0)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, atol=ATOL, rtol=0)
    chunked.backward()
    assert student_states.grad.dtype == student_head.lm_head.weight.grad.dtype == torch.bfloat16
