"""Does the reward rest on the image? Greedy answers to RL prompts scored with their real images, blanked and shuffled
(`mmadapt.controls`), the view a GRPO run logs at each eval (`eval_reward`, `eval_reward_blanked`,
`eval_reward_shuffled`) and `mmadapt sees` prints for a file of prompts. The answers are `answer_prompts`' (the one
way a model answers: its end ids, its `Sampling`, its decoding), and a rollout's texts are decoded as it decodes
(`AnswerScorer.texts`), so a reward scores what a person asking the model would read.

    scorer = AnswerScorer.for_encoder(encoder, reward_specs(["accuracy"]), max_new_tokens=64)
    view = reward_view(model, scorer, prompts, collate)      # prompts: EncodedPrompt items (mmadapt.data.prompts)
    print(view); assert view.ok                               # the real images' reward beats blanked and shuffled

A model can learn the format reward and guess the answer from text priors; then its reward holds as well with the
images blanked (the processor's mean colour) or swapped for another prompt's (of the same size), and `ok` is False.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.controls import BLANKED, IMAGE_CONTROLS, REAL, SHUFFLED
from mmadapt.sampling import Sampling
from mmadapt.train.objectives.rollout import INPUTS, Rollouts, answer_texts
from mmadapt.train.rewards import RewardSpec, Scores, score


@dataclass
class AnswerScorer:
    """What answering and scoring answers needs: the `processor` (its tokenizer, its end ids
    `Processor.eos_token_ids` and its pad id: answering's, `mmadapt.answering.generate_settings`), the rewards, and
    the evals' `sampling` (greedy by default, `max_new_tokens` as long as a rollout's answers)."""

    processor: Any
    specs: Sequence[RewardSpec]
    sampling: Sampling

    @classmethod
    def for_encoder(cls, encoder: Any, specs: Sequence[RewardSpec], max_new_tokens: int | Sampling, *,
                    collator: Any = None) -> AnswerScorer:
        """From a `SampleEncoder` (its tokenizer, template and pad id) and its batches' `Collator` (else one for the
        encoder's tokens); `max_new_tokens`: the evals' greedy answers' length, or their whole `Sampling`."""
        from mmadapt.data import Collator
        from mmadapt.processor import Processor

        collator = collator or Collator(pad_token_id=encoder.pad_token_id, image_token_id=encoder.image_token_id,
                                        video_token_id=encoder.video_token_id)
        sampling = max_new_tokens if isinstance(max_new_tokens, Sampling) else Sampling(max_new_tokens=max_new_tokens)
        return cls(Processor(encoder, collator), tuple(specs), sampling)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end an answer: answering's (`Processor.eos_token_ids`)."""
        return self.processor.eos_token_ids

    @property
    def pad_token_id(self) -> int:
        return self.processor.encoder.pad_token_id

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    def texts(self, rollouts: Rollouts) -> list[str]:
        """Each answer's text: what answering returns for its ids (`rollout.answer_texts`)."""
        return answer_texts(self.processor, rollouts)

    def score(self, texts: list[str], batch: dict[str, Any], repeats: int = 1,
              rows: dict[str, list[Any]] | None = None) -> Scores:
        """The rewards of `texts`: `repeats` answers per prompt of `batch`, its `columns` repeated to match, and
        `rows`' columns, one value per answer (a trajectory's `tool_calls` and `tool_problems`)."""
        names = sorted({k for row in batch["columns"] for k in row})
        columns = {k: [row.get(k) for row in batch["columns"] for _ in range(repeats)] for k in names}
        return score(texts, {**columns, **(rows or {})}, self.specs)

    def greedy(self, model: Any, batch: dict[str, Any]) -> list[float]:
        """The total reward of one answer (`sampling`: greedy) to each prompt of a `PromptCollator` batch (NaN: no
        reward scored it), answered by `answer_prompts`, the one way a model answers. Its batch stays one `generate`
        call, and under FSDP2 that call steps with the other ranks' (`generate`'s `any_rank_decoding`): a rank
        without prompts answers a stand-in (`mmadapt.train.steps.evaluate`), never nothing."""
        from mmadapt.answering import PromptInputs, answer_prompts

        if not batch["input_ids"].shape[0]:
            return []
        prompt = PromptInputs.of(model, self.processor, {k: v for k, v in batch.items()
                                                         if k in INPUTS and v is not None})
        answers = answer_prompts(model, self.processor, prompt, sampling=self.sampling)
        return self.score([answer.text for answer in answers], batch).total


@torch.no_grad()
def control_rewards(model: Any, scorer: AnswerScorer, prompts: Sequence[Any], collate: Any, *,
                    device: Any = None) -> dict[str, list[float]]:
    """The total rewards of greedy answers to `prompts` (one batch of `EncodedPrompt`s) under each image control:
    {control name: per prompt, NaN-free}. The model is put in eval mode by the caller."""
    from mmadapt.data.prompts import EncodedPrompt
    from mmadapt.train.batches import to_device

    kept = [p for p in prompts if isinstance(p, EncodedPrompt)]
    out: dict[str, list[float]] = {}
    for control in IMAGE_CONTROLS:
        shown = [EncodedPrompt(sample, p.columns) for sample, p in zip(
            control.samples([p.sample for p in kept]), kept, strict=True)]
        batch = collate(shown) if shown else None
        if batch is not None and device is not None:
            batch = to_device(batch, device)
        totals = scorer.greedy(model, batch) if batch is not None else []
        out[control.name] = [t for t in totals if not math.isnan(t)]
    return out


def shuffles(prompts: Sequence[Any]) -> int:
    """How many of `prompts` the shuffled control gives another prompt's pictures."""
    from mmadapt.data.prompts import EncodedPrompt

    kept = [p.sample for p in prompts if isinstance(p, EncodedPrompt)]
    return sum(a is not b and (getattr(a, "pixel_values", None) is not getattr(b, "pixel_values", None)
                               or getattr(a, "pixel_values_videos", None) is not getattr(b, "pixel_values_videos",
                                                                                         None))
               for a, b in zip(kept, SHUFFLED.samples(kept), strict=True))


@dataclass
class RewardView:
    """Per image control, the mean total reward of greedy answers (`reward["real"]`, `["blanked"]`,
    `["shuffled"]`, the last absent when no prompt's pictures could move); `prompts` scored, `moved` the prompts
    the shuffle changed, `problems` the records that could not be used (counted, skipped)."""

    prompts: int
    reward: dict[str, float]
    moved: int
    problems: int = 0

    @property
    def ok(self) -> bool:
        """The reward rests on the images: the real images' reward is above the blanked one's (and the shuffled
        one's, when pictures could move)."""
        real = self.reward[REAL.name]
        return real > self.reward[BLANKED.name] and (SHUFFLED.name not in self.reward
                                                      or real > self.reward[SHUFFLED.name])

    def to_dict(self) -> dict[str, Any]:
        """What `mmadapt eval --json` writes of it."""
        return {"rewards": {"prompts": self.prompts, "reward": self.reward, "moved": self.moved,
                            "problems": self.problems, "rests_on_images": self.ok}}

    def __str__(self) -> str:
        lines = [f"reward view: {self.prompts} prompts, the mean reward of one greedy answer each"
                 + (f" ({self.problems} bad prompts skipped)" if self.problems else ""),
                 f"{'images':<10}{'reward':>10}"]
        for control in IMAGE_CONTROLS:
            if control.name in self.reward:
                lines.append(f"{control.name:<10}{self.reward[control.name]:>10.3f}")
            else:
                lines.append(f"{control.name:<10}{'n/a':>10}   not applicable: no two prompts' pictures share a size")
        lines.append("the reward rests on the images" if self.ok else
                     "the reward does NOT rest on the images: it holds as well without them (text alone)")
        return "\n".join(lines)


def reward_view(model: Any, scorer: AnswerScorer, prompts: Sequence[Any], collate: Any, *,
                batch_size: int = 8, device: Any = None) -> RewardView:
    """The reward view of `prompts` (`EncodedPrompt`s, or the `DataProblem`s a `PromptDataset` gives for bad
    records: counted) in batches of `batch_size`; `ValueError` when no prompt could be answered."""
    from mmadapt.data.prompts import EncodedPrompt
    from mmadapt.modes import eval_mode

    totals: dict[str, list[float]] = {c.name: [] for c in IMAGE_CONTROLS}
    moved = 0
    with eval_mode(model):
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            for name, values in control_rewards(model, scorer, chunk, collate, device=device).items():
                totals[name] += values
            moved += shuffles(chunk)
    good = sum(isinstance(p, EncodedPrompt) for p in prompts)
    if not totals[REAL.name]:
        raise ValueError(f"no prompt could be answered and scored ({len(prompts) - good} bad prompts): check the file "
                         "with `mmadapt data check`")
    reward = {name: sum(v) / len(v) for name, v in totals.items() if v and (name != SHUFFLED.name or moved)}
    return RewardView(good, reward, moved, len(prompts) - good)


# ---- `mmadapt eval` / `mmadapt sees` on a file of prompts ------------------------------------------------------------
def view_rewards(model_path: str, rewards: list[str] | None, max_new_tokens: int | None) -> tuple[list, int]:
    """The rewards and answer length of the reward view: the command line's (`--rewards`, `--max-new-tokens`), else
    the GRPO run's (`grpo.rewards`, `grpo.max_completion_length` of the config.yaml of the run `model_path` belongs
    to), else accuracy and 64 tokens. A reward the run's config names as code (`package.module:function`) is never
    imported from the directory's say-so: only when the command line names it."""
    from mmadapt.run_directory import RunDirectory
    from mmadapt.train.config import RunConfig, parse_section
    from mmadapt.train.objectives.grpo.settings import GrpoSettings
    from mmadapt.train.rewards import REWARDS

    saved, length = None, None
    run = RunDirectory.of(model_path)
    if run is not None and run.config_file.is_file():
        config = RunConfig.load(run.config_file, [])
        settings = parse_section(GrpoSettings, config.sections.get("grpo"), "grpo.")
        saved, length = settings.rewards or None, settings.max_completion_length
    if not rewards and saved:
        code = [n for n in (r.get("name") if isinstance(r, dict) else r for r in saved) if n not in REWARDS.names()]
        if code:
            raise ValueError(f"the run's grpo.rewards ({run.config_file}) name code: {code}. mmadapt does not import "
                             "code a directory names; if you trust it, pass it yourself: --rewards "
                             f"{','.join(str(n) for n in code)} (or only built-ins: --rewards accuracy,format)")
    return rewards or saved or ["accuracy"], max_new_tokens or length or 64


def records_view(model: Any, encoder: Any, records: list[Any], options: Any) -> RewardView:
    """The reward view of a file of RL prompts (`GrpoObjective.view`): the mean reward of greedy answers with real,
    blanked and shuffled images."""
    from mmadapt.data import Collator
    from mmadapt.data.prompts import PromptCollator, PromptDataset, PromptEncoder
    from mmadapt.train.rewards import reward_specs

    names, length = view_rewards(options.model, options.rewards, options.max_new_tokens)
    dataset = PromptDataset(records, PromptEncoder(encoder, length))
    size = options.batch_size
    count = len(dataset) if options.batches is None else min(len(dataset), options.batches * size)
    collate = PromptCollator(Collator.for_model(model, encoder.pad_token_id))
    return reward_view(model, AnswerScorer.for_encoder(encoder, reward_specs(names), length),
                       [dataset[i] for i in range(count)], collate, batch_size=size)
