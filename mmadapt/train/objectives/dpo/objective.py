"""`train.objective: dpo`: preference objectives (DPO and its variants) over chosen / rejected answer pairs; their
settings are the run config's `dpo` section (`settings.py`: the loss type, beta, the reference).

A batch is `mmadapt.data.preference.PairCollator`'s: B chosen rows then B rejected rows, each pair's prompt images
encoded once (`image_index`). One forward of the policy over the 2B rows gives each row's sequence log-prob
(`VisionLanguageModel.forward(head=SequenceLogps())`: the hidden states of the answer positions only, `lm_head` and
log-softmax in chunks, no (B, L, V) logits); the losses, per pair (`preference_losses`; pi: the policy's summed
log-probs, ref: the reference's, |y|: the answer's tokens, sigma: the logistic function, eps: `label_smoothing`):

- `sigmoid` (DPO, Rafailov et al. 2023; cDPO's label smoothing): h = (pi_c - ref_c) - (pi_r - ref_r),
  loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h);
- `ipo` (Azar et al. 2023, per token as trl and the authors normalise it): h = (pi_c - ref_c) / |y_c| -
  (pi_r - ref_r) / |y_r|, loss = (h - 1 / (2 beta))^2;
- `simpo` (Meng et al. 2024; reference-free): h = beta (pi_c / |y_c| - pi_r / |y_r|) - gamma,
  loss = -(1 - eps) log sigma(h) - eps log sigma(-h);
- `orpo` (Hong et al. 2024; reference-free): with a = pi / |y| (the mean token log-prob) and
  log odds(y) = a - log(1 - exp(a)), loss = -a_c + beta * -log sigma(log odds(y_c) - log odds(y_r)) (beta = the
  paper's lambda).

Rewards (logged): beta (pi - ref) for DPO and IPO, beta pi / |y| for SimPO and ORPO; the margin is chosen - rejected,
the accuracy the share of pairs whose chosen reward is higher; `kl`: the mean over answer tokens of KL(policy ||
reference) over the whole vocabulary (when the reference runs per batch).

The reference (`mmadapt.train.objectives.reference`) is the model the run starts from, never a second copy of its
weights: the same model with its LoRA adapters off, per batch (`adapters`), or its log-probs of every pair computed
once before the first step (`precomputed`, `prepare`). A step's loss is the sum of its per-pair losses over the
global batch's pairs (all micro-batches, all ranks), so accumulation and ranks equal one big batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mmadapt.heads import SequenceLogps
from mmadapt.run_directory import RunDirectory
from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import inputs_of, to_device
from mmadapt.train.objectives.base import Objective, ObjectiveData, Run, StepResult, StepTotals, Terms, ViewOptions
from mmadapt.train.objectives.dpo.loss import PreferenceTerms, preference_losses
from mmadapt.train.objectives.dpo.settings import DpoSettings
from mmadapt.train.objectives.reference import (
    ReferenceTable,
    adapters_disabled,
    compute_table,
    data_checksum,
    model_checksum,
    reference_kind,
)

log = logging.getLogger(__name__)

def check_pairs(batch: dict[str, Any], image_token_id: int | None) -> None:
    """The contract on both rows of every pair of a `PairCollator` batch (rows b and B + b): the same image spans (the
    same positions in the prompt both rows share) and, when the pair shares its images, the same encoded images
    (`image_index`), so both rows receive the same visual tokens. `ImageTokenContractError` naming the pair."""
    from mmadapt.contract import ImageTokenContractError, locate

    pairs, meta = int(batch.get("pairs", 0)), batch.get("meta", {})
    if not pairs or image_token_id is None:
        return
    spans = locate(batch["input_ids"], image_token_id)
    per_row = [[] for _ in range(2 * pairs)]
    for row, start, length in zip(spans.sample.tolist(), spans.start.tolist(), spans.length.tolist(), strict=True):
        per_row[row].append((start, length))
    index = batch.get("image_index")
    counts = [len(spans_of) for spans_of in per_row]
    offsets = [sum(counts[:r]) for r in range(2 * pairs)]
    shared = meta.get("shared", [True] * pairs)
    for b in range(pairs):
        chosen, rejected = per_row[b], per_row[pairs + b]
        same_images = index is None or index[offsets[b] : offsets[b] + counts[b]].tolist() == index[
            offsets[pairs + b] : offsets[pairs + b] + counts[pairs + b]].tolist()
        if chosen != rejected or (shared[b] and not same_images):
            pair = meta.get("pair_ids", [b] * pairs)[b]
            raise ImageTokenContractError(
                f"pair {pair!r} (rows {b} and {pairs + b}): the chosen row has image spans {chosen} (start, tokens), "
                f"the rejected row {rejected}" + ("" if same_images else ", reading other encoded images") + ". Both "
                "answers must follow the same prompt with the same images. Fix: build pair batches with "
                "mmadapt.data.preference.PairCollator")


# ---- the objective the trainer runs ----------------------------------------------------------------------------------
STATS = ("loss", "chosen_reward", "rejected_reward", "correct", "chosen_logps", "rejected_logps", "kl", "kl_tokens")


class PairScorer:
    """One micro-batch of pairs as the preference objective scores it: the reference's log-probs (per batch with
    the adapters off, from the precomputed table, or none), one policy forward over both rows, the per-pair terms,
    and the sums the step logs."""

    def __init__(self, settings: Any, model: torch.nn.Module, reference: str | None,
                 table: ReferenceTable | None = None) -> None:
        self.settings, self.model, self.reference, self.table = settings, model, reference, table

    def reference_logps(self, wrapped: Any, inputs: dict[str, Any], batch: dict[str, Any], split: str,
                        keep_states: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        """(chosen (B,), rejected (B,), the reference's answer states or None)."""
        if self.reference is None:
            return None, None, None
        if self.reference == "precomputed":
            if self.table is None:
                raise RuntimeError("the precomputed reference was not computed (PairScorer.table)")
            chosen, rejected = self.table.lookup(split, batch["meta"]["pair_index"])
            device = inputs["input_ids"].device
            return chosen.to(device), rejected.to(device), None
        was_training = wrapped.training
        with torch.no_grad(), adapters_disabled(self.model):
            wrapped.eval()  # the reference runs as an evaluated model: no dropout
            out = wrapped(**inputs, head=SequenceLogps(keep_states=keep_states))
        wrapped.train(was_training)
        chosen, rejected = out.logps.chunk(2)
        return chosen, rejected, out.states

    def reference_head(self) -> Any:
        head = self.model.backbone.get_output_embeddings()

        def logits(states: torch.Tensor) -> torch.Tensor:
            with adapters_disabled(head):
                return head(states)

        return logits

    def terms(self, wrapped: Any, batch: dict[str, Any], device: torch.device, split: str = "train"
              ) -> tuple[PreferenceTerms, dict[str, float]]:
        """One micro-batch of B pairs: the per-pair terms (differentiable when grad is on) and the sums to log."""
        s = self.settings
        if self.model.config.check_contract:
            check_pairs(batch, self.model.tokens.image_token_id)
        inputs = to_device(inputs_of(batch), device)
        ref_chosen, ref_rejected, ref_states = self.reference_logps(wrapped, inputs, batch, split,
                                                                    keep_states=self.reference == "adapters")
        reference = (ref_states, self.reference_head()) if ref_states is not None else None
        out = wrapped(**inputs, head=SequenceLogps(reference=reference))
        chosen, rejected = out.logps.chunk(2)
        chosen_tokens, rejected_tokens = out.tokens.chunk(2)
        terms = preference_losses(s.loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens,
                                  rejected_tokens, beta=s.beta, label_smoothing=s.label_smoothing,
                                  simpo_gamma=s.simpo_gamma)
        stats = {"loss": float(terms.losses.detach().sum()), "chosen_reward": float(terms.chosen_rewards.sum()),
                 "rejected_reward": float(terms.rejected_rewards.sum()),
                 "correct": float((terms.chosen_rewards > terms.rejected_rewards).sum()),
                 "chosen_logps": float(chosen.detach().sum()), "rejected_logps": float(rejected.detach().sum()),
                 "kl": float(out.kl.sum()) if out.kl is not None else 0.0,
                 "kl_tokens": float(out.tokens.sum()) if out.kl is not None else 0.0}
        return terms, stats

    @staticmethod
    def summary(sums: dict[str, float], pairs: int, prefix: str = "") -> dict[str, float]:
        """The logged means of a step's (or an evaluation's) sums over `pairs` pairs."""
        n = max(pairs, 1)
        out = {f"{prefix}loss": sums["loss"] / n, f"{prefix}rewards/chosen": sums["chosen_reward"] / n,
               f"{prefix}rewards/rejected": sums["rejected_reward"] / n,
               f"{prefix}rewards/margin": (sums["chosen_reward"] - sums["rejected_reward"]) / n,
               f"{prefix}rewards/accuracy": sums["correct"] / n, f"{prefix}logps/chosen": sums["chosen_logps"] / n,
               f"{prefix}logps/rejected": sums["rejected_logps"] / n}
        if sums["kl_tokens"]:
            out[f"{prefix}kl"] = sums["kl"] / sums["kl_tokens"]
        return out


class PreferenceObjective(Objective):
    """`train.objective: dpo`: the loss of `dpo.loss_type` on preference pairs, with its reference."""

    section = "dpo"
    settings_class = DpoSettings
    rows_per_sample = 2  # a pair is a chosen and a rejected row (the prompt's images encoded once)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.scorer: PairScorer | None = None
        self.start_checksum: str | None = None

    @property
    def reference(self) -> str | None:
        """None (a reference-free loss), "adapters" or "precomputed" (after `setup`)."""
        return None if self.scorer is None else self.scorer.reference

    def data(self, model: Any, encoder: Any) -> ObjectiveData:
        from mmadapt.data.preference import PairCollator, PairEncoder, PreferenceDataset

        d = self.config.data
        self.require_one_unpacked_file(" (its precomputed reference is keyed by the record's index in it)",
                                       "pads its pairs (chosen and rejected rows side by side)")
        pairs = PairEncoder(encoder)
        collate = PairCollator.for_model(model, encoder.pad_token_id)
        return ObjectiveData(PreferenceDataset(d.train, pairs), PreferenceDataset(d.eval, pairs) if d.eval else None,
                             collate)

    def setup(self, model: Any) -> None:
        """The reference (`reference_kind`); a precomputed one notes the starting weights' checksum here, before they
        are moved or sharded."""
        s = self.settings
        kind = reference_kind(s.reference, s.loss_type, self.config.stages.modes(), model)
        log.info("objective: dpo (loss %s, beta %g); reference: %s", s.loss_type, s.beta,
                 {None: "none (reference-free)", "adapters": "the model with its LoRA adapters off, per batch",
                  "precomputed": "the starting model's log-probs, computed before the first step"}[kind])
        self.start_checksum = model_checksum(model) if kind == "precomputed" else None
        self.scorer = PairScorer(s, model, kind)

    def prepare(self, run: Run) -> None:
        """A precomputed reference: OUT's table when its checksums match (the data; and the starting weights, unless
        resuming: the weights moved on), else computed now by the starting model and saved (rank 0)."""
        from mmadapt.data.config import DataConfig

        if self.reference != "precomputed":
            return
        settings = DataConfig.of(run.cfg.data).preprocessing()
        file = RunDirectory(run.out).reference_file
        sets = {"train": run.train_data, **({"eval": run.eval_data} if run.eval_data is not None else {})}
        wanted = {name: data_checksum(getattr(d, "records", None), settings) for name, d in sets.items()}
        found = ReferenceTable.load(run.out) if run.is_main else None
        found = dist_utils.broadcast_object(None if found is None else (found.tables, found.checksums))
        table = None if found is None else ReferenceTable(*found)
        same_data = table is not None and all(table.checksums.get(f"data.{k}") == v for k, v in wanted.items())
        if run.step > 0:  # resumed: the reference is the one the run started with
            if not same_data:
                raise ValueError(f"resume: {file} (the starting model's reference log-probs) "
                                 "is missing or was computed on other data; the starting model is gone, so the run "
                                 "cannot resume exactly. Fix: restore the file and the data, or start a new run")
            self.scorer.table = table
            return
        if same_data and table.checksums.get("model") == self.start_checksum:
            log.info("reference log-probs: reusing %s (same data and starting weights)", file)
            self.scorer.table = table
            return
        started = time.perf_counter()
        tables = {name: compute_table(run.wrapped, data, run.collate_fn, batch_size=run.cfg.data.batch_size,
                                      rank=run.dist.data_rank, world=run.dist.data_world, device=run.device,
                                      precision=run.precision_context, gather=dist_utils.gather_objects)
                  for name, data in sets.items()}
        checksums = {"model": self.start_checksum, **{f"data.{k}": v for k, v in wanted.items()}}
        self.scorer.table = ReferenceTable(tables, checksums)
        if run.is_main:
            self.scorer.table.save(run.out)
        log.info("reference log-probs of %s pairs computed in %.1f s (%s)", "+".join(str(len(t)) for t in
                 tables.values()), time.perf_counter() - started, file)

    # ---- its view of a file of pairs (`mmadapt eval` / `sees`) -----------------------------------------------------
    view_flags = frozenset({"reference"})

    @classmethod
    def claims(cls, records: list[Any]) -> bool:
        from mmadapt.data.preference import is_preference_record

        return any(is_preference_record(r) for r in records[:16])

    @classmethod
    def view(cls, model: Any, encoder: Any, records: list[Any], options: ViewOptions) -> Any:
        """The preference view (`mmadapt.sees.preference_view`): margins of chosen over rejected with real, blanked and
        shuffled images (minus `options.reference`'s, the model training started from, when given)."""
        from mmadapt.data.preference import PairCollator, PairEncoder, PreferenceDataset
        from mmadapt.loading import load_for_inference
        from mmadapt.sees import preference_view

        dataset = PreferenceDataset(records, PairEncoder(encoder))
        collate = PairCollator.for_model(model, encoder.pad_token_id)
        size = options.batch_size
        count = len(dataset) if options.batches is None else min(len(dataset), options.batches * size)
        chunks = [collate([dataset[i] for i in range(start, min(start + size, count))])
                  for start in range(0, count, size)]
        reference = load_for_inference(options.reference, None)[0] if options.reference else None
        return preference_view(model, chunks, reference=reference)

    # ---- a step ------------------------------------------------------------------------------------------------------
    def has_rows(self, batch: dict[str, Any]) -> bool:
        return bool(batch.get("pairs"))

    def units(self, batch: dict[str, Any]) -> int:
        """A micro-batch's pairs: a step's loss is the mean of its per-pair losses."""
        return int(batch["pairs"])

    def stat_names(self, run: Run) -> tuple[str, ...]:
        return STATS

    def micro_loss(self, run: Run, batch: dict[str, Any], totals: StepTotals) -> Terms:
        """The micro-batch's per-pair losses summed and divided by the global batch's pairs."""
        terms, stats = self.scorer.terms(run.wrapped, batch, run.device)
        return Terms(terms.losses.sum() / totals.per_unit, stats)

    def step_result(self, run: Run, micro: list[dict[str, Any]], loss: float, sums: dict[str, float],
                    totals: StepTotals) -> StepResult:
        """The pairs and the means of `PairScorer.summary` (rewards, log-probs, KL); a step without pairs has nothing
        to learn from (loss NaN)."""
        summary = PairScorer.summary(sums, totals.units)
        loss_value = summary.pop("loss") if totals.units else float("nan")
        return StepResult(loss_value, max(totals.tokens, 1), {"pairs": totals.units, **summary})

    def eval_stat_names(self, run: Run) -> tuple[str, ...]:
        return (*STATS, "pairs")

    def eval_batch(self, run: Run, items: list[Any], batch: dict[str, Any]) -> dict[str, float]:
        _, stats = self.scorer.terms(run.wrapped, batch, run.device, split="eval")
        return {**stats, "pairs": batch["pairs"]}

    def eval_metrics(self, run: Run, sums: dict[str, float]) -> dict[str, float]:
        """The preference metrics on the eval pairs (`eval_loss`, `eval_rewards/accuracy`, `eval_rewards/margin`,
        ...)."""
        return PairScorer.summary(sums, int(sums["pairs"]), prefix="eval_")
