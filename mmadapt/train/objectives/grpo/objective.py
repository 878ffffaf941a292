"""`train.objective: grpo`: online RL from verifiable rewards (GRPO and its variants DAPO, Dr. GRPO, BNPO), with the
settings of the run config's `grpo` section (`settings.py`: trl's `GRPOConfig` names and defaults, and the rewards,
`grpo.rewards`: `mmadapt.train.rewards`).

A step, for each micro-batch of B prompts (`mmadapt.data.prompts`: trl / EasyR1 / ms-swift records, encoded once):

0. each picture (image or video) of the micro-batch is encoded once (`encode`: in training mode, with gradients
   when the vision side trains), and that one encoding serves the rollout (detached), the policy's forward (with its
   graph) and the reference's (detached; encoded again only when LoRA trains the vision side, whose reference
   differs);

1. rollout (`training_rows`): the policy answers each prompt G = `num_generations` times with mmadapt's `generate`
   (`mmadapt.train.objectives.rollout`: each prompt prefilled once and its cache copied G ways, sampled as
   `GrpoSettings.sampling` says - a `Sampling` of `temperature`, `top_p`, `max_completion_length` - and ended at
   answering's end ids, the vision placeholders and span tokens never generated); each answer samples from its
   own seed (the run's seed, the step, the prompt's id, its place in the group), so it is the same on any rank and
   after a resume;
2. rewards: each answer's text (what answering returns for its ids: `mmadapt.answering.decoded`, special tokens
   removed) scored by the rewards with its prompt's columns; the weighted
   total r, then the group-relative advantages A (`policy_gradient.group_advantages`, per `scale_rewards`; a group
   never leaves its rank, so "group" and "none" are local and "batch" gathers the step's rewards from every rank);
3. backward: the policy's per-token log-probs of each answer at the sampling temperature (`forward(head=TokenLogps())`
   over `scored_rows`), the reference's when `beta` > 0 (the same model with its LoRA adapters off), and the clipped
   loss (`policy_gradient.policy_loss`), normalised so that
   micro-batches and ranks equal one big batch (M = grad_accum x world micro-batch losses per step; dapo's token
   count is the step's, all ranks).

Logged per step: `reward` and each reward's mean (`rewards/<name>/mean`, unscored and failed rows), `reward_std`
(the groups' mean std), `zero_std_groups` (the share of groups whose answers all scored the same: nothing learned
from them), completion lengths (mean, max, truncated share), the time the rollout took (`rollout_s`) and how far its
own log-probs are from the policy's forward (`sampling/sampling_logp_difference/mean|max`: the contract between
them), at a rollout's first step; `entropy`, `kl` and the clip fractions at every step. `evaluate` answers each eval
prompt once, greedily (`answer_prompts`, the one way a model answers, at `GrpoSettings.greedy`), with its real
images, blanked and shuffled among the prompts, and logs the mean reward of each (`eval_reward`,
`eval_reward_blanked`, `eval_reward_shuffled`): a reward that rests on the image falls without it.

With `num_iterations` k > 1 a rollout serves k optimizer steps (`Objective.steps_per_batch`: the loader's batch s is
steps s*k ... s*k + k - 1): the first is on policy (ratio 1) and keeps the policy's per-token log-probs (and the
reference's); the later ones score the same answers with the moved policy, clipped against them, re-encoding the
pictures only when the vision side trains. Checkpoints fall between rollouts (`checkpoint.every` a multiple of k).

Under FSDP2 the rollout gathers the root's own parameters (`gathered`: embeddings, head), and the vision side runs
outside the root's forward as its own units (`distributed.vision_units`: its blocks, the encoder, the projector
gather and reduce their own parameters), so the step's one encoding holds there too, trained or frozen; a rank whose
prompts hold no picture runs the vision side on no picture at that same point (`encode_prompts`), and its rollout and
forwards take that run's exact 0 instead of running it again (each eval prefill likewise, `prepare`). Uneven work
keeps the ranks' gathers paired: `generate` agrees with the other ranks on when decoding ends (a rank whose answers
ended steps on with padding), the eval runs as many rounds on every rank (`batches.eval_rounds`, a stand-in prompt
where a rank has none), and a micro-batch of bad records only is answered by a stand-in whose rows count for nothing
(`stand_in`, `masked_out`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from mmadapt.heads import TokenLogps
from mmadapt.tools import build_tools
from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import inputs_of, to_device
from mmadapt.train.objectives.base import Run, StepResult, StepTotals, Terms, ViewOptions
from mmadapt.train.objectives.grpo import agentic
from mmadapt.train.objectives.grpo.loss import (
    STD_EPSILON,
    PolicyLoss,
    PolicyStats,
    group_advantages,
    nanstd,
    policy_loss,
)
from mmadapt.train.objectives.grpo.settings import GrpoSettings
from mmadapt.train.objectives.grpo.view import AnswerScorer, control_rewards, records_view
from mmadapt.train.objectives.online import ROLLOUT, OnlineObjective, gathered, vision_trains
from mmadapt.train.objectives.reference import adapters_disabled, lora_layers
from mmadapt.train.objectives.rollout import (
    Encoded,
    Rollouts,
    check_groups,
    completion_logps,
    rollout,
    row_seeds,
    scored_rows,
)
from mmadapt.train.objectives.turns import Trajectories
from mmadapt.train.rewards import reward_specs

log = logging.getLogger(__name__)
ENCODED = "encoded"  # ... and the step's one encoding of its prompts' pictures (`rollout.Encoded`)


class GrpoObjective(OnlineObjective):
    """`train.objective: grpo` (the module docstring)."""

    section = "grpo"
    settings_class = GrpoSettings
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        s = self.settings
        self.rows_per_sample = s.num_generations  # the plan's rows per prompt
        self.steps_per_batch = s.num_iterations  # a rollout serves num_iterations optimizer steps
        every = config.checkpoint.every
        if s.num_iterations > 1 and every % s.num_iterations:
            raise ValueError(f"checkpoint.every {every} falls inside a rollout's grpo.num_iterations "
                             f"{s.num_iterations} steps (a resume would lose its answers). Fix: a multiple of "
                             f"{s.num_iterations}")
        self.loss = PolicyLoss(loss_type=s.loss_type, beta=s.beta, epsilon=s.epsilon, epsilon_high=s.epsilon_high,
                               max_completion_length=s.max_completion_length)
        if not s.rewards:
            raise ValueError("train.objective grpo needs grpo.rewards: e.g. 'grpo.rewards=[accuracy]' (built-ins: "
                             "accuracy, format; or package.module:function)")
        self.specs = reward_specs(s.rewards)
        self.scorer: AnswerScorer | None = None
        self.image_token_id: int | None = None
        self.tools = build_tools(s.tools) if s.tools else ()  # user tools imported here, as rewards are
        self.agent: Any = None  # with tools: the template's tool turns and the tools (`agentic.agent_for`, at bind)

    # ---- its view of a file of prompts (`mmadapt eval` / `sees`) ----------------------------------------------------
    view_flags = frozenset({"rewards", "max_new_tokens"})

    @classmethod
    def claims(cls, records: list[Any]) -> bool:
        from mmadapt.data.prompts import is_prompt_record

        return any(is_prompt_record(r) for r in records[:16])

    @classmethod
    def view(cls, model: Any, encoder: Any, records: list[Any], options: ViewOptions) -> Any:
        """The reward view (`view.records_view`): does the reward of greedy answers rest on the images?"""
        return records_view(model, encoder, records, options)

    @classmethod
    def without_code(cls, config: Any, allowed: list[str] | None = None) -> tuple[Any, str | None]:
        """`allowed` given (`mmadapt plan --rewards`), they are the run's rewards, imported when the objective is
        built; otherwise every `grpo.rewards` entry naming code is left out (built-ins stay; `accuracy` stands in when
        none does), so a plan runs no code a config names."""
        section = dict(config.sections.get(cls.section) or {})
        if allowed:
            section["rewards"] = list(allowed)
            return dataclasses.replace(config, sections={**config.sections, cls.section: section}), None
        names = [str(entry.get("name") if isinstance(entry, dict) else entry) for entry in section.get("rewards", [])]
        code = [name for name in names if ":" in name]
        tools = [str(entry.get("name") if isinstance(entry, dict) else entry) for entry in section.get("tools") or []]
        tool_code = [name for name in tools if ":" in name]
        if not code and not tool_code:
            return config, None
        notes = []
        if code:
            section["rewards"] = [entry for name, entry in zip(names, section["rewards"], strict=True)
                                  if name not in code] or ["accuracy"]
            notes.append(f"grpo.rewards names code {code}, not imported (a reward does not change the memory); to "
                         f"import and check it: --rewards {','.join(names)}")
        if tool_code:  # a trajectory is bounded by data.max_length with or without them: the plan is the same
            section["tools"] = [entry for name, entry in zip(tools, section["tools"], strict=True)
                                if name not in tool_code] or ["zoom"]
            notes.append(f"grpo.tools names code {tool_code}, not imported (a trajectory's memory is bounded by "
                         "data.max_length whatever its tools)")
        return dataclasses.replace(config, sections={**config.sections, cls.section: section}), "; ".join(notes)

    def bind(self, encoder: Any, model: Any) -> None:
        """What answering and scoring need (`AnswerScorer`: answering's processor - its end and pad ids, its
        decoding - the rewards and the evals' greedy `Sampling`), and the image token."""
        from mmadapt.data import Collator

        self.scorer = AnswerScorer.for_encoder(encoder, self.specs, self.settings.greedy,
                                               collator=Collator.for_model(model, encoder.pad_token_id))
        self.image_token_id = model.tokens.image_token_id
        if self.tools:
            self.agent = agentic.agent_for(self.settings, encoder, self.tools)

    def prompt_encoder(self, encoder: Any) -> Any:
        """Prompts with room for a first answer; with tools, listing those each prompt offers, its images kept for
        them."""
        from mmadapt.data.prompts import PromptEncoder

        return PromptEncoder(encoder, self.answer_length, self.tools, self.settings.tools_in_prompt)

    def setup(self, model: Any) -> None:
        s = self.settings
        if s.beta > 0:  # the reference is the model with its LoRA adapters off: the starting model only when every
            trained_fully = [part for part, mode in self.config.stages.modes().items() if mode == "full"]  # trained
            if trained_fully or not lora_layers(model):  # part is LoRA (a fully trained part moves it too)
                raise ValueError(
                    f"grpo.beta {s.beta} needs a reference: the model with its LoRA adapters off, which is the "
                    "starting model only when every trained part is LoRA"
                    + (f", but {trained_fully} train fully" if trained_fully else "")
                    + ". Fix: train with LoRA (stages.backbone: lora) and freeze or LoRA the other parts, or set "
                    "grpo.beta: 0 (trl's default)")
        log.info("objective: grpo (loss %s, G %d, beta %g, rewards %s)", s.loss_type, s.num_generations, s.beta,
                 ", ".join(f"{spec.name} x {spec.weight:g}" for spec in self.specs))

    def prepare(self, run: Run) -> None:
        prompts = getattr(run.train_data, "encoder", None)
        if self.scorer is None and prompts is not None:  # the trainer's own instance: from the run's dataset
            self.bind(prompts.encoder, run.model)
        if self.scorer is None:
            raise ValueError("train.objective grpo trains on mmadapt.data.prompts.PromptDataset (its objective's "
                             "data(): mmadapt.train.run.build_run gives it)")
        k = self.settings.num_iterations
        if run.step % k:
            log.warning("resumed at step %d, inside a rollout's %d steps (grpo.num_iterations): the loader's batch "
                        "%d is answered anew by the current policy", run.step, k, run.step // k)
        self.first_forward(run)

    def memory(self, model: Any, precision: Any) -> dict[str, int]:
        """The rollout: the micro-batch's B prompts answered G times up to `data.max_length` (`generation_bytes`)."""
        from mmadapt.generation import generation_bytes

        d = self.config.data
        return {"rollout": generation_bytes(model, d.batch_size, self.settings.num_generations, d.max_length,
                                            precision.hidden_bytes)}

    # ---- 1-2: rollouts and rewards -------------------------------------------------------------------------------
    def training_rows(self, run: Run, micro: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each micro-batch of prompts -> its B x G answers, their rewards and advantages, and the rows to score."""
        s, model = self.settings, run.model
        micro = [to_device(batch, run.device) for batch in micro]
        stand_ins = self.stand_ins(run, micro)  # {k: micro-batch k's own meta} where a stand-in answers for it
        micro = [self.stand_in(run) if k in stand_ins else batch for k, batch in enumerate(micro)]
        started = time.perf_counter()
        encoded = [self.encode(run, batch) for batch in micro]  # the step's one encoding of each picture
        was_training = model.training
        model.eval()
        try:
            with run.precision_context(), gathered(run.wrapped):
                done = [self.answer(run, batch, pictures, row_seeds(run.cfg.train.seed, run.step, [ids[0] for ids in
                                                                    batch["meta"]["sample_ids"]], s.num_generations))
                        if batch["input_ids"].shape[0] else None for batch, pictures in zip(micro, encoded,
                                                                                              strict=True)]
        finally:
            model.train(was_training)
        rollout_s = time.perf_counter() - started
        scores = [None if k in stand_ins else self.rewards(batch, r) for k, (batch, r) in enumerate(zip(micro, done,
                                                                                                        strict=True))]
        totals = [torch.tensor(sc.total, dtype=torch.float32) if sc is not None else torch.zeros(0) for sc in scores]
        std_over = None
        if s.scale_rewards == "batch":  # the std of every reward of the step, all ranks
            std_over = torch.cat([torch.cat(part) for part in dist_utils.gather_objects(totals)])
        rows = []
        for k, (batch, r, sc, total, pictures) in enumerate(zip(micro, done, scores, totals, encoded, strict=True)):
            if k in stand_ins:
                rows.append(self.masked_out(batch, r, pictures, stand_ins[k]))
                continue
            if r is None:  # every prompt of it was a problem (counted from its meta)
                rows.append({**batch, "logged": {}})
                continue
            advantages = self.advantages(total, std_over)
            scored, pictures, again, policy = self.layout(batch, r, pictures)
            mask = policy.mask & ~policy.truncated[:, None] if s.mask_truncated_completions else policy.mask
            if pictures is not None:  # the policy's forward takes the encoding, with its graph
                scored[ENCODED] = pictures
            rows.append({**scored, "meta": batch["meta"], ROLLOUT: {
                "rollouts": policy, "advantages": advantages.advantages.to(run.device), "mask": mask,
                "prompts": again},
                "logged": {**sc.logged(), "reward_std": float(advantages.std.nanmean()),
                           "zero_std_groups": float(advantages.zero_std.float().mean()),
                           **(agentic.logged(r) if isinstance(r, Trajectories) else {})}})
        if rows:
            rows[0]["logged"]["rollout_s"] = rollout_s
        return rows

    def answer(self, run: Run, batch: dict[str, Any], pictures: Encoded | None, seeds: torch.Tensor) -> Any:
        """A micro-batch's G answers per prompt (`rollout`), or with tools its trajectories (`agentic.answer`: the
        images tools return encoded once, as they arrive, with the vision side's graph when it trains)."""
        s, given = self.settings, None if pictures is None else pictures.detached()
        if self.agent is None:
            return rollout(run.model, self.scorer.processor, batch, s.num_generations, s.sampling, encoded=given,
                           seeds=seeds)
        return agentic.answer(run.model, self.scorer.processor, batch, s.num_generations, s.sampling, self.agent,
                              seeds=seeds, pictures=pictures, encode=lambda pixels: self.encode_pixels(run, pixels))

    def encode_pixels(self, run: Run, pixels: dict[str, Any]) -> Any:
        """Images tools returned, encoded once by the policy in training mode (with gradients when the vision side
        trains), inside the rollout (whose FSDP2 gather holds)."""
        model, was_training = run.model, run.model.training
        model.train()
        try:
            with torch.set_grad_enabled(vision_trains(model)):
                if pixels is None:  # under FSDP2, another rank's images: the vision side's run on no picture
                    return model.vision_placeholder(run.device)
                return model.encode_images(pixels["pixel_values"], pixels.get("image_grid_thw"))
        finally:
            model.train(was_training)

    def layout(self, batch: dict[str, Any], done: Any, pictures: Encoded | None) -> tuple[Any, ...]:
        """The rows the policy scores, the encoding they take, the pictures' inputs (to encode them again) and the
        policy's tokens (`Rollouts`), for answers or trajectories."""
        if isinstance(done, Trajectories):
            rows, pictures, again = agentic.trajectory_rows(batch, done, pictures, self.scorer.pad_token_id,
                                                           self.scorer.processor)
            return rows, pictures, again, done.policy
        scored = scored_rows(batch, done, self.scorer.pad_token_id)
        check_groups(scored, self.settings.num_generations, self.image_token_id)
        return scored, pictures, batch, done

    def masked_out(self, batch: dict[str, Any], done: Any, pictures: Encoded | None, meta: Any) -> dict[str, Any]:
        """A stand-in's rows (`stand_in`): scored like any rows, with no token counted (an all-False mask: zero loss,
        zero gradient), no advantage, nothing logged, and the meta of the micro-batch it stands in for (its
        problems)."""
        scored, pictures, again, policy = self.layout(batch, done, pictures)
        if pictures is not None:
            scored[ENCODED] = pictures
        return {**scored, "meta": meta, "logged": {}, ROLLOUT: {
            "rollouts": policy, "advantages": torch.zeros(policy.mask.shape[0], device=policy.mask.device),
            "mask": torch.zeros_like(policy.mask), "prompts": again, "stand_in": True}}

    def rewards(self, batch: dict[str, Any], done: Any) -> Any:
        if done is None:
            return None
        if isinstance(done, Trajectories):  # the last answer's text; its calls and problems as columns
            return self.scorer.score(done.texts, batch, self.settings.num_generations, done.columns())
        return self.scorer.score(self.scorer.texts(done), batch, self.settings.num_generations)

    def advantages(self, total: torch.Tensor, batch_rewards: torch.Tensor | None) -> Any:
        s = self.settings
        if batch_rewards is None:
            return group_advantages(total, s.num_generations, s.scale_rewards)
        local = group_advantages(total, s.num_generations, "none")  # r - the group's mean
        std = nanstd(batch_rewards).expand_as(total)
        scaled = torch.nan_to_num(local.advantages / (std + STD_EPSILON), nan=0.0)
        return local._replace(advantages=scaled, std=std, zero_std=torch.isclose(std, torch.zeros_like(std)))

    # ---- 3: the loss ---------------------------------------------------------------------------------------------
    def stat_names(self, run: Run) -> tuple[str, ...]:
        return PolicyStats.NAMES

    def micro_loss(self, run: Run, batch: dict[str, Any], totals: StepTotals) -> Terms:
        """The clipped loss of a micro-batch's answers: its share of the step's (M micro-batch losses; dapo: over the
        step's completion tokens, all ranks)."""
        iteration = run.step % self.settings.num_iterations  # 0: the rollout's first step
        terms = self.terms(run, batch, totals.micro_batches, totals.per_unit, iteration)
        return Terms(terms.loss, terms.stats.sums())

    def step_result(self, run: Run, micro: list[dict[str, Any]], loss: float, sums: dict[str, float],
                    totals: StepTotals) -> StepResult:
        """The clip fractions, entropy and KL of the step and, at a rollout's first step, its rewards and answers."""
        stats = PolicyStats.from_sums(sums, kl=self.settings.beta > 0, entropy=True)
        logged = self.logged(micro, run) if run.step % self.settings.num_iterations == 0 else {}
        return StepResult(loss, totals.per_unit, {**logged, **stats.means()})

    def terms(self, run: Run, batch: dict[str, Any], steps: int, total_tokens: int, iteration: int = 0) -> Any:
        """One micro-batch's loss. At a rollout's first step (`iteration` 0) the ratio is 1 (on policy: old =
        current, detached, as trl) and, with `num_iterations` > 1, the policy's log-probs (and the reference's) are
        kept: the later steps clip against them, with the pictures encoded again when the vision side trains (its
        weights moved), else the step's encoding reused."""
        s, rolled = self.settings, batch[ROLLOUT]
        rows, done = inputs_of(batch), rolled["rollouts"]
        pictures: Encoded | None = rows.pop(ENCODED, None)
        if iteration and pictures is not None and vision_trains(run.model):
            pictures = self.encode(run, rolled["prompts"])
        given = {} if pictures is None else pictures.for_rows(rows)
        scored = run.wrapped(**rows, **given, head=TokenLogps(s.temperature, entropy=True))
        per_token, entropy = completion_logps(scored.logps, rows["labels"], done), scored.entropy
        reference = rolled.get("reference")
        if s.beta > 0 and reference is None:
            model = run.model  # the reference's vision side is the policy's unless LoRA trains it (then: encoded again)
            shared = pictures is not None and not (lora_layers(model.encoder) or lora_layers(model.projector))
            ref_given = pictures.detached().for_rows(rows) if shared else {}
            with torch.no_grad(), adapters_disabled(model):
                reference = completion_logps(run.wrapped(**rows, **ref_given, head=TokenLogps(s.temperature)).logps,
                                             rows["labels"], done)
        old = rolled.get("old") if iteration else None
        if not iteration and not rolled.get("stand_in"):
            self.log_sampling_gap(batch, per_token.detach(), done)
        if s.num_iterations > 1 and not iteration:
            rolled["old"], rolled["reference"] = per_token.detach(), reference
        terms = policy_loss(per_token, old, reference, rolled["advantages"], rolled["mask"], self.loss,
                            accumulation_steps=steps, num_items=total_tokens)
        entropies = completion_logps(entropy, rows["labels"], done)  # aligned as the log-probs
        return dataclasses.replace(terms, stats=dataclasses.replace(
            terms.stats, entropy=(entropies * rolled["mask"]).sum()))

    @staticmethod
    def log_sampling_gap(batch: dict[str, Any], per_token: torch.Tensor, done: Rollouts) -> None:
        """How far the rollout's own log-probs of its tokens are from the policy's forward over the scored rows, at
        the same weights (trl's `sampling/sampling_logp_difference`, mean and max over the completion tokens): 0 up to
        float rounding when the rollout and the forward saw the same ids, positions and visual tokens - the
        contract between them - and the same precision."""
        if done.logps is None or not bool(done.mask.any()):
            return
        gap = (per_token - done.logps.to(per_token.device)).abs()[done.mask.to(per_token.device)]
        batch.setdefault("logged", {}).update({"sampling/sampling_logp_difference/mean": float(gap.mean()),
                                               "sampling/sampling_logp_difference/max": float(gap.max())})

    def logged(self, micro: list[dict[str, Any]], run: Run) -> dict[str, Any]:
        """The step's rewards and answers, every rank's (means over the micro-batches that had prompts)."""
        parts = [b["logged"] for b in micro if b.get("logged")]
        answered = [b[ROLLOUT]["rollouts"] for b in micro if ROLLOUT in b and not b[ROLLOUT].get("stand_in")]
        lengths = [r.lengths.float() for r in answered]
        truncated = [r.truncated.float() for r in answered]
        local = {"parts": parts, "lengths": torch.cat(lengths).tolist() if lengths else [],
                 "truncated": torch.cat(truncated).tolist() if truncated else []}
        everyone = dist_utils.gather_objects(local)
        merged: dict[str, list[float]] = {}
        for rank in everyone:
            for part in rank["parts"]:
                for key, value in part.items():
                    if not (isinstance(value, float) and math.isnan(value)):
                        merged.setdefault(key, []).append(value)
        out = {key: max(values) if key.endswith("/max") else sum(values) / len(values)
               for key, values in merged.items() if key != "rollout_s"}
        out["rollout_s"] = max(merged.get("rollout_s", [0.0]))
        all_lengths = [x for rank in everyone for x in rank["lengths"]]
        all_truncated = [x for rank in everyone for x in rank["truncated"]]
        if all_lengths:
            out.update({"completion_length/mean": sum(all_lengths) / len(all_lengths),
                        "completion_length/max": max(all_lengths),
                        "completion_length/truncated": sum(all_truncated) / len(all_truncated)})
        return out

    # ---- evaluation ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def evaluating(self, run: Run) -> Iterator[None]:
        """The eval answers with the model's own `generate`: in eval mode, the root's parameters gathered."""
        run.model.eval()
        with gathered(run.wrapped):
            yield

    def eval_stat_names(self, run: Run) -> tuple[str, ...]:
        from mmadapt.controls import IMAGE_CONTROLS

        names = (*agentic.TOOL_CONTROLS, "tool_calls") if self.agent is not None else [c.name for c in IMAGE_CONTROLS]
        return tuple(f"{kind}/{name}" for name in names for kind in ("reward", "answers"))

    def eval_batch(self, run: Run, items: list[Any], batch: dict[str, Any]) -> dict[str, float]:
        """Does the reward rest on the image? The rewards of one greedy answer per eval prompt with its real images,
        blanked (the processor's mean colour) and shuffled among the batch's prompts (another prompt's image of the
        same size): `reward_view.control_rewards`, what `mmadapt sees` prints for a file of prompts."""
        out = {}
        if self.agent is not None:  # with tools: real, blanked, the tools' images blanked (`agentic.tool_controls`)
            from mmadapt.train.batches import to_device

            shown = to_device(batch, run.device)
            results = agentic.tool_controls(run.model, self.scorer, self.agent, shown, self.recorder(run, shown)) \
                if shown["input_ids"].shape[0] else {name: [] for name in (*agentic.TOOL_CONTROLS, "tool_calls")}
        else:
            results = control_rewards(run.model, self.scorer, items, run.collate_fn, device=run.device)
        for name, values in results.items():
            out[f"reward/{name}"], out[f"answers/{name}"] = sum(values), len(values)
        return out

    def recorder(self, run: Run, batch: dict[str, Any]) -> Any:
        """What records the first eval batch's trajectories of each eval, on the first rank (`agentic.record`, to
        `OUT/trajectories/step-N`; `grpo.record_trajectories` of them), or None."""
        from mmadapt.run_directory import RunDirectory

        limit = self.settings.record_trajectories
        if not limit or not run.is_main or getattr(self, "_recorded", None) == run.step or not batch.get("turns"):
            return None
        self._recorded = run.step

        def keep(done: Any, totals: list[float]) -> None:
            target = RunDirectory(run.out).trajectories(run.step)
            try:
                count = agentic.record(target, batch, done, totals, limit)
                log.info("recorded %d eval trajectories: mmadapt data show %s --image-root %s", count,
                         target / "trajectories.jsonl", target)
            except OSError as e:  # a record is a report: it never stops a run
                log.warning("the eval trajectories could not be recorded in %s (%s); training goes on", target, e)

        return keep

    def eval_metrics(self, run: Run, sums: dict[str, float]) -> dict[str, float]:
        """`eval_reward`, `eval_reward_blanked`, `eval_reward_shuffled`: the mean rewards (a reward that rests on the
        image falls without it)."""
        from mmadapt.controls import IMAGE_CONTROLS

        names = (*agentic.TOOL_CONTROLS, "tool_calls") if self.agent is not None else [c.name for c in IMAGE_CONTROLS]
        return {"eval_reward" if name == "real" else "eval_tool_calls" if name == "tool_calls" else
                f"eval_reward_{name}": sums[f"reward/{name}"] / sums[f"answers/{name}"] if sums[f"answers/{name}"]
                else math.nan for name in names}
