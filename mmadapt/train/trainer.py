"""The training loop shared by `mmadapt train`, `mmadapt demo` and notebooks, for every training objective.

One optimizer step = `grad_accum` micro-batches per rank. What a step learns is the run's objective's
(`train.objective`, `mmadapt.train.objectives`: next-token SFT, DPO and its variants, GRPO, or any registered one): it
gives each micro-batch's loss, normalised over the whole global batch (all micro-batches, all ranks) so that
accumulation and data parallelism equal one big batch, and each eval batch's sums; it prepares what it needs before
the first step (a preference reference), may make the rows it trains on before each step, and keeps its own state in
the checkpoints. The trainer owns the rest: the accumulation and the eval rounds, one way for every objective
(`mmadapt.train.steps`), data order, the guards, the optimizer, logging, checkpoints and the final model directory.

Before the optimizer step the loss and the gradient norm are checked: a non-finite step is skipped (gradients
dropped), counted and logged; after `max_consecutive_skips` in a row the run stops with `NonFiniteError`, naming the
first module that produced non-finite values (`mmadapt.train.guard`). Bad samples (`DataProblem`s: a missing image,
too long, ...) are dropped by the collator, counted and logged (the first of each reason with its sample id and
file); once more than `data.max_bad_fraction` of the samples seen were bad, the run stops with `BadDataError`
(`BadSampleBudget` in `mmadapt.data.report`; the trainer only sums the counts over the ranks). The counters, the
step, the log records and the objective's state are one `TrainerState`, saved with every checkpoint.

Precision (printed at start): `fp32`, or `bf16-autocast` = bf16 compute under autocast with fp32 master weights,
fp32 AdamW state, fp32 gradient accumulation and fp32 gradient reduction (DDP reduces the fp32 grads; FSDP2 uses
`reduce_dtype=float32`).

Data order is a pure function of (seed, step) (`mmadapt.train.batches.GlobalBatchSampler`), so `resume` continues
exactly: the sampler starts at the checkpoint's step, and model, optimizer, scheduler and RNG states are restored.
Rank 0 chooses the checkpoint to resume and every rank checks that it holds the same one (its `COMPLETE` marker,
which lists every file's checksum), so a node-local `OUT` never starts ranks at different steps.

A step means the same on every world size: a step in which no rank saw an image or a video leaves the vision side
untouched, as in one process (`guard.drop_unseen_vision_gradients`). An exception on one rank ends every rank
promptly with that rank's message (`distributed.failing_together`); rank 0 writes the final model directory after
the last collective, so no rank waits for it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from mmadapt.atomic import open_unlinked
from mmadapt.data.mixture import Mixture
from mmadapt.data.report import BadDataError as BadDataError  # moved; imported from here too (mmadapt.train)
from mmadapt.data.report import BadSampleBudget
from mmadapt.data.stream import StreamingDataset, StreamLayout
from mmadapt.directory import write_model_files
from mmadapt.run_directory import RunDirectory
from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import GlobalBatchSampler
from mmadapt.train.checkpoint import (
    MARKER,
    OutLock,
    UnverifiedCheckpointError,
    latest_checkpoint,
    newest_verified,
    none_verified,
    rng_state,
)
from mmadapt.train.config import RunConfig
from mmadapt.train.cpu_memory import return_freed_memory
from mmadapt.train.export import export
from mmadapt.train.guard import NonFiniteError as NonFiniteError  # moved; imported from here too (mmadapt.train)
from mmadapt.train.guard import drop_unseen_vision_gradients, non_finite_error
from mmadapt.train.objectives import check_sequence_parallel, objective_for
from mmadapt.train.optim import enable_activation_checkpointing, parameter_groups, total_steps, warmup_steps
from mmadapt.train.optim import upcast_trainable as upcast_trainable  # moved; imported from here too (plan, benchmarks)
from mmadapt.train.plots import plot_history
from mmadapt.train.records import learning_rates, step_speed
from mmadapt.train.saving import CheckpointWriter, Snapshot, adapter_state, describe_format, load_state
from mmadapt.train.stages import LORA_MODES, apply_stages, save_adapters
from mmadapt.train.state import TrainerState, state_field
from mmadapt.train.steps import accumulate, evaluate
from mmadapt.train.tracking import PartClock, Tracker, peak_tflops, speed_summary

log = logging.getLogger(__name__)


class Trainer:
    """`Trainer(model, config, train_data, collate_fn).fit()`; works for 1 process or under torchrun."""

    step, skipped, consecutive_skips = state_field("step"), state_field("skipped"), state_field("consecutive_skips")
    samples_seen, bad_samples = state_field("samples_seen"), state_field("bad_samples")
    bad_counts, first_bad, history = state_field("bad_counts"), state_field("first_bad"), state_field("history")

    def __init__(self, model: Any, config: RunConfig, train_data: Dataset, collate_fn: Callable,
                 *, eval_data: Dataset | None = None, evaluate: Callable[[Any, int], dict[str, float]] | None = None,
                 apply_stage_modes: bool = True, tokenizer: Any = None) -> None:
        """`tokenizer` is saved with every checkpoint and with `OUT/model`, so both are complete for inference."""
        self.cfg, self.model, self.train_data, self.collate_fn = config, model, train_data, collate_fn
        self.tokenizer = tokenizer
        self.eval_data, self.evaluate = eval_data, evaluate
        self.dist = dist_utils.init(config.distributed.timeout_minutes, config.distributed.sequence_parallel)
        if config.train.eval_tasks:  # lmms-eval (mmadapt.lmms_eval.tasks): checked before training starts
            from mmadapt.lmms_eval.tasks import check_eval_tasks

            check_eval_tasks(config.train.eval_tasks, world=self.dist.world, tokenizer=tokenizer)
        self.device = self.dist.device
        if self.device.type == "cpu" and (done := return_freed_memory()) is not None:
            log.info(done)
        self.run = RunDirectory(config.train.out)  # the run's layout: every file this loop writes
        self.out = self.run.path
        torch.manual_seed(config.train.seed)
        if apply_stage_modes:
            self.param_counts = apply_stages(model, config.stages, config.lora, config.quantization)
        upcast_trainable(model)
        if config.train.activation_checkpointing:
            log.info("activation checkpointing: %s", ", ".join(enable_activation_checkpointing(
                model, config.train.activation_checkpointing)))
        if hasattr(model, "full_logits_loss"):
            model.full_logits_loss = config.train.full_logits
        self.objective = objective_for(config)
        self.cfg = config = self.objective.config  # its settings resolved, as the run saves them
        self.objective.setup(model)
        if (size := self.dist.sequence_parallel) > 1:  # the ranks of a group share each sample's sequence
            from mmadapt.sequence_parallel import SequenceParallel

            check_sequence_parallel(self.objective, model, size)
            model.sequence_parallel = SequenceParallel(self.dist.sequence_group, size, self.dist.sequence_rank,
                                                       vision=config.distributed.sequence_parallel_vision)
        model.to(self.device)
        self.wrapped = dist_utils.wrap(model, self.dist, config.distributed.strategy, config.precision.mode)
        if not any(p.requires_grad for p in self.wrapped.parameters()):
            raise ValueError("no trainable parameters: every component is frozen (check `stages`)")
        t = config.train
        groups = parameter_groups(model, self.wrapped, lr=t.lr, weight_decay=t.weight_decay, lr_by_part=t.lr_by_part)
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        global_batch = config.data.batch_size * t.grad_accum * self.dist.data_world
        # the dataset's size only when epochs ask for it (a stream counts its shards' samples for it)
        self.total_steps = total_steps(t, len(train_data) // global_batch if t.epochs is not None else 0)
        self.warmup_steps = warmup_steps(t, self.total_steps)
        if t.epochs is not None:
            log.info("train.epochs %s: %d steps of %d samples", t.epochs, self.total_steps, global_batch)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(t.schedule, self.optimizer, num_warmup_steps=self.warmup_steps,
                                       num_training_steps=self.total_steps)
        self.state = TrainerState()
        self.tracker: Tracker | None = None
        self.plan: dict[str, Any] | None = None  # the run's memory plan, logged with the config (train.run sets it)
        self.warned_slow_data = False
        self.rows_are_new = True  # this step's micro-batches are a new loader batch (not one serving its next step)
        self.step_sources: dict[str, dict[str, int]] = {}  # this step's counts per mixture source (count_problems)
        self.peak_tflops = peak_tflops(self.device, t.peak_tflops)
        c = config.checkpoint
        self.writer = CheckpointWriter(self.out, format=c.format, asynchronous=c.async_, keep=c.keep,
                                       is_main=self.is_main, on_complete=self.write_adapters)
        if config.checkpoint.resume:
            with dist_utils.failing_together(), self.out_lock():
                self.resume()

    @property
    def is_main(self) -> bool:
        return self.dist.rank == 0

    def precision_context(self) -> Any:
        """The context every forward runs in (`mmadapt.precision.Precision.autocast`)."""
        return self.cfg.precision.mode.autocast(self.device)

    def stream_layout(self) -> StreamLayout:
        """What a stream's position means in this run (`mmadapt.data.stream`): ranks, loader workers, batching."""
        return StreamLayout(self.dist.data_world, self.cfg.data.num_workers, self.cfg.data.batch_size,
                            self.cfg.train.grad_accum)

    def loader(self, start_step: int) -> Iterator[dict[str, Any]]:
        if isinstance(self.train_data, StreamingDataset):  # every stream starts where `start_step` left it
            part = self.train_data.for_rank(self.dist.data_rank, self.stream_layout(), start_step)
            return iter(DataLoader(part, batch_size=self.cfg.data.batch_size, collate_fn=self.collate_fn,
                                   num_workers=self.cfg.data.num_workers))
        sampler = GlobalBatchSampler(len(self.train_data), micro_batch=self.cfg.data.batch_size,
                                     grad_accum=self.cfg.train.grad_accum, seed=self.cfg.train.seed,
                                     rank=self.dist.data_rank, world=self.dist.data_world, start_step=start_step,
                                     epoch_indices=isinstance(self.train_data, Mixture))
        return iter(DataLoader(self.train_data, batch_sampler=sampler, collate_fn=self.collate_fn,
                               num_workers=self.cfg.data.num_workers))

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to `train.steps`, checkpointing and evaluating on the way; then OUT/model. Returns the summary."""
        try:
            with dist_utils.failing_together(), self.out_lock():
                return self.train_loop()
        except BaseException:
            self.writer.close(quietly=True)  # a checkpoint written in the background is finished (or given up)
            raise

    def out_lock(self) -> Any:
        """Rank 0's exclusive claim on OUT for as long as the block runs (`OutLock`): a second run on the same OUT
        stops at once with `OutInUseError` naming this one, instead of mixing checkpoints with it."""
        return OutLock.acquire(self.out) if self.is_main else nullcontext()

    def train_loop(self) -> dict[str, Any]:
        t = self.cfg.train
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.step == 0:
                self.check_fresh_out()
            self.cfg.save(self.run.config_file)
            log.info(self.cfg.precision.mode.describe())
            if isinstance(self.train_data, Mixture):
                log.info("training on a mixture of %d sources, %d samples per epoch:\n%s",
                         len(self.train_data.sources), len(self.train_data), self.train_data.describe())
        self.objective.prepare(self)
        per_batch = self.objective.steps_per_batch  # optimizer steps per loader batch (GRPO's num_iterations)
        batches = self.loader(self.step // per_batch)
        rows: list[dict[str, Any]] = []
        progress = self.progress_bar()
        self.tracker = Tracker(self.out, t.report_to, self.cfg.to_dict(), plan=self.plan) if self.is_main else None
        clock = PartClock(self.model, self.device) if hasattr(self.model, "encoder") else None
        last_eval = None
        started = time.perf_counter()
        while self.step < self.total_steps:
            step_started = time.perf_counter()
            waited, fresh = 0.0, self.step % per_batch == 0 or not rows
            if fresh:  # a loader batch's rows serve per_batch steps
                rows = [next(batches) for _ in range(t.grad_accum)]
                waited = time.perf_counter() - step_started
                rows = self.objective.training_rows(self, rows)
            micro, self.rows_are_new = rows, fresh
            record = self.train_step(micro, clock)
            self.step += 1
            record.update(step=self.step, seconds=round(time.perf_counter() - started, 3))
            self.add_speed(record, micro, waited, time.perf_counter() - step_started)
            last_eval = None
            if t.eval_every and self.step % t.eval_every == 0:
                last_eval = self.run_eval()
                record.update(last_eval)
            if (saving := self.writer.in_flight) is not None:
                record["saving"] = saving  # the step ran while that checkpoint was written in the background
            self.log(record, progress)
            every = self.cfg.checkpoint.every
            if every and self.step % every == 0 and self.step < self.total_steps:
                self.save()
        for opened in (progress, clock, self.tracker):
            if opened is not None:
                opened.close()
        if last_eval is not None:  # the last step was just evaluated
            final_eval = last_eval
        elif self.eval_data is not None or self.evaluate is not None or t.eval_tasks:
            final_eval = self.run_eval()
        else:
            final_eval = {}
        final = self.save(last=True)  # its barrier is the run's last collective: no rank waits for the export below
        self.writer.close()
        if self.is_main:
            plot_history(self.history, self.run.loss_plot)
            self.export_model(final)
        return {"steps": self.step, "skipped": self.skipped, "bad_samples": self.bad_samples,
                "samples_seen": self.samples_seen, "seconds": time.perf_counter() - started,
                "history": self.history, "speed": speed_summary(self.history), **final_eval}

    def check_fresh_out(self) -> None:
        """A fresh run never mixes with an earlier run's checkpoints (resume or pruning would pick theirs)."""
        earlier = latest_checkpoint(self.out)
        if earlier is not None:
            raise ValueError(f"{self.out} already holds checkpoints of an earlier run ({earlier.name}). Fix: continue "
                             "it with --resume (checkpoint.resume=true), or choose another train.out.")
        self.run.log_file.unlink(missing_ok=True)

    def train_step(self, micro: list[dict[str, Any]], clock: PartClock | None = None) -> dict[str, Any]:
        """Forward/backward over the micro-batches, guard, clip, optimizer step. Returns the log record, with the
        seconds of the forward + backward (vision side and LLM, `clock`) and of the optimizer under "time". The
        micro-batches' samples count towards the samples seen and the bad-sample budget unless they are a batch
        serving its next step (`rows_are_new` False: `Objective.steps_per_batch`)."""
        started = time.perf_counter()
        result = accumulate(self, self.objective, micro, clock)
        loss_value = result.loss
        forward_backward = time.perf_counter() - started
        vision = clock.take() if clock is not None else 0.0
        t = self.cfg.train
        grad_norm = dist_utils.grad_norm_and_clip(self.wrapped, t.clip_grad_norm)
        record = {"loss": loss_value, "grad_norm": grad_norm, **learning_rates(self.scheduler, self.optimizer, t.lr,
                                                                                t.lr_by_part),
                  "tokens": result.tokens, "problems": self.count_problems(micro) if self.rows_are_new else 0,
                  **result.logged}
        if self.step_sources:  # a mixture: this step's samples, problems and (from the objective) loss per source
            record["sources"] = {name: {**counts, **record.get("sources", {}).get(name, {})}
                                 for name, counts in self.step_sources.items()}
        if math.isfinite(loss_value) and math.isfinite(grad_norm):
            drop_unseen_vision_gradients(self.model, micro, self.dist, self.device)
            self.optimizer.step()
            self.consecutive_skips = 0
        else:
            self.skipped += 1
            self.consecutive_skips += 1
            record["skipped"] = True
            log.warning("step %d: non-finite %s; step skipped (%d in a row, %d in all)", self.step + 1,
                        "loss" if not math.isfinite(loss_value) else "gradient norm", self.consecutive_skips,
                        self.skipped)
            if self.consecutive_skips >= self.cfg.train.max_consecutive_skips:
                self.optimizer.zero_grad(set_to_none=True)
                self.stop_non_finite(micro[0])
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        record["time"] = {"vision": vision, "llm": forward_backward - vision,
                          "optimizer": time.perf_counter() - started - forward_backward}
        return record

    def add_speed(self, record: dict[str, Any], micro: list[dict[str, Any]], waited: float, seconds: float) -> None:
        """The step's time split (data / vision / llm / optimizer, and the whole step) and speed (`step_speed`); a
        one-time warning when the step waits for data more than `train.slow_data_share` of its time."""
        record["time"] = {"data": waited, **record["time"], "step": seconds}
        record.update(step_speed(self.model, micro, record["tokens"], seconds, self.device, self.peak_tflops,
                                    self.dist.data_group),
                      skipped_steps=self.skipped, bad_samples=self.bad_samples)
        share = self.cfg.train.slow_data_share
        if self.step > 2 and not self.warned_slow_data and waited > share * seconds:
            self.warned_slow_data = True
            log.warning("step %d waited %.0f%% of its %.2f s for data (train.slow_data_share %.0f%%): the model is "
                        "starved. Fix: more loader processes (data.num_workers, now %d), packing (data.packing), or "
                        "smaller images (the processor's max pixels)", self.step, 100 * waited / seconds, seconds,
                        100 * share, self.cfg.data.num_workers)

    def source_names(self) -> list[str]:
        """The training mixture's source names (`mmadapt.data.Mixture`), in order; [] for one source."""
        return [s.name for s in self.train_data.sources] if isinstance(self.train_data, Mixture) else []

    def count_problems(self, micro: list[dict[str, Any]]) -> int:
        """Sum one global batch's samples and bad samples over the ranks and hand them to the bad-sample budget
        (it logs the first of each reason and raises `BadDataError` when over budget). Returns the step's count.
        A mixture's counts per source go into the state (`TrainerState.sources`) and `self.step_sources`."""
        problems = [p for b in micro for p in b.get("meta", {}).get("problems", ())]
        good = sum(len(row) for b in micro for row in b.get("meta", {}).get("sample_ids", ()))
        names = self.source_names()
        per_source = [0] * (2 * len(names))
        for b in micro:
            for row in b.get("meta", {}).get("sources", ()):
                for name in row:
                    per_source[names.index(name)] += 1
        for p in problems:
            if p.get("source") in names:
                per_source[len(names) + names.index(p["source"])] += 1
        counts = dist_utils.all_reduce_sum(torch.tensor([good + len(problems), len(problems), *per_source],
                                                        device=self.device), self.dist.data_group)
        seen, bad, *per_source = (int(v) for v in counts.tolist())
        self.step_sources = {}
        for k, name in enumerate(names):
            step = {"samples": per_source[k] + per_source[len(names) + k], "problems": per_source[len(names) + k]}
            total = self.state.sources.setdefault(name, {"samples": 0, "problems": 0})
            for key, value in step.items():
                total[key] += value
            self.step_sources[name] = step
        budget = self.bad_sample_budget()
        budget.add(problems, seen, bad)
        if bad:
            budget.check(self.step + 1)
        return bad

    def bad_sample_budget(self) -> BadSampleBudget:
        """The budget of `data.max_bad_fraction`, counting into `self.state` (so its counts are checkpointed)."""
        return BadSampleBudget(self.state, self.cfg.data.max_bad_fraction, logger=log)

    def stop_non_finite(self, batch: dict[str, Any]) -> None:
        head = (f"stopping at step {self.step + 1}: {self.consecutive_skips} consecutive non-finite steps "
                f"({self.skipped} skipped in all)")
        raise non_finite_error(self.model, batch, self.device, self.precision_context, head,
                               self.run.nonfinite_file if self.is_main else None)

    # ---- evaluation, logging, checkpoints ------------------------------------------------------
    @torch.no_grad()
    def run_eval(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.eval_data is not None:
            out.update(evaluate(self, self.objective))
        if self.evaluate is not None:
            out.update(self.evaluate(self.model, self.step))
        if self.cfg.train.eval_tasks:
            from mmadapt.lmms_eval.tasks import evaluate_tasks

            out.update(evaluate_tasks(self.model, self.tokenizer, self.cfg, step=self.step, out=self.out))
        self.wrapped.train()
        return out

    def progress_bar(self) -> Any:
        if not (self.is_main and self.cfg.train.progress):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc="training", unit="step")

    def log(self, record: dict[str, Any], progress: Any) -> None:
        self.history.append(record)
        if not self.is_main:
            return
        self.tracker.log(record)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}", grad=f"{record['grad_norm']:.3g}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")
        if self.step % max(self.cfg.train.log_every, 1) == 0 or record.get("skipped"):
            log.info("step %d  loss %.4f  grad_norm %.4g  lr %.3g%s%s", record["step"], record["loss"],
                     record["grad_norm"], record["lr"], "  SKIPPED" if record.get("skipped") else "",
                     "".join(f"\n  {name}: {v['samples']} samples, {v['problems']} problems, loss "
                             f"{v.get('loss', math.nan):.4f}" for name, v in record.get("sources", {}).items()))

    def save(self, *, last: bool = False) -> Path | None:
        """Checkpoint this step (`CheckpointWriter`: sharded or gathered, in the background with checkpoint.async);
        returns its path once complete, None while it is written in the background. `last`: the run's final one,
        always written before this returns (the model directory is exported from it)."""
        self.state.objective = self.objective.state_dict()
        self.state.batching = self.batching()
        if isinstance(self.train_data, StreamingDataset):
            self.state.stream = self.stream_layout().to_dict()
        snapshot = Snapshot(scheduler=self.scheduler.state_dict(), rng=rng_state(),
                            trainer_state=copy.deepcopy(self.state.to_dict()), config=self.cfg,
                            extras=self.write_model_files)
        return self.writer.save(self.step, wrapped=self.wrapped, model=self.model, optimizer=self.optimizer,
                                snapshot=snapshot, synchronous=last)

    def batching(self) -> dict[str, int]:
        """What a step's global batch is made of: a checkpoint resumes only where a step means the same samples."""
        return {"global_batch": self.cfg.data.batch_size * self.cfg.train.grad_accum * self.dist.data_world,
                "data_ranks": self.dist.data_world, "batch_size": self.cfg.data.batch_size,
                "grad_accum": self.cfg.train.grad_accum}

    def write_adapters(self, checkpoint: Path) -> None:
        """This run's own adapters (OUT/adapters), replaced whole at each checkpoint, read from the checkpoint."""
        if set(LORA_MODES) & set(self.cfg.stages.modes().values()):
            save_adapters(self.model, self.run.adapters_dir, self.cfg.stages.modes(),
                          state=adapter_state(checkpoint, self.model), overwrite=True)

    def write_model_files(self, directory: Path) -> None:
        """What a checkpoint needs to become a model directory: the model's config, the tokenizer and the weights the
        model carries from its starting checkpoint (`mmadapt.carried`)."""
        write_model_files(self.model, directory, self.tokenizer)

    def export_model(self, checkpoint: Path) -> Path:
        """OUT/model: the final checkpoint as a model directory (LoRA merged; adapters stay in OUT/adapters)."""
        target = self.run.model_dir
        # this run's own export (a resumed run rewrites it), swapped whole; the checkpoint was hashed as it was written
        export(checkpoint, target, overwrite=True, verify=False)
        log.info("model directory: %s (load it with VisionLanguageModel.from_pretrained)", target)
        return target

    def resume(self) -> None:
        """Rank 0 chooses the newest verified checkpoint; every rank loads that one, after checking that its own copy
        has the same `COMPLETE` marker (the same files, by checksum). A rank without it (a node-local `OUT`) ends the
        run on every rank with a message that names the ranks."""
        path = self.agreed_checkpoint()
        if path is None:
            log.info("resume: no complete checkpoint in %s; starting from step 0", self.out)
            return
        self.check_same_batching(path, json.loads((path / "trainer_state.json").read_text()))
        state = load_state(path, wrapped=self.wrapped, model=self.model, optimizer=self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.state = TrainerState.from_dict(state["trainer"])
        self.objective.load_state_dict(self.state.objective)
        steps = dist_utils.gather_objects(self.step)
        if len(set(steps)) > 1:
            raise RuntimeError(f"resume: the ranks loaded different steps {steps} from {path}")
        if self.is_main:  # the log restarts from the checkpoint: steps after it are redone
            with open_unlinked(self.run.log_file, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.history))
        log.info("resumed from %s at step %d (%s)", path, self.step, describe_format(path))

    def check_same_batching(self, path: Path, saved: dict[str, Any]) -> None:
        """A checkpoint resumes only where its steps mean the same samples: a stream read the same way, a map-style
        dataset's global batch as large (the sampler's step s is then the same samples on any world size)."""
        if isinstance(self.train_data, StreamingDataset):
            if (taken := saved.get("stream") or "a map-style run") != self.stream_layout().to_dict():
                raise ValueError(f"resume: {path} was taken reading the stream as {taken}, this run reads it as "
                                 f"{self.stream_layout().to_dict()}: the same step would "
                                 "mean other samples. Fix: resume with the same ranks, data.num_workers, "
                                 "data.batch_size and train.grad_accum")
            return
        was, now = saved.get("batching"), self.batching()
        if not was or was["global_batch"] == now["global_batch"]:
            return
        accum, rest = divmod(was["global_batch"], now["data_ranks"] * now["batch_size"])
        fix = (f"train.grad_accum={accum} with data.batch_size {now['batch_size']}" if accum and not rest else
               "a data.batch_size that divides it")
        raise ValueError(f"resume: {path.name} was taken with a global batch of {was['global_batch']} samples "
                         f"({was['data_ranks']} data rank(s) x data.batch_size {was['batch_size']} x train.grad_accum "
                         f"{was['grad_accum']}), this run's is {now['global_batch']}: its steps would mean other "
                         f"samples. Fix: keep data ranks x data.batch_size x train.grad_accum = {was['global_batch']}; "
                         f"on {now['data_ranks']} data rank(s): {fix}")

    def agreed_checkpoint(self) -> Path | None:
        """The checkpoint every rank resumes from: rank 0's newest verified one, found with the same marker on every
        rank; None when OUT holds no complete checkpoint; else a `ValueError` on every rank (raised together, so none
        waits for the others), among them `UnverifiedCheckpointError` when every checkpoint fails verification."""
        chosen, failed = newest_verified(self.out) if self.is_main else (None, [])
        marker = marker_text(chosen) if chosen is not None else None
        refusal = None if chosen is not None or not failed else (
            f"resume: {none_verified(self.out, failed)}, so there is none to resume from. Fix: restore the failing "
            "files from a copy of the checkpoints (another node, a backup) and resume again, or start afresh: move "
            f"{self.run.checkpoints_dir} aside (or choose another train.out) and run without --resume")
        name, marker, refusal = dist_utils.broadcast_object((None if chosen is None else chosen.name, marker, refusal))
        if refusal is not None:
            raise UnverifiedCheckpointError(refusal)
        if name is None:
            return None
        path = self.run.checkpoints_dir / name
        found = dist_utils.gather_objects(marker_text(path) == marker)
        missing = [rank for rank, same in enumerate(found) if not same]
        if missing:
            raise ValueError(f"resume: rank 0 resumes from {path}, but rank(s) {missing} do not hold that checkpoint "
                             f"(missing, incomplete or different files under their {self.out}). Fix: give every rank "
                             "the same train.out (shared storage), or copy rank 0's checkpoint to the others.")
        return path


def marker_text(path: Path) -> str | None:
    """A checkpoint's `COMPLETE` marker (its step and every file's checksum), or None when it has none."""
    try:
        return (path / MARKER).read_text()
    except OSError:
        return None
