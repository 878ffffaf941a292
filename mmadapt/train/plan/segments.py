"""The forward pass as segments: each part's modules outside its blocks, each block, the output layer; each with
its saved activations fitted in its load (a + b x + c x s: tokens for the backbone, in rows of s tokens; patches for
the vision side, in images of s patches; c > 0 where attention keeps (s, s) scores), its
parameter and trained bytes; and the backward's sweep over them (the peak of saved activations plus gradients).

A segment is found by a `SegmentKey` (part, block kind, index). The probe's JSON keys segments by the key's text
('encoder', 'encoder.block:KIND:I', 'backbone.layer:KIND:I', 'head', 'loss'): `str(key)` writes it, `parse` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from mmadapt.quantize import is_nf4
from mmadapt.train.plan.model import block_kinds, block_lists, own_parameters

PARTS = ("encoder", "projector", "backbone")
SEQUENCES = {"tokens": "rows", "patches": "images"}  # a probe point's count of the sequences its load is cut into


@dataclass(frozen=True)
class SegmentKey:
    """Where a segment is: `part` (encoder, projector, backbone; `head`: the output layer; `loss`: what no tracked
    module holds) and, for one block of a part's block list, its `kind` (the backbone's layer type, else "block")
    and `index` in the list; `kind` None: the part's modules outside its blocks."""

    part: str
    kind: str | None = None
    index: int = 0

    @property
    def is_block(self) -> bool:
        return self.kind is not None

    @property
    def load(self) -> str:
        """The part whose load (patches or tokens) the segment's activations grow with."""
        return "backbone" if self.part == HEAD.part else self.part

    def position(self) -> tuple[int, int, int]:
        """Its place in the forward: by part (the output layer last), the part's own modules before its blocks."""
        if self.part == HEAD.part:
            return PARTS.index("backbone"), 2, 0
        return PARTS.index(self.part), int(self.is_block), self.index

    def __str__(self) -> str:
        if self.kind is None:
            return self.part
        return f"{self.part}.{'block' if self.part == 'encoder' else 'layer'}:{self.kind}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> SegmentKey:
        """The key of `str(key)`."""
        where, _, block = text.partition(":")
        if not block:
            return cls(text)
        kind, _, index = block.rpartition(":")
        return cls(where.split(".", 1)[0], kind, int(index))


HEAD, LOSS = SegmentKey("head"), SegmentKey("loss")


def stored_bytes(p: Any) -> int:
    """A parameter's bytes as stored: an NF4 weight's (`mmadapt.quantize`: its 4-bit codes, int8 block scales and
    the scales' own scales, its two scalars and 16-entry table), else numel x element size. Meta tensors included."""
    if is_nf4(p):
        names, _ = p.__tensor_flatten__()
        return sum(stored_bytes(getattr(p, name)) for name in names)
    return p.numel() * p.element_size()


def parameter_bytes(params: list[nn.Parameter]) -> int:
    return sum(stored_bytes(p) for p in params)


def four_bit_bytes(params: list[nn.Parameter]) -> int:
    """The bytes of those of `params` stored in NF4 (FSDP2 gathers them as they are: not cast to the compute dtype)."""
    return sum(stored_bytes(p) for p in params if is_nf4(p))


def gradient_bytes(params: list[nn.Parameter]) -> int:
    """Their fp32 gradients' bytes (or, equally, one AdamW moment's): 4 per trained element."""
    return sum(p.numel() * 4 for p in params if p.requires_grad)


@dataclass
class Segment:
    """One step of the forward pass: its saved activations and block inputs (fit a + b x + c x s), parameter bytes
    (of which `four_bit_bytes` in NF4), trained bytes."""

    key: SegmentKey
    acts: Line = (0.0, 0.0, 0.0)
    inputs: Line = (0.0, 0.0, 0.0)
    param_bytes: int = 0
    trained_bytes: int = 0
    four_bit_bytes: int = 0

    @property
    def part(self) -> str:
        return self.key.load


Line = tuple[float, float, float]  # (a, b, c): a + b x + c x s bytes at load x in sequences of s
Load = tuple[float, float]  # (x, s): the load (tokens, patches) and its sequences' length (a row, an image)
SIGNIFICANT = 0.01  # a quadratic term under 1% of the longest probe's bytes is rounding, not attention


def fit(points: list[dict[str, Any]], x: str, value: Any, sequences: str) -> Line:
    """a + b x + c x s through the probe points, s = x / p[sequences] the length of one sequence (attention
    that keeps (L, L) scores per row or image grows as the sum of the sequences' squared lengths, x s). The
    quadratic term is kept where the points show one (c > 0 and at least `SIGNIFICANT` of the longest point's bytes);
    else a line through the two longest points (b >= 0). Through the origin when every point has the same x (a
    fixed-size encoder's images: its bytes are per image)."""
    xs = [float(p[x]) for p in points]
    ys = [float(value(p)) for p in points]
    if len(set(xs)) == 1:
        return 0.0, sum(y / max(x0, 1.0) for x0, y in zip(xs, ys, strict=True)) / len(ys), 0.0
    order = sorted(range(len(xs)), key=xs.__getitem__)
    if len(points) >= 3:
        rows = [[1.0, xs[i], xs[i] * xs[i] / max(float(points[i][sequences]), 1.0)] for i in order[-3:]]
        solved = _solve(rows, [ys[i] for i in order[-3:]])
        if solved is not None:
            a, b, c = solved
            if c > 0 and b >= 0 and c * rows[-1][2] >= SIGNIFICANT * max(ys[order[-1]], 1.0):
                return a, b, c
    (x0, y0), (x1, y1) = ((xs[i], ys[i]) for i in order[-2:])
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return y0 - slope * x0, slope, 0.0


def _solve(rows: list[list[float]], ys: list[float]) -> tuple[float, float, float] | None:
    """The 3 x 3 system rows . (a, b, c) = ys (LU with pivoting, float64); None when it is singular."""
    import numpy as np

    try:
        a, b, c = np.linalg.solve(np.array(rows, dtype=np.float64), np.array(ys, dtype=np.float64)).tolist()
    except np.linalg.LinAlgError:
        return None
    return a, b, c


def at(line: Line, load: Load) -> float:
    x, s = load
    return max(line[0] + line[1] * x + line[2] * x * s, 0.0)


def sweep(segments: list[Segment], load: dict[str, Load], checkpointed: set[str],
          shard: int = 1) -> tuple[float, float]:
    """(peak of saved activations + gradients over the backward, saved activations at the end of the forward);
    gradients are sharded / `shard` (FSDP2 reduce-scatters each unit's as its backward ends)."""
    acts = []
    for s in segments:
        x = load[s.part]
        full = at(s.acts, x)
        kept = min(at(s.inputs, x), full)  # a block that saves nothing (frozen, no gradient through it) keeps nothing
        acts.append(kept if s.part in checkpointed and s.key.is_block else full)
    total_acts = sum(acts)
    peak, grads = 0.0, 0.0
    alive = total_acts
    for s, a in zip(reversed(segments), reversed(acts), strict=True):  # the backward, last segment first
        grads += s.trained_bytes / shard
        peak = max(peak, alive + grads)
        alive -= a
    return peak, total_acts


def segments(model: Any, probe: dict[str, Any]) -> list[Segment]:
    """The run's forward as segments (encoder rest, each encoder block, projector, backbone rest, each layer,
    the output layer) with the probe's fitted activations and the full model's parameter bytes."""
    points = probe["points"]

    def fitted(name: str, x: str, what: str = "saved") -> Line:
        return fit(points, x, lambda p: p[what].get(name, 0), SEQUENCES[x])

    def by_kind(part: str, x: str) -> dict[str, tuple[Line, Line]]:
        """{kind: (saved, inputs)} fitted for the first probed block of each kind of `part`."""
        kinds = {}
        for name in points[0]["saved"] | points[0]["inputs"]:
            key = SegmentKey.parse(name)
            if key.part == part and key.is_block and key.kind not in kinds:
                kinds[key.kind] = (fitted(name, x), fitted(name, x, "inputs"))
        return kinds

    out = []
    x_of = {"encoder": "patches", "backbone": "tokens"}
    for part in PARTS:
        x = x_of.get(part, "patches")
        own = own_parameters(model, getattr(model, part))
        out.append(Segment(key=SegmentKey(part), acts=fitted(part, x), param_bytes=parameter_bytes(own),
                           trained_bytes=gradient_bytes(own), four_bit_bytes=four_bit_bytes(own)))
        if part == "projector":
            continue
        kinds = by_kind(part, x)
        for key, blocks in block_lists(model).items():
            if not key.startswith(part):
                continue
            for i, (block, kind) in enumerate(zip(blocks, block_kinds(model, key, blocks), strict=True)):
                acts, inputs = kinds.get(kind, ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)))
                params = list(block.parameters())
                out.append(Segment(key=SegmentKey(part, kind, i), acts=acts, inputs=inputs,
                                   param_bytes=parameter_bytes(params), trained_bytes=gradient_bytes(params),
                                   four_bit_bytes=four_bit_bytes(params)))
    head = [model.backbone.get_output_embeddings().weight]
    out.append(Segment(key=HEAD, param_bytes=parameter_bytes(head), trained_bytes=gradient_bytes(head)))
    return out


def probe_sweep_segments(probe: dict[str, Any]) -> list[Segment]:
    """The probe's tracked modules in forward order: encoder, its blocks, projector, backbone, its layers, head."""
    measured = {SegmentKey.parse(name): counts for name, counts in probe["segments"].items()}
    return [Segment(key=key, param_bytes=measured[key]["params"], trained_bytes=measured[key]["trained"])
            for key in sorted(measured, key=SegmentKey.position)]
