"""`mmadapt plan run.yaml --gpus N`: the per-GPU memory of a run's training step, known before anything loads.

**Counted** on the meta device (no weight is read: a pretrained part is built from its checkpoint's config, or
from the `preset` it declares when the checkpoint is not here yet): parameters by dtype (a QLoRA base's NF4 weights
quantised there too, counted as torchao stores them); fp32 gradients and AdamW's two fp32 moments for what the
stages train (LoRA: the adapters); sharded by the strategy (FSDP2: / N, plus the unsharded units it gathers; DDP:
full, plus its gradient buckets).

**Measured**: activations. A probe (the run's model at its real widths, the first block of each kind of every block
list, a 1,024-row vocabulary, fewer experts where they would pass 4 GiB) runs a training step on the CPU at three
short lengths, with the run's stages, precision and packing. Autograd's saved-tensor hooks give each block's saved
bytes, fitted as a + b x + c x s in tokens x in rows of s tokens (vision blocks: patches in images of s patches; the
quadratic term where the three lengths show one: attention that keeps (L, L) scores); `LiveBytes` (a dispatch mode
counting live tensor storages) gives the step's peak. The plan says each part's attention path and how it grows
(`Plan.attention`). The run's step is then a backward sweep over its real depth (saved activations
freed block by block while gradients appear), plus the probe's measured excess over its own sweep (the backward's
temporaries), plus the loss (the supervised rows' gradients and one chunk of logits), for the run's longest
micro-batch: `batch_size` samples of `max_length` tokens (packed: whole rows of `max_tokens`), each with one image
at the processor's largest size that fits - or, for models that take video, one video at `data.video`'s largest
(its `max_frames`, or `num_frames`, at the `max_pixels` budget) when that has more visual tokens (the encoder's
cost extrapolated in patches); or the optimizer step, whichever is higher. Activation checkpointing
keeps only each block's inputs and recomputes one block in the backward. Probe results are cached per shape
(`$MMADAPT_CACHE`, default ~/.cache/mmadapt/plan).

The modules: `workloads` (the longest micro-batch), `model` (the run's model without weights), `segments` (the
forward as segments keyed by `SegmentKey`, and the backward's sweep), `counting` (saved and live bytes), `probe`
(measuring and caching it), `predict` (the plan and its suggestions), `report` (`Plan`, its table and JSON), `saving`
(a checkpoint save's host memory per rank, by format, async staging and strategy).

`total` is the predicted peak of one training step per device. On CUDA a margin is added before comparing with
the GPU's memory: the CUDA context and NCCL buffers (1 GiB) and 5% for the caching allocator's fragmentation.
"""

from mmadapt.train.plan.counting import LiveBytes
from mmadapt.train.plan.model import planning_model
from mmadapt.train.plan.predict import predict, suggestions
from mmadapt.train.plan.probe import cached_probe, cached_probe_or_none, probe_model, run_probe
from mmadapt.train.plan.report import GIB, Plan, gib, parse_size
from mmadapt.train.plan.segments import Segment, SegmentKey
from mmadapt.train.plan.workloads import Workload, without_reward_code, workload

__all__ = [
    "GIB", "LiveBytes", "Plan", "Segment", "SegmentKey", "Workload", "cached_probe", "cached_probe_or_none", "gib",
    "parse_size", "planning_model", "predict", "probe_model", "run_probe", "suggestions", "without_reward_code",
    "workload",
]
