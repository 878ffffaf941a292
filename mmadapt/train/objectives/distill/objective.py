"""`train.objective: distill`: on-policy distillation (trl's GKD with every completion the student's own, lmbda 1;
Qwen3's and Thinking Machines' per-token reverse KL at beta 1), with the settings of the run config's `distill` section
(`settings.py`) and a teacher that shares the student's tokenizer (`teacher.py`).

A step, for each micro-batch of B prompts (`mmadapt.data.prompts`, as GRPO's; an `answer` is not needed):

0. each picture is encoded once by the student (in training mode, with gradients when its vision side trains: that
   one encoding serves the rollout, detached, and the student's forward, with its graph) and once by the teacher's
   own vision side (no grad), whose encoding serves the teacher's G rows of its prompt (`Encoded.for_rows`);
1. rollout (`training_rows`, `sample`): the student answers each prompt G = `num_generations` times (the shared
   rollout: prefilled once, each answer from its own seed, at `temperature` / `top_p`), laid out as `scored_rows`
   (prompt then answer, the answer's tokens, its end token included, as labels);
2. the teacher scores the student's tokens: its last hidden states at the positions that predict an answer token
   (`heads.CompletionStates`, no grad); the student's forward sums trl's generalised JSD over the same positions
   (`heads.Divergence`: `loss.chunked_generalized_jsd`, no (N, V) logits), divided by the step's answer tokens over
   every micro-batch and rank (`units`), so accumulation and ranks equal one big batch. trl's `compute_loss` is the
   same per-token mean (its `batchmean` over the kept labels, or `num_items_in_batch`), at softmax temperature 1
   (`loss_temperature`), sampling at its `temperature` 0.9.

Logged per step: `divergence` (the mean per answer token: the step's loss), completion lengths (mean, max, the share
cut at `max_completion_length`), `rollout_s`. `eval_batch` answers each eval prompt once, greedily, by the student,
and scores it as a step does: `eval_loss` (the mean per-token divergence to the teacher on those answers, trl's eval
name) and `eval_completion_length`.

The teacher is loaded once in `setup` (before the student is moved and wrapped), frozen, in eval mode, moved to the
run's device in `prepare`, its weights in the run's compute dtype (bf16 under bf16-autocast, else fp32). Under FSDP2
the teacher is replicated on every rank, never sharded: each GPU holds its whole weights (`memory`), and its forward
runs no collective, so ranks with uneven work stay paired by the student's collectives alone. Those follow GRPO's
rules (`grpo.objective`): the root's own parameters gathered around encoding and decoding (`gathered`), a rank whose
micro-batch holds no prompt answers a stand-in whose rows count for nothing (`stand_in`, `masked_out`), and the eval
runs as many rounds on every rank (the trainer's).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import inputs_of, to_device
from mmadapt.train.objectives.base import Run, StepResult, StepTotals, Terms
from mmadapt.train.objectives.distill.heads import CompletionStates, Divergence
from mmadapt.train.objectives.distill.settings import DistillSettings
from mmadapt.train.objectives.distill.teacher import (
    check_same_tokenizer,
    check_same_vocabulary,
    load_teacher,
    teacher_parameters,
)
from mmadapt.train.objectives.grpo.view import AnswerScorer
from mmadapt.train.objectives.online import ROLLOUT, OnlineObjective, gathered
from mmadapt.train.objectives.rollout import (
    Encoded,
    Rollouts,
    check_groups,
    encode_prompts,
    rollout,
    row_seeds,
    scored_rows,
)

log = logging.getLogger(__name__)
EVAL_NAMES = ("divergence", "tokens", "answers", "length")


class DistillObjective(OnlineObjective):
    """`train.objective: distill` (the module docstring)."""

    section = "distill"
    settings_class = DistillSettings
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.rows_per_sample = self.settings.num_generations  # the plan's rows per prompt
        self.teacher: Any = None
        self.teacher_tokenizer: Any = None
        self.scorer: AnswerScorer | None = None  # the student's tokenizer, end and pad ids (no rewards)
        self.image_token_id: int | None = None
        self.tokenizer_checked = False

    # ---- data, the teacher ---------------------------------------------------------------------------------------
    def bind(self, encoder: Any, model: Any) -> None:
        """The student's tokenizer, its end and pad ids (`AnswerScorer`, no rewards), and the image token."""
        self.scorer = AnswerScorer.for_encoder(encoder, (), self.settings.max_completion_length)
        self.image_token_id = model.tokens.image_token_id
        self.check_tokenizer()

    def setup(self, model: Any) -> None:
        """The teacher, loaded once before the student is moved and wrapped: frozen, eval mode, the run's compute
        dtype; its tokenizer and vocabulary the student's (one-line `ValueError` naming both otherwise)."""
        s = self.settings
        if self.teacher is None:
            self.teacher, self.teacher_tokenizer = load_teacher(s.teacher)
        check_same_vocabulary(model, self.teacher, s.teacher)
        self.check_tokenizer()
        self.teacher.to(dtype=self.config.precision.mode.compute_dtype)
        log.info("objective: distill (teacher %s, beta %g, G %d, sampling at %g, the divergence at %g)", s.teacher,
                 s.beta, s.num_generations, s.temperature, s.loss_temperature)

    def check_tokenizer(self) -> None:
        if self.tokenizer_checked or self.scorer is None or self.teacher_tokenizer is None:
            return
        student = self.config.model.pretrained or "built from the run's model section"
        check_same_tokenizer(self.scorer.tokenizer, self.teacher_tokenizer, student, self.settings.teacher)
        self.tokenizer_checked = True

    def prepare(self, run: Run) -> None:
        prompts = getattr(run.train_data, "encoder", None)
        if self.scorer is None and prompts is not None:  # the trainer's own instance: from the run's dataset
            self.bind(prompts.encoder, run.model)
        if self.scorer is None or self.teacher is None:
            raise ValueError("train.objective distill trains on mmadapt.data.prompts.PromptDataset (its objective's "
                             "data(): mmadapt.train.run.build_run gives it), after setup() loaded the teacher")
        self.teacher.to(run.device)
        self.first_forward(run)

    def memory(self, model: Any, precision: Any) -> dict[str, int]:
        """The rollout: the micro-batch's B prompts answered G times (`generation_bytes`)."""
        from mmadapt.generation import generation_bytes

        d, s = self.config.data, self.settings
        return {"rollout": generation_bytes(model, d.batch_size, s.num_generations, d.max_length,
                                            precision.hidden_bytes)}

    def resident_memory(self, model: Any, precision: Any) -> dict[str, int]:
        """The teacher's weights, whole on every GPU (replicated under FSDP2) throughout the run, in the compute
        dtype (0, and a warning, for a teacher path that is not here: a recipe's, like its absent checkpoints)."""
        s = self.settings
        try:
            return {"teacher": teacher_parameters(s.teacher) * precision.hidden_bytes}
        except (OSError, ValueError) as e:
            log.warning("distill.teacher %s cannot be read (%s): its weights are not planned", s.teacher, e)
            return {"teacher": 0}

    # ---- 0-1: encodings and rollouts -----------------------------------------------------------------------------
    def training_rows(self, run: Run, micro: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each micro-batch of prompts -> the student's B x G answers, laid out as the rows both models score."""
        s, model = self.settings, run.model
        micro = [to_device(batch, run.device) for batch in micro]
        stand_ins = self.stand_ins(run, micro)  # {k: micro-batch k's own meta} where a stand-in answers for it
        micro = [self.stand_in(run) if k in stand_ins else batch for k, batch in enumerate(micro)]
        started = time.perf_counter()
        encoded = [self.encode(run, batch) for batch in micro]  # the step's one student encoding of each picture
        taught = [self.teacher_encode(run, batch) for batch in micro]  # ... and the teacher's
        was_training = model.training
        model.eval()
        try:
            with run.precision_context(), gathered(run.wrapped):
                done = [self.sample(model, batch, s.num_generations, s.temperature, pictures, seeds=row_seeds(
                    run.cfg.train.seed, run.step, [ids[0] for ids in batch["meta"]["sample_ids"]],
                    s.num_generations)) if batch["input_ids"].shape[0] else None
                        for batch, pictures in zip(micro, encoded, strict=True)]
        finally:
            model.train(was_training)
        rows = [self.masked_out(batch, r, pictures, teacher, stand_ins[k]) if k in stand_ins
                else {**batch, "logged": {}} if r is None else self.scored(batch, r, pictures, teacher)
                for k, (batch, r, pictures, teacher) in enumerate(zip(micro, done, encoded, taught, strict=True))]
        if rows:
            rows[0]["logged"]["rollout_s"] = time.perf_counter() - started
        return rows

    def sample(self, model: Any, batch: dict[str, Any], num_generations: int, temperature: float,
               pictures: Encoded | None, *, seeds: torch.Tensor | None = None) -> Rollouts:
        """The student's answers to a prompt batch (the shared `rollout`, called from here alone): training's
        sampled ones, the eval's greedy one (temperature 0)."""
        from mmadapt.sampling import Sampling

        s = self.settings
        sampling = Sampling(max_new_tokens=s.max_completion_length, temperature=temperature, top_p=s.top_p)
        return rollout(model, self.scorer.processor, batch, num_generations, sampling, seeds=seeds,
                       encoded=None if pictures is None else pictures.detached())

    def scored(self, batch: dict[str, Any], done: Rollouts, pictures: Encoded | None,
               teacher: Encoded | None) -> dict[str, Any]:
        """The rows both models score, with the rollouts, the counted tokens and the two encodings."""
        rows = scored_rows(batch, done, self.scorer.pad_token_id)
        check_groups(rows, done.num_generations, self.image_token_id)
        return {**rows, "meta": batch.get("meta", {}), "logged": {}, ROLLOUT: {
            "rollouts": done, "mask": done.mask, "student": pictures, "teacher": teacher, "stand_in": False}}

    def masked_out(self, batch: dict[str, Any], done: Rollouts, pictures: Encoded | None, teacher: Encoded | None,
                   meta: Any) -> dict[str, Any]:
        """A stand-in's rows: scored like any rows but with no label (no position summed: zero loss, zero gradient,
        the forward's collectives still paired), no token counted, nothing logged, the meta of the micro-batch it
        stands in for (its problems)."""
        rows = self.scored(batch, done, pictures, teacher)
        rows["labels"] = torch.full_like(rows["labels"], -100)
        rows[ROLLOUT].update(mask=torch.zeros_like(done.mask), stand_in=True)
        return {**rows, "meta": meta}

    def teacher_encode(self, run: Run, batch: dict[str, Any]) -> Encoded | None:
        """The teacher's one encoding of the batch's pictures (its own vision side, no grad; None without any)."""
        if not batch["input_ids"].shape[0]:
            return None
        with torch.no_grad(), run.precision_context():
            return encode_prompts(self.teacher, batch)

    # ---- 2: the loss ---------------------------------------------------------------------------------------------
    def stat_names(self, run: Run) -> tuple[str, ...]:
        return ("divergence",)

    def micro_loss(self, run: Run, batch: dict[str, Any], totals: StepTotals) -> Terms:
        """The summed divergence of the micro-batch's answer tokens over the step's answer tokens (all ranks)."""
        divergence = self.divergence(run.wrapped, batch)
        return Terms(divergence / totals.per_unit, {"divergence": divergence.detach()})

    def divergence(self, student: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The summed per-token divergence of a scored batch's answer tokens: the teacher's states (no grad, its
        encoding), then the student's forward through `student` (its encoding, with its graph)."""
        s, rolled, rows = self.settings, batch[ROLLOUT], inputs_of(batch)
        taught = {} if rolled["teacher"] is None else rolled["teacher"].for_rows(rows)
        with torch.no_grad():
            teacher = self.teacher(**rows, **taught, head=CompletionStates())
        given = {} if rolled["student"] is None else rolled["student"].for_rows(rows)
        head = Divergence(teacher, beta=s.beta, temperature=s.loss_temperature, chunk_size=s.chunk_size)
        return student(**rows, **given, head=head).divergence

    def step_result(self, run: Run, micro: list[dict[str, Any]], loss: float, sums: dict[str, float],
                    totals: StepTotals) -> StepResult:
        """The mean divergence per answer token, the answers' lengths and the rollout's time (every rank's)."""
        logged = {"divergence": float(sums["divergence"]) / totals.per_unit, **self.logged(micro)}
        return StepResult(loss, totals.per_unit, logged)

    def logged(self, micro: list[dict[str, Any]]) -> dict[str, float]:
        """The step's completion lengths (mean, max, truncated share) and the slowest rank's rollout seconds."""
        answered = [b[ROLLOUT]["rollouts"] for b in micro if ROLLOUT in b and not b[ROLLOUT]["stand_in"]]
        local = {"lengths": torch.cat([r.lengths.float() for r in answered]).tolist() if answered else [],
                 "truncated": torch.cat([r.truncated.float() for r in answered]).tolist() if answered else [],
                 "rollout_s": max([b["logged"].get("rollout_s", 0.0) for b in micro if b.get("logged")] or [0.0])}
        everyone = dist_utils.gather_objects(local)
        lengths = [x for rank in everyone for x in rank["lengths"]]
        truncated = [x for rank in everyone for x in rank["truncated"]]
        out = {"rollout_s": max(rank["rollout_s"] for rank in everyone)}
        if lengths:
            out.update({"completion_length/mean": sum(lengths) / len(lengths), "completion_length/max": max(lengths),
                        "completion_length/truncated": sum(truncated) / len(truncated)})
        return out

    # ---- evaluation ----------------------------------------------------------------------------------------------
    def eval_stat_names(self, run: Run) -> tuple[str, ...]:
        return EVAL_NAMES

    def eval_batch(self, run: Run, items: list[Any], batch: dict[str, Any]) -> dict[str, float]:
        """One greedy answer per eval prompt by the student, and its summed divergence to the teacher."""
        batch = to_device(batch, run.device)
        with torch.no_grad():
            with gathered(run.wrapped):
                pictures = encode_prompts(run.model, batch)
                done = self.sample(run.model, batch, 1, 0.0, pictures)
            scored = self.scored(batch, done, pictures, self.teacher_encode(run, batch))
            divergence = self.divergence(run.model, scored)
        return {"divergence": float(divergence), "tokens": float(done.mask.sum()), "answers": float(len(done.mask)),
                "length": float(done.lengths.sum())}

    def eval_metrics(self, run: Run, sums: dict[str, float]) -> dict[str, float]:
        """`eval_loss`: the mean per-token divergence of the greedy answers; `eval_completion_length`: their mean."""
        return {"eval_loss": sums["divergence"] / max(sums["tokens"], 1.0),
                "eval_completion_length": sums["length"] / max(sums["answers"], 1.0)}
