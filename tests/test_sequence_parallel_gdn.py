"""Gated DeltaNet under Ulysses sequence parallelism (2 ranks, gloo, CPU, fp32) equals one process.

One torchrun launch; on each rank a tiny Qwen3.5 (and Qwen3.5-MoE) GDN layer (2 key heads, 4 value heads: each rank
one key head and the two value heads it serves) runs on the rank's half of every row with `sequence_parallel=Shards`,
and the same layer runs in one process on the whole rows. Rows of 70 tokens (35 per rank, the chunked rule's chunk
64 crossed), sample boundaries off the split point and samples across it: right-padded rows (lengths 70, 41, 9),
left-padded rows, packed rows of 2-3 samples with padding tails (regrouped path, and the varlen path with
`test_packing`'s exact per-segment reference kernels). Per rank: the output within 1e-6 of its slice of one process's,
the input gradient within 1e-6 of its slice, and every parameter's gradient summed over the 2 ranks within 1e-5 of
one process's.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_bounded

RANK_SCRIPT = r'''
import sys
import torch
import torch.distributed as dist

sys.path.insert(0, TESTS)
import mmadapt.backbones.qwen3_5_layers as layers
from mmadapt.backbones import BACKBONES
from mmadapt.packing import PackedRows, Segments, cu_seqlens_from_lengths
from mmadapt.ulysses import Shards
from test_packing import reference_conv, reference_rule

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
LENGTH = 70
n = LENGTH // size


def gdn_layer(backbone):
    torch.manual_seed(0)
    lm, _ = BACKBONES.get(backbone).build("tiny")
    layers.isolate_samples(lm)
    layer = next(m for m in lm.modules() if isinstance(m, layers.PerSample))
    assert (layer.num_k_heads, layer.num_v_heads) == (2, 4), (layer.num_k_heads, layer.num_v_heads)
    with torch.no_grad():  # outputs of order 1, not transformers' small initialisation
        for name, p in layer.named_parameters():
            p.normal_(0, 1.0 if p.ndim < 2 or name.startswith("conv1d") else p.shape[-1] ** -0.5)
    return layer


def packed(lengths_per_row):
    cu = cu_seqlens_from_lengths(lengths_per_row, LENGTH)
    valid = torch.tensor([[t < sum(lengths) for t in range(LENGTH)] for lengths in lengths_per_row])
    return valid, PackedRows(Segments.from_cu_seqlens(cu, valid), cu, valid)


def run(layer, x, weight, **kwargs):
    layer.zero_grad()
    x = x.detach().requires_grad_()
    out = layer(x, **kwargs)
    (out * weight).sum().backward()
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in layer.named_parameters()}


def close(a, b, tolerance, *what):
    assert (a - b).abs().max() <= tolerance, (*what, rank, float((a - b).abs().max()), float(b.abs().max()))


def check(what, layer, valid, rows, varlen=False):
    torch.manual_seed(1)
    x = torch.randn(valid.shape[0], LENGTH, layer.hidden_size)
    weight = torch.randn_like(x) / 10  # gradients of order 1-10, where fp32 holds 1e-5
    layers.varlen_kernels = lambda _: None  # one process: the regrouped path
    one = run(layer, x, weight, **({"packed_segments": rows} if rows is not None else {"attention_mask": valid}))
    mine, calls = slice(rank * n, (rank + 1) * n), []
    if varlen:
        layers.varlen_kernels = lambda _: calls.append(1) or (reference_conv, reference_rule)
    out, grad, grads = run(layer, x[:, mine], weight[:, mine], sequence_parallel=Shards(None, size, rank, valid, rows))
    assert len(calls) == varlen and one[0].abs().max() > 0.1, (what, calls, "outputs too small to compare")
    assert (one[0][~valid] == 0).all() and (out[~valid[:, mine]] == 0).all(), (what, "padding not 0")
    close(out, one[0][:, mine], 1e-6, what, "output")
    close(grad, one[1][:, mine], 1e-6, what, "input gradient")
    for name, g in grads.items():
        dist.all_reduce(g)
        close(g, one[2][name], 1e-5, what, name)
    print(f"rank {rank} {what}: ok", file=sys.stderr)


PACKED = [[30, 33], [20, 17, 28], [70]]
for backbone in ("qwen3_5", "qwen3_5_moe"):
    layer = gdn_layer(backbone)
    right = torch.arange(LENGTH)[None] < torch.tensor([[70], [41], [9]])
    check(f"{backbone} right-padded", layer, right, None)
    check(f"{backbone} packed", layer, *packed(PACKED))
check("qwen3_5_moe left-padded", layer, right.flip(1), None)
check("qwen3_5_moe packed, varlen kernels", layer, *packed(PACKED), varlen=True)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_gated_delta_net_on_two_ranks_equals_one_process(tmp_path):
    tests = str(Path(__file__).parent)
    script = tmp_path / "gdn_ranks.py"
    script.write_text(f"TESTS = {tests!r}\n" + RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    code, stderr = run_bounded(cmd, 180, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert code == 0, stderr[-4000:]
    assert stderr.count(": ok") == 2 * 6, stderr[-2000:]


def gdn(**overrides):
    from mmadapt.backbones import BACKBONES
    from mmadapt.backbones.qwen3_5_layers import PerSample, isolate_samples

    lm, _ = BACKBONES.get("qwen3_5").build("tiny", **overrides)
    isolate_samples(lm)
    return next(m for m in lm.modules() if isinstance(m, PerSample))


def test_sequence_parallel_refuses_heads_it_cannot_divide_and_a_cache():
    """Checked before any exchange: no process group needed."""
    from mmadapt.ulysses import Shards

    valid = torch.ones(1, 8, dtype=torch.bool)
    layer = gdn(linear_num_key_heads=3, linear_num_value_heads=3)
    x = torch.zeros(1, 4, layer.hidden_size)
    with pytest.raises(ValueError, match=r"2 does not divide PerSampleGatedDeltaNet's key's 3 heads .*Sizes that work: "
                                         r"\[3\]"):
        layer(x, sequence_parallel=Shards(None, 2, 0, valid))
    layer = gdn()
    with pytest.raises(ValueError, match="cannot use a cache"):
        layer(x, cache=object(), sequence_parallel=Shards(None, 2, 0, valid))
    with pytest.raises(ValueError, match=r"Shards\.packed"):
        layer(x, packed_segments=object(), sequence_parallel=Shards(None, 2, 0, valid))
