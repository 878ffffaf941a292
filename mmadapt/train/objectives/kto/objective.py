"""`train.objective: kto`: KTO (and APO-zero, unpaired) on unpaired desirable / undesirable answers, equal to trl's
`KTOTrainer`; settings: the run config's `kto` section (`settings.py`), the arithmetic: `loss.py`.

A batch is `KtoCollator`'s: B labelled rows, then (`loss_type: kto`) their B KL rows (each prompt with another
row's completion), each prompt's images encoded once. A step, per micro-batch:

- `training_rows` (once per step, before any backward, on every rank): with no gradient, the reference's log-probs of
  every row and KL row (one forward of the 2B rows with the LoRA adapters off, or the precomputed table's rows), and
  with `kto` the policy's log-probs of the KL rows (in training mode, as trl's `_compute_kl_logps`); each
  micro-batch's KL estimate is its rows' mean of policy - reference (`kl_estimate`), and ONE gather per step gives
  every rank's estimates;
- `micro_loss`: one forward of the policy over the B labelled rows, `kto_losses` with the stored reference and KL.

The step's KL (z0): the mean of the estimates of every micro-batch with rows on every rank (each a mean over its KL
rows, each counted once: trl's `gather_for_metrics(kl).mean()` across processes), clamped at 0, detached. With
`grad_accum` 1 this is exactly trl's z0 (one micro-batch per process); with `grad_accum` A > 1 trl takes each
micro-batch's own average over the processes, we take the step's, which is what trl takes on A times the processes
with the same micro-batches: so a step equals one step of the same global batch spread over more ranks (accumulation
and ranks equal, as for every objective here). A micro-batch without rows (every record a problem) counts for
nothing. Evaluation has no collective per batch: each eval batch's z0 is its own KL rows' estimate (trl averages it
over the processes of a round); the logged `eval_kl` is the mean over the eval batches.

The loss of a step is the mean over the global batch's labelled rows (every micro-batch, every rank) of the weighted
per-row losses (`units` = rows): trl's `losses.nanmean()` on one micro-batch of one process; trl divides the mean of
each micro-batch by the accumulation steps, which equals ours when the micro-batches hold as many rows.

The reference (`mmadapt.train.objectives.reference`, as DPO's): the model with its LoRA adapters off (`adapters`,
per step) or the starting model's log-probs of every row, computed before the first step and cached in OUT
(`precomputed`, keyed by the row's dataset index `meta["row_index"]`). `precomputed` serves `apo_zero_unpaired`
only: a KL row is a prompt with the completion of whichever row shares its batch (the batches are drawn by the
sampler, shuffled each epoch), so its reference log-prob has no key a table computed before the first step could
hold (trl precomputes the KL rows of fixed sequential batches instead); `kto` with a fully trained part is refused,
naming LoRA or `apo_zero_unpaired`.

Logged (trl's names): `rewards/chosen`, `rewards/rejected` (the mean beta (pi - ref) of the desirable / undesirable
rows), `rewards/margins` (their difference, when both kinds are present), `logps/chosen`, `logps/rejected`, `kl`
(z0), and `rows`, `count/desirable`, `count/undesirable`; eval: the same with `eval_` and `eval_loss`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.heads import SequenceLogps
from mmadapt.run_directory import RunDirectory
from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import first_usable, inputs_of, supervised_tokens, to_device
from mmadapt.train.objectives.base import Objective, ObjectiveData, Run, StepResult, StepTotals, Terms
from mmadapt.train.objectives.kto.loss import KtoTerms, kl_estimate, kto_losses
from mmadapt.train.objectives.kto.settings import KtoSettings
from mmadapt.train.objectives.reference import (
    ReferenceTable,
    adapters_disabled,
    compute_table,
    data_checksum,
    model_checksum,
    reference_kind,
)

log = logging.getLogger(__name__)

STATS = ("loss", "desirable", "undesirable", "chosen_reward", "rejected_reward", "chosen_logps", "rejected_logps")
NOT_MODEL_INPUTS = ("rows", "desirable")  # a KTO batch's keys the model does not take
ROW_KEYS = ("input_ids", "attention_mask", "labels", "images_per_sample", "videos_per_sample", "mm_token_type_ids")


def model_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return to_device({k: v for k, v in inputs_of(batch).items() if k not in NOT_MODEL_INPUTS}, device)


def part(batch: dict[str, Any], labelled: bool) -> dict[str, Any]:
    """The B labelled rows (`labelled`) or the B KL rows of a `KtoCollator(kl=True)` batch, with the images they read
    (all B prompts' pixels: the KL rows read their prompts') and their own videos."""
    b = int(batch["rows"])
    rows = slice(0, b) if labelled else slice(b, 2 * b)
    out = {**batch, **{k: batch[k][rows] for k in ROW_KEYS if k in batch}}
    if "image_index" in batch:
        first = int(batch["images_per_sample"][:b].sum())
        out["image_index"] = batch["image_index"][:first] if labelled else batch["image_index"][first:]
    if "pixel_values_videos" in batch:
        before = int(batch["videos_per_sample"][:b].sum())
        videos = slice(0, before) if labelled else slice(before, None)
        if "video_grid_thw" in batch:
            grids = batch["video_grid_thw"]
            patches = grids.prod(-1).cumsum(0).tolist()
            start = patches[before - 1] if before else 0
            out["video_grid_thw"] = grids[videos]
            out["pixel_values_videos"] = (batch["pixel_values_videos"][:start] if labelled
                                          else batch["pixel_values_videos"][start:])
        else:
            out["pixel_values_videos"] = batch["pixel_values_videos"][videos]
    return out


@dataclass
class RowScores:
    """What `training_rows` stores in a micro-batch's meta for its `micro_loss`: the reference's log-probs of the
    labelled rows (B,) and the step's z0 (None: `apo_zero_unpaired`)."""

    reference: torch.Tensor
    kl: torch.Tensor | None


class KtoObjective(Objective):
    """`train.objective: kto`: KTO / APO-zero (unpaired) on rows labelled desirable or undesirable."""

    section = "kto"
    settings_class = KtoSettings

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.reference: str | None = None  # "adapters" or "precomputed", after `setup`
        self.table: ReferenceTable | None = None
        self.start_checksum: str | None = None
        self.model: Any = None
        self.rows_per_sample = 2 if self.kl_rows else 1  # the plan's rows per record: its row and (kto) its KL row

    @property
    def kl_rows(self) -> bool:
        return self.settings.loss_type == "kto"

    def data(self, model: Any, encoder: Any) -> ObjectiveData:
        from mmadapt.train.objectives.kto.data import KtoCollator, KtoDataset, KtoEncoder

        d = self.config.data
        self.require_one_unpacked_file(" (its precomputed reference is keyed by the record's index in it)",
                                       "pads its rows")
        if self.kl_rows and d.batch_size < 2:
            raise ValueError("kto.loss_type kto estimates its KL from each batch's other rows' completions: it needs "
                             f"data.batch_size >= 2 (got {d.batch_size}; trl refuses 1 too). Fix: raise "
                             "data.batch_size, or kto.loss_type: apo_zero_unpaired")
        rows = KtoEncoder(encoder)
        collate = KtoCollator.for_model(model, encoder.pad_token_id, kl=self.kl_rows)
        return ObjectiveData(KtoDataset(d.train, rows), KtoDataset(d.eval, rows) if d.eval else None, collate)

    def setup(self, model: Any) -> None:
        """The reference (`reference_kind`); a precomputed one notes the starting weights' checksum here."""
        s = self.settings
        try:
            kind = reference_kind(s.reference, s.loss_type, self.config.stages.modes(), model)
        except ValueError as e:  # the shared check names DPO's section
            raise ValueError(str(e).replace("dpo.reference", "kto.reference")) from None
        if kind == "precomputed" and self.kl_rows:
            trained = sorted(p for p, m in self.config.stages.modes().items() if m == "full")
            raise ValueError("kto.loss_type kto needs the reference per batch (its KL rows pair each prompt with "
                             "another row of its batch, so no precomputed table can hold them), but "
                             + (f"{trained} train fully" if trained else "kto.reference is precomputed")
                             + ". Fix: train them with LoRA (stages: lora; kto.reference: auto or adapters), or "
                             "kto.loss_type: apo_zero_unpaired")
        log.info("objective: kto (loss %s, beta %g, weights %g / %g); reference: %s", s.loss_type, s.beta,
                 s.desirable_weight, s.undesirable_weight,
                 {"adapters": "the model with its LoRA adapters off, per batch",
                  "precomputed": "the starting model's log-probs, computed before the first step"}[kind])
        self.reference, self.model = kind, model
        self.start_checksum = model_checksum(model) if kind == "precomputed" else None

    def prepare(self, run: Run) -> None:
        """A precomputed reference: OUT's table when its checksums match (the data; the starting weights unless
        resuming), else computed now by the starting model (every rank a share, gathered) and saved (rank 0)."""
        from mmadapt.data.config import DataConfig

        if self.reference != "precomputed":
            return
        settings = DataConfig.of(run.cfg.data).preprocessing()
        file = RunDirectory(run.out).reference_file
        sets = {"train": run.train_data, **({"eval": run.eval_data} if run.eval_data is not None else {})}
        wanted = {f"data.{k}": data_checksum(getattr(d, "records", None), settings) for k, d in sets.items()}
        found = ReferenceTable.load(run.out) if run.is_main else None
        found = dist_utils.broadcast_object(None if found is None else (found.tables, found.checksums))
        table = None if found is None else ReferenceTable(*found)
        same_data = table is not None and all(table.checksums.get(k) == v for k, v in wanted.items())
        if run.step > 0 and not same_data:
            raise ValueError(f"resume: {file} (the starting model's reference log-probs) is missing or was computed "
                             "on other data; the starting model is gone, so the run cannot resume exactly. Fix: "
                             "restore the file and the data, or start a new run")
        if same_data and (run.step > 0 or table.checksums.get("model") == self.start_checksum):
            self.table = table
            return
        started = time.perf_counter()
        collate = TableRows(run.collate_fn)
        tables = {name: compute_table(run.wrapped, data, collate, batch_size=run.cfg.data.batch_size,
                                      rank=run.dist.data_rank, world=run.dist.data_world, device=run.device,
                                      precision=run.precision_context, gather=dist_utils.gather_objects)
                  for name, data in sets.items()}
        self.table = ReferenceTable(tables, {"model": self.start_checksum, **wanted})
        if run.is_main:
            self.table.save(run.out)
        log.info("reference log-probs of %s rows computed in %.1f s (%s)",
                 "+".join(str(len(t)) for t in tables.values()), time.perf_counter() - started, file)

    # ---- a step ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def training_rows(self, run: Run, micro: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each micro-batch's reference log-probs and (`kto`) the step's z0, stored in its meta (see the module)."""
        stand_in = self.stand_in(run, micro)
        local: list[float | None] = []
        for batch in micro:
            mine = self.has_rows(batch)
            scores = self.row_scores(run, batch if mine else stand_in)
            if mine:
                batch["meta"]["kto"] = RowScores(scores[0], None)
            local.append(float(scores[1]) if mine and scores[1] is not None else None)
        if self.kl_rows:
            estimates = [v for rank in dist_utils.gather_objects(local) for v in rank if v is not None]
            kl = torch.tensor(sum(estimates) / len(estimates) if estimates else 0.0, device=run.device)
            for batch in micro:
                if self.has_rows(batch):
                    batch["meta"]["kto"].kl = kl
        return micro

    def stand_in(self, run: Run, micro: list[dict[str, Any]]) -> dict[str, Any] | None:
        """What a rank scores (its results dropped) for a micro-batch without rows under FSDP2, where the other ranks'
        forwards gather parameters with its own: one of its micro-batches with rows, else the first usable record."""
        if not dist_utils.is_fsdp(run.wrapped):
            return None
        found = next((b for b in micro if self.has_rows(b)), None)
        if found is None:
            found = run.collate_fn(first_usable(run.train_data))
        return found

    def row_scores(self, run: Run, batch: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the reference's log-probs of the labelled rows (B,), the KL estimate of the KL rows or None) of `batch`,
        with no gradient; nothing is run for None (no rows, and no rank to keep in step)."""
        if batch is None:
            return torch.zeros(0), None
        model, device = run.model, run.device  # never DDP's forward: its buffer broadcast would pair ranks
        if self.reference == "precomputed":
            reference = self.table_logps("train", batch, device)
        else:
            was_training = model.training
            model.eval()  # the reference runs as an evaluated model: no dropout
            with run.precision_context(), adapters_disabled(self.model):
                reference = model(**model_inputs(batch, device), head=SequenceLogps()).logps.float()
            model.train(was_training)
        if not self.kl_rows:
            return reference, None
        model.train()  # trl computes the KL rows' log-probs in training mode, without a gradient
        with run.precision_context():
            policy_kl = model(**model_inputs(part(batch, labelled=False), device), head=SequenceLogps()).logps
        b = int(batch["rows"])
        return reference[:b], kl_estimate(policy_kl.float(), reference[b:])

    def table_logps(self, split: str, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
        if self.table is None:
            raise RuntimeError("the precomputed reference was not computed (KtoObjective.prepare)")
        return self.table.lookup(split, batch["meta"]["row_index"])[0].to(device)

    def has_rows(self, batch: dict[str, Any]) -> bool:
        return bool(batch.get("rows"))

    def tokens(self, batch: dict[str, Any]) -> int:
        """The labelled rows' supervised tokens (the KL rows' are not learned from)."""
        return int(supervised_tokens(batch["labels"][: int(batch.get("rows", 0))]))

    def units(self, batch: dict[str, Any]) -> int:
        """A micro-batch's labelled rows: a step's loss is the mean of its per-row losses."""
        return int(batch["rows"])

    def stat_names(self, run: Run) -> tuple[str, ...]:
        return STATS

    def micro_loss(self, run: Run, batch: dict[str, Any], totals: StepTotals) -> Terms:
        """The micro-batch's weighted per-row losses summed and divided by the global batch's rows."""
        scores = batch["meta"].get("kto")
        if scores is None:
            raise RuntimeError("a KTO micro-batch reached micro_loss without its reference (training_rows runs first)")
        terms, policy = self.terms(run.wrapped, part(batch, labelled=True) if self.kl_rows else batch, run.device,
                                   scores.reference, scores.kl)
        return Terms(terms.losses.sum() / totals.per_unit, self.sums(terms, policy, batch))

    def terms(self, wrapped: Any, batch: dict[str, Any], device: torch.device, reference: torch.Tensor,
              kl: torch.Tensor | None) -> tuple[KtoTerms, torch.Tensor]:
        """The per-row terms of the labelled rows of `batch` (differentiable when grad is on) and their log-probs."""
        s = self.settings
        policy = wrapped(**model_inputs(batch, device), head=SequenceLogps()).logps
        desirable = batch["desirable"].to(device)
        terms = kto_losses(s.loss_type, policy, reference.to(policy), desirable, kl, beta=s.beta,
                           desirable_weight=s.desirable_weight, undesirable_weight=s.undesirable_weight)
        return terms, policy

    @staticmethod
    def sums(terms: KtoTerms, policy: torch.Tensor, batch: dict[str, Any]) -> dict[str, Any]:
        desirable = batch["desirable"].to(policy.device)
        logps = policy.detach().float()
        return {"loss": terms.losses.detach().sum(), "desirable": float(desirable.sum()),
                "undesirable": float((~desirable).sum()), "chosen_reward": terms.chosen_rewards.sum(),
                "rejected_reward": terms.rejected_rewards.sum(), "chosen_logps": logps[desirable].sum(),
                "rejected_logps": logps[~desirable].sum()}

    def step_result(self, run: Run, micro: list[dict[str, Any]], loss: float, sums: dict[str, float],
                    totals: StepTotals) -> StepResult:
        """The rows and trl's metrics (`summary`) with the step's z0 as `kl`; a step without rows has nothing to learn
        from (loss NaN)."""
        summary = summary_of(sums)
        summary.pop("loss")
        kl = next((b["meta"]["kto"].kl for b in micro if self.has_rows(b)), None)
        if self.kl_rows and kl is not None:
            summary["kl"] = float(kl.clamp(min=0))
        loss_value = loss if totals.units else float("nan")
        return StepResult(loss_value, max(totals.tokens, 1), {"rows": totals.units, **summary})

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def eval_stat_names(self, run: Run) -> tuple[str, ...]:
        return (*STATS, "kl", "batches")

    def eval_batch(self, run: Run, items: list[Any], batch: dict[str, Any]) -> dict[str, float]:
        """One eval batch's sums: one forward of the policy and one of the reference over all its rows (the KL rows
        included), z0 the batch's own KL estimate."""
        device, b = run.device, int(batch["rows"])
        inputs = model_inputs(batch, device)
        if self.reference == "precomputed":
            reference = self.table_logps("eval", batch, device)
        else:
            with adapters_disabled(self.model):
                reference = run.wrapped(**inputs, head=SequenceLogps()).logps.float()
        policy = run.wrapped(**inputs, head=SequenceLogps()).logps.float()
        kl = kl_estimate(policy[b:], reference[b:]) if self.kl_rows else None
        s = self.settings
        terms = kto_losses(s.loss_type, policy[:b], reference[:b], batch["desirable"].to(device), kl, beta=s.beta,
                           desirable_weight=s.desirable_weight, undesirable_weight=s.undesirable_weight)
        sums = {k: float(v) for k, v in self.sums(terms, policy[:b], batch).items()}
        return {**sums, "kl": float(terms.kl), "batches": 1.0}

    def eval_metrics(self, run: Run, sums: dict[str, float]) -> dict[str, float]:
        """trl's metrics on the eval rows (`eval_loss`, `eval_rewards/margins`, ...; `eval_kl`: the batches' mean)."""
        out = summary_of(sums)
        if self.kl_rows and sums.get("batches"):
            out["kl"] = sums["kl"] / sums["batches"]
        return {f"eval_{k}": v for k, v in out.items()}


def summary_of(sums: dict[str, float]) -> dict[str, float]:
    """trl's logged means from a step's (or an evaluation's) sums: the loss per row, the rewards and log-probs per
    desirable / undesirable row (where there are some), the margin where there are both."""
    good, bad = sums["desirable"], sums["undesirable"]
    out = {"loss": sums["loss"] / max(good + bad, 1), "count/desirable": int(good), "count/undesirable": int(bad)}
    if good:
        out["rewards/chosen"], out["logps/chosen"] = sums["chosen_reward"] / good, sums["chosen_logps"] / good
    if bad:
        out["rewards/rejected"], out["logps/rejected"] = sums["rejected_reward"] / bad, sums["rejected_logps"] / bad
    if good and bad:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


@dataclass(frozen=True)
class TableRows:
    """The collator `compute_table` runs (`apo_zero_unpaired`: rows only): the shared table holds a (chosen,
    rejected) pair per key, so each batch's rows are laid out twice (both halves of `logps.chunk(2)` the same rows)
    and keyed by their dataset index (`pair_index`)."""

    base: Any

    @property
    def pad_token_id(self) -> int:
        return self.base.pad_token_id

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        batch = self.base([*items, *items])
        batch["meta"]["pair_index"] = batch["meta"]["row_index"][: int(batch["rows"]) // 2]
        return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
