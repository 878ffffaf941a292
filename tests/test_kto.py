"""`train.objective: kto` (`mmadapt.train.objectives.kto.objective`): our head and objective on a tiny model equal
trl 1.16's `KTOTrainer._compute_loss` fed with the same rows' log-probs computed from full logits (the loss, its
gradient w.r.t. the model's parameters, the logged metrics; fp32, 1e-5); accumulation equals one big batch (1e-6
relative); the step's KL comes from one gather; `mmadapt train` runs, checkpoints and resumes; bad settings are
named.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image

from mmadapt.train import RunConfig, Trainer, latest_checkpoint
from mmadapt.train import distributed as dist_utils
from mmadapt.train.objectives import objective_for
from mmadapt.train.objectives.base import StepTotals
from mmadapt.train.objectives.kto.objective import part
from mmadapt.train.objectives.reference import adapters_disabled
from mmadapt.train.run import build_run

NAMES = ("red", "green", "blue", "yellow")
LORA = ["stages.backbone=lora", "stages.projector=frozen"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    for k, name in enumerate(NAMES):
        Image.new("RGB", (32 + 32 * (k % 2), 32), (60 * k, 200 - 40 * k, 90)).save(root / f"{name}.png")
    records = [{"id": f"k{i}", "images": [f"{NAMES[i % 4]}.png"], "prompt": "<image>\nWhat colour?" + " now" * (i % 3),
                "completion": NAMES[i % 4] if i % 3 else NAMES[(i + 1) % 4], "label": bool(i % 3)}
               for i in range(12)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def config(root, *overrides):
    return RunConfig.load(None, [f"train.out={root / 'out'}", "train.progress=false", "train.objective=kto",
                                 f"data.train={root / 'train.jsonl'}", f"data.image_root={root}", "data.max_length=256",
                                 "kto.beta=0.5", *overrides])


def trainer_for(root, *overrides, seed=1):
    """A trainer (the objective's `Run`) on a LoRA model, its adapters moved off the start (policy != reference)."""
    cfg = config(root, *LORA, *overrides)
    parts = build_run(cfg)
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in parts.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return trainer, parts


def full_logps(model, batch):
    """Per row, the summed log-probs of its labelled tokens from the full (B, L, V) logits."""
    inputs = {k: v for k, v in batch.items() if k not in ("meta", "rows", "desirable", "labels")}
    logits = model(**inputs).logits.float()
    labels = batch["labels"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return (logps * (labels != -100)).sum(1)


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora" in n and p.grad is not None}


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_the_loss_gradients_and_metrics_equal_trls_on_the_same_logits(root, loss_type):
    from test_kto_loss import B, trl_loss

    trainer, parts = trainer_for(root, f"kto.loss_type={loss_type}", "kto.beta=0.1", "kto.desirable_weight=1.3",
                                 "kto.undesirable_weight=0.8")
    objective, model = trainer.objective, parts.model
    batch = parts.collate([parts.train_data[i] for i in range(B)])
    labelled = part(batch, labelled=True) if loss_type == "kto" else batch
    with torch.no_grad(), adapters_disabled(model):
        reference = full_logps(model.eval(), batch)
        kl_batch = part(batch, labelled=False) if loss_type == "kto" else None
    model.train()
    with torch.no_grad():
        policy_kl = full_logps(model, kl_batch) if kl_batch is not None else torch.zeros(B)
    reference_kl = reference[B:] if loss_type == "kto" else torch.zeros(B)
    policy = full_logps(model, labelled)
    loss, policy_grad, metrics = trl_loss(policy.detach(), policy_kl, reference[:B], reference_kl,
                                          batch["desirable"], loss_type=loss_type, weights=(1.3, 0.8))
    model.zero_grad()
    policy.backward(policy_grad)
    theirs = lora_grads(model)
    model.zero_grad()

    (micro,) = objective.training_rows(trainer, [batch])
    totals = StepTotals(B, objective.tokens(micro), 1)
    terms = objective.micro_loss(trainer, micro, totals)
    terms.loss.backward()
    ours = lora_grads(model)
    assert abs(float(terms.loss.detach()) - float(loss)) <= 1e-5
    assert ours.keys() == theirs.keys() and len(ours) >= 4
    for name, grad in ours.items():
        assert torch.allclose(grad, theirs[name], atol=1e-5), name
    sums = {k: float(v) for k, v in terms.sums.items()}
    logged = objective.step_result(trainer, [micro], float(terms.loss.detach()), sums, totals).logged
    for key, values in metrics.items():
        if key in logged:
            assert abs(logged[key] - values[-1]) <= 1e-5, key
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= set(logged)
    assert ("kl" in logged) == (loss_type == "kto")
    if loss_type == "kto":  # the KL term is in play: its estimate is positive here (not clamped away)
        assert float(micro["meta"]["kto"].kl) > 1e-3 and abs(logged["kl"] - metrics["kl"][-1]) <= 1e-5


def step(trainer, micro, objective):
    """One step's loss (summed micro-batch losses) and LoRA gradients, as the trainer's accumulation adds them."""
    trainer.model.zero_grad()
    micro = objective.training_rows(trainer, micro)
    units = sum(objective.units(b) for b in micro)
    totals = StepTotals(units, sum(objective.tokens(b) for b in micro), len(micro))
    total = 0.0
    for batch in micro:
        terms = objective.micro_loss(trainer, batch, totals)
        terms.loss.backward()
        total += float(terms.loss.detach())
    return total, lora_grads(trainer.model), micro


def test_two_micro_batches_of_two_equal_one_of_four(root):
    """apo_zero_unpaired (no KL term): loss and gradients within 1e-6 relative."""
    trainer, parts = trainer_for(root, "kto.loss_type=apo_zero_unpaired")
    items = [parts.train_data[i] for i in range(4)]
    one, one_grads, _ = step(trainer, [parts.collate(items)], trainer.objective)
    two, two_grads, _ = step(trainer, [parts.collate(items[:2]), parts.collate(items[2:])], trainer.objective)
    assert abs(one - two) <= 1e-6 * abs(one)
    for name, grad in one_grads.items():
        assert torch.allclose(two_grads[name], grad, rtol=1e-6, atol=1e-9), name


def test_the_steps_kl_is_the_mean_of_every_micro_batch_and_rank_estimate(root, monkeypatch):
    """kto: each micro-batch's z0 is the mean of the step's estimates (this rank's micro-batches and, through one
    gather, the other ranks'; a micro-batch without rows counts for nothing), clamped at 0 in the loss."""
    trainer, parts = trainer_for(root)
    objective = trainer.objective
    batches = [parts.collate([parts.train_data[i] for i in range(k, k + 2)]) for k in (0, 2)]
    estimates = []
    with torch.no_grad():
        for batch in batches:
            _, kl = objective.row_scores(trainer, batch)
            estimates.append(float(kl))
    gathered = []

    def gather(value):
        gathered.append(value)
        return [value, [3.0, None]]  # another rank: one micro-batch with rows, one without

    monkeypatch.setattr(dist_utils, "gather_objects", gather)
    micro = objective.training_rows(trainer, batches)
    assert len(gathered) == 1 and gathered[0] == pytest.approx(estimates, abs=1e-6)
    expected = (sum(estimates) + 3.0) / 3
    for batch in micro:
        assert float(batch["meta"]["kto"].kl) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("case", ["lora-kto", "precomputed-apo"])
def test_mmadapt_train_runs_kto_checkpoints_and_resumes(root, tmp_path, case):
    overrides = [f"train.out={tmp_path / 'out'}", "data.batch_size=2", "train.grad_accum=2", "checkpoint.every=2",
                 f"data.eval={root / 'train.jsonl'}", "train.eval_every=3",
                 *(LORA if case == "lora-kto" else ["stages.encoder=full", "kto.loss_type=apo_zero_unpaired"])]
    whole = run_steps(root, overrides, 3)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in whole) and whole[-1]["rows"] == 4
    assert any("rewards/margins" in r for r in whole) and "eval_rewards/margins" in whole[-1]
    assert ("kl" in whole[-1]) == (case == "lora-kto")
    shutil.rmtree(latest_checkpoint(tmp_path / "out"))  # back to step 2: step 3 is redone by a resumed run
    resumed = run_steps(root, [*overrides, "checkpoint.resume=true"], 3)
    assert resumed[-1]["step"] == 3 and abs(resumed[-1]["loss"] - whole[-1]["loss"]) <= 1e-6


def run_steps(root, overrides, steps):
    cfg = config(root, *overrides, f"train.steps={steps}")
    parts = build_run(cfg)
    return Trainer(parts.model, cfg, parts.train_data, parts.collate, eval_data=parts.eval_data).fit()["history"]


def test_bad_settings_are_named(root):
    with pytest.raises(ValueError, match=r"unknown config key 'kto.betta'. Did you mean 'kto.beta'\?"):
        objective_for(RunConfig.load(None, ["train.objective=kto", "kto.betta=0.5"]))
    with pytest.raises(ValueError, match=r"kto\.beta\ must\ be\ >\ 0"):
        objective_for(RunConfig.load(None, ["train.objective=kto", "kto.beta=0"]))
    with pytest.raises(ValueError, match=r"kto\.undesirable_weight\ must\ be\ >\ 0"):
        objective_for(RunConfig.load(None, ["train.objective=kto", "kto.undesirable_weight=-1"]))
    with pytest.raises(ValueError, match=r"data\.batch_size\ >=\ 2"):
        build_run(config(root, "data.batch_size=1"))
    with pytest.raises(ValueError, match="packing"):
        build_run(config(root, "data.packing=true"))


def test_kto_refuses_a_precomputed_reference_naming_lora(root):
    """`kto`'s KL rows pair each prompt with another row of its batch: no table made before the first step holds
    them; a fully trained part is refused, naming LoRA and apo_zero_unpaired (which precomputes)."""
    parts = build_run(config(root, "stages.encoder=full"))
    with pytest.raises(ValueError, match=r"'encoder'.* train fully.*stages: lora.*apo_zero_unpaired"):
        Trainer(parts.model, config(root, "stages.encoder=full"), parts.train_data, parts.collate)
    with pytest.raises(ValueError, match=r"kto\.reference:\ adapters\ needs\ every\ trained\ part\ to\ be\ LoRA"):
        cfg = config(root, "stages.encoder=full", "kto.reference=adapters")
        Trainer(parts.model, cfg, parts.train_data, parts.collate)


def test_unpaired_records_trained_with_dpo_stop_the_run_naming_the_missing_field(root):
    """DPO reads pairs: each unpaired record is a counted bad_format problem naming the missing 'rejected' field, and
    the bad-sample budget stops the run at its first step."""
    cfg = RunConfig.load(None, [f"train.out={root / 'dpo'}", "train.progress=false", "train.objective=dpo",
                                f"data.train={root / 'train.jsonl'}", f"data.image_root={root}", "train.steps=1",
                                "data.batch_size=2", *LORA])
    parts = build_run(cfg)
    assert "not a preference pair: no 'rejected'" in parts.train_data[0].to_dict()["detail"]
    with pytest.raises(Exception, match="bad_format: not a preference pair"):
        Trainer(parts.model, cfg, parts.train_data, parts.collate).fit()


def test_the_labelled_rows_and_the_kl_rows_of_a_batch_score_as_in_one_forward(root):
    """`part`: the B labelled rows and the B KL rows, each with the images and videos they read, give the log-probs
    the whole 2B-row batch gives (1e-5), a video prompt and image prompts mixed."""
    from helpers import grey_clip

    from mmadapt.heads import SequenceLogps
    from mmadapt.train.objectives.kto import KtoEncoder
    from mmadapt.train.objectives.kto.objective import model_inputs

    grey_clip(root / "clip.mp4")
    parts = build_run(config(root))
    records = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()[:3]]
    records.insert(1, {"id": "v", "videos": ["clip.mp4"], "prompt": "<video>\nWhat happens?", "completion": "grey",
                       "label": False})
    rows = [KtoEncoder(parts.encoder).encode(r, i) for i, r in enumerate(records)]
    batch = parts.collate(rows)
    assert batch["videos_per_sample"].tolist() == [0, 1, 0, 0] * 2
    device = torch.device("cpu")
    with torch.no_grad():
        whole = parts.model.eval()(**model_inputs(batch, device), head=SequenceLogps()).logps
        halves = [parts.model(**model_inputs(part(batch, labelled), device), head=SequenceLogps()).logps
                  for labelled in (True, False)]
    assert torch.allclose(torch.cat(halves), whole, atol=1e-5)
