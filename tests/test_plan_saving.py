"""`mmadapt plan`'s host memory of a checkpoint save, per rank (mmadapt.train.plan.saving).

The counts equal a hand count of the planned model's tensors (FSDP2's shards cut with `torch.chunk`, as FSDP2 cuts
them) for every format / async / strategy / world size, and the state dicts torch itself stages and gathers: in one
process here, under torchrun with 2 processes (FSDP2 and DDP, gloo) in the slow test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import write_run

from mmadapt.cli import main
from mmadapt.train.config import RunConfig
from mmadapt.train.plan import GIB, planning_model, predict
from mmadapt.train.plan.saving import HOST_SHARE, SavingMemory, Way, saving_memory, ways

# LLaVA with a tied head (one tensor under two names) and 17 image positions (a row count no world size divides);
# LoRA on the backbone: frozen bf16 weights saved, fp32 adapters trained
TIED = {"encoder": "clip", "projector": "mlp2x_gelu",
        "backbone": {"name": "llama", "preset": "tiny", "dtype": "bfloat16", "options": {"tie_word_embeddings": True}}}


@pytest.fixture(autouse=True)
def probe_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path_factory.getbasetemp() / "mmadapt-cache"))


def config(**sections) -> RunConfig:
    return RunConfig.from_dict({"model": TIED, "stages": {"encoder": "frozen", "projector": "full",
                                                          "backbone": "lora"},
                                "data": {"max_length": 128, "batch_size": 2}, **sections})


def hand_count(model, strategy: str, ranks: int, device: str) -> dict[str, tuple[int, int]]:
    """{way: (rank 0, the most on another rank)}, counted from the model's own tensors."""
    named = model.state_dict(keep_vars=True)
    unique = {id(t): t for t in named.values()}.values()  # the tied head once
    trained = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    fsdp = strategy == "fsdp2" and ranks > 1

    def size(t):
        return t.numel() * t.element_size()

    def local(t, rank, padded=False):  # FSDP2 cuts a parameter (and its moments) with torch.chunk on dim 0 and keeps
        if not (fsdp and isinstance(t, torch.nn.Parameter)):  # the parameter in the first (largest) chunk's storage
            return size(t)
        pieces = torch.chunk(torch.empty(t.shape, device="meta"), ranks)
        piece = pieces[0] if padded else pieces[rank] if rank < len(pieces) else pieces[0][:0]
        return piece.numel() * t.element_size()

    def by_name(rank):  # the rank's state dict by name: the model's, then AdamW's two moments and a step each
        return [local(t, rank) for t in named.values()] + [local(p, rank) for p in trained for _ in range(2)] + [
            4] * len(trained)

    def storages(rank):  # what the stager copies: each storage once
        return sum(local(t, rank, padded=True) for t in unique) + sum(2 * local(p, rank) + 4 for p in trained)

    other = 1 if ranks > 1 else None
    counts = {"sharded sync": (max(by_name(0)), max(by_name(other)) if other else 0),
              "sharded async": (storages(0), storages(other) if other else 0)}
    optimizer = sum(2 * size(p) + 4 for p in trained)
    if fsdp:  # every name gathered on its own: the tied head twice
        biggest = max(max(size(t) for t in named.values()), max(size(p) for p in trained))
        counts["gathered"] = (sum(size(t) for t in named.values()) + optimizer, biggest if device == "cpu" else 0)
    else:
        counts["gathered"] = (sum(size(t) for t in unique) + optimizer if device == "cuda" else 0, 0)
    return counts


COMBINATIONS = [("single", 1), ("ddp", 2), ("ddp", 4), ("fsdp2", 2), ("fsdp2", 3), ("fsdp2", 4)]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("strategy,ranks", COMBINATIONS)
@pytest.mark.parametrize("checkpoint", [{"format": "sharded"}, {"format": "sharded", "async": True},
                                        {"format": "gathered"}], ids=["sync", "async", "gathered"])
def test_each_way_of_saving_counts_the_models_own_tensors(strategy, ranks, device, checkpoint):
    run = config(checkpoint=checkpoint, distributed={"strategy": "ddp" if strategy == "ddp" else "auto"})
    plan = predict(run, gpus=ranks, device=device)
    model, _ = planning_model(run)
    expected = hand_count(model, strategy, ranks, device)
    assert plan.strategy == strategy
    assert {name: (w.rank0, w.others) for name, w in plan.saving.ways.items()} == expected
    way = "gathered" if checkpoint["format"] == "gathered" else "sharded async" if checkpoint.get("async") else (
        "sharded sync")
    assert (plan.saving.way, plan.saving.this.rank0) == (way, expected[way][0])
    assert plan.to_json()["saving"]["rank0"] == expected[way][0]


def test_the_tied_head_counts_once_but_twice_in_fsdp2s_gathered_state():
    model, _ = planning_model(config())
    head = model.backbone.get_output_embeddings().weight
    assert head is model.backbone.get_input_embeddings().weight
    single = ways(model, strategy="single", ranks=1, device="cuda")
    assert single["sharded async"].rank0 == single["gathered"].rank0  # one storage, staged and copied once
    fsdp = ways(model, strategy="fsdp2", ranks=2, device="cuda")
    assert fsdp["gathered"].rank0 - single["gathered"].rank0 == head.numel() * head.element_size()


def test_sharded_async_per_rank_falls_as_one_over_n_under_fsdp2_and_gathered_rank_0_does_not():
    model, _ = planning_model(config())
    trained = [p for p in model.parameters() if p.requires_grad]
    replicated = 4 * len(trained)  # AdamW's steps (the model has no buffers)
    # FSDP2 rounds each tensor's rows up (17 rows divide by no n): at most one row of each tensor's storage more
    row = sum(t.numel() // t.shape[0] * t.element_size() for t in {id(t): t for t in model.parameters()}.values()) \
        + sum(2 * p.numel() // p.shape[0] * 4 for p in trained)
    one = ways(model, strategy="single", ranks=1, device="cuda")
    gathered = ways(model, strategy="fsdp2", ranks=2, device="cuda")["gathered"].rank0
    assert gathered > one["gathered"].rank0  # (the tied head gathered under each name)
    for n in (2, 4, 8):
        fsdp = ways(model, strategy="fsdp2", ranks=n, device="cuda")
        staged = fsdp["sharded async"].rank0 - replicated
        share = (one["sharded async"].rank0 - replicated) / n
        assert share <= staged < share + row, (n, staged, share)
        assert fsdp["sharded async"].others == fsdp["sharded async"].rank0  # every rank holds its padded chunks
        assert fsdp["gathered"].rank0 == gathered
        assert fsdp["sharded sync"].rank0 <= one["sharded sync"].rank0
        ddp = ways(model, strategy="ddp", ranks=n, device="cuda")
        assert ddp["sharded async"].rank0 == ddp["sharded async"].others == one["sharded async"].rank0


def test_the_counts_equal_the_state_dicts_torch_stages_and_gathers_in_one_process():
    from mmadapt.train import distributed
    from mmadapt.train.optim import parameter_groups
    from mmadapt.train.run import build_model_from
    from mmadapt.train.stages import apply_stages
    from mmadapt.train.trainer import upcast_trainable

    run = config()
    model = build_model_from(run)
    apply_stages(model, run.stages, run.lora)
    upcast_trainable(model)
    optimizer = adamw_after_a_step(model, model, parameter_groups)
    staged = stage(model, optimizer)
    gathered = [*tensors(distributed.full_model_state(model, model)),
                *tensors(distributed.full_optimizer_state(model, optimizer))]
    planned = ways(planning_model(run)[0], strategy="single", ranks=1, device="cuda")
    assert planned["sharded async"].rank0 == storage_bytes(staged)
    assert planned["sharded sync"].rank0 == max(t.nbytes for t in tensors(staged))
    assert planned["gathered"].rank0 == storage_bytes(gathered)


def stage(wrapped, optimizer):
    """The state dict as the trainer stages it for an asynchronous save (`mmadapt.train.saving`: DCP's
    `get_state_dict`, a `DefaultStager` without pinned memory on the CPU)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(wrapped, optimizer)
    return DefaultStager(StagingOptions(False, False, False, False)).stage({"model": model_state,
                                                                            "optimizer": optimizer_state})


def storage_bytes(state) -> int:
    """The bytes of the distinct storages `state`'s tensors live in."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(state)}.values())


def adamw_after_a_step(model, wrapped, parameter_groups):
    optimizer = torch.optim.AdamW(parameter_groups(model, wrapped, lr=1e-3, weight_decay=0.0, lr_by_part={}))
    for p in wrapped.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's state exists from its first step
    return optimizer


def tensors(state):
    """Every tensor of a (nested) state dict; a DTensor's local shard."""
    if isinstance(state, torch.Tensor):
        yield state.to_local() if hasattr(state, "to_local") else state
    elif isinstance(state, dict | list | tuple):
        for value in state.values() if isinstance(state, dict) else state:
            yield from tensors(value)


RANKS_SCRIPT = '''
import json, sys
import torch
from mmadapt.train import distributed
from mmadapt.train.config import RunConfig
from mmadapt.train.optim import parameter_groups
from mmadapt.train.run import build_model_from
from mmadapt.train.stages import apply_stages
from mmadapt.train.trainer import upcast_trainable
from test_plan_saving import adamw_after_a_step, stage, storage_bytes, tensors

run = RunConfig.from_dict(json.loads(sys.argv[1]))
ctx = distributed.init()
torch.manual_seed(0)
model = build_model_from(run)
apply_stages(model, run.stages, run.lora)
upcast_trainable(model)
wrapped = distributed.wrap(model, ctx, run.distributed.strategy, run.precision.mode)
optimizer = adamw_after_a_step(model, wrapped, parameter_groups)
staged = stage(wrapped, optimizer)
gathered = [*tensors(distributed.full_model_state(wrapped, model)),
            *tensors(distributed.full_optimizer_state(wrapped, optimizer))]
# the gathered tensors' own bytes: from a GPU `.to("cpu")` copies those (on the CPU device a tensor of uneven shards
# stays a view of the all-gather's padded output)
result = {"staged": storage_bytes(staged), "largest": max(t.nbytes for t in tensors(staged)),
          "gathered": sum({t.untyped_storage().data_ptr(): t.nbytes for t in gathered}.values())}
open(sys.argv[2].format(rank=ctx.rank), "w").write(json.dumps(result))
'''


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_the_counts_equal_what_torch_stages_and_gathers_on_two_ranks(tmp_path, strategy):
    """Under torchrun (2 processes, gloo): each rank's staged state dict (DCP's stager) and its largest tensor, and
    rank 0's gathered state, equal the plan's; the other rank gathers nothing."""
    import os

    run = config(distributed={"strategy": strategy})
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), json.dumps(run.to_dict()), str(tmp_path / "rank{rank}.json")],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    planned = ways(planning_model(run)[0], strategy="fsdp2" if strategy == "fsdp" else "ddp", ranks=2, device="cpu")
    assert [m["staged"] for m in measured] == [planned["sharded async"].rank0, planned["sharded async"].others]
    assert [m["largest"] for m in measured] == [planned["sharded sync"].rank0, planned["sharded sync"].others]
    # rank 0 holds it all (FSDP2: the tied head gathered under each name; DDP on the GPU: host copies of each tensor)
    whole = ways(planning_model(run)[0], strategy="fsdp2" if strategy == "fsdp" else "ddp", ranks=2,
                 device="cuda")["gathered"].rank0
    assert measured[0]["gathered"] == whole
    # the other rank: nothing under FSDP2; DDP's model state is the live parameters (on the GPU in a real run)
    assert measured[1]["gathered"] == (0 if strategy == "fsdp" else planned["gathered"].others + model_bytes(run))


def model_bytes(run: RunConfig) -> int:
    model, _ = planning_model(run)
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    return sum(t.numel() * t.element_size() for t in unique)


def test_the_table_and_json_say_what_a_save_holds_and_what_would_fit_the_host(tmp_path, capsys):
    path = write_run(tmp_path / "run.yaml", model=TIED, stages={"backbone": "lora"},
                     data={"max_length": 128, "batch_size": 2}, checkpoint={"async": True})
    model, _ = planning_model(RunConfig.load(path))
    assert main(["plan", str(path), "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    staged = ways(model, strategy="fsdp2", ranks=4, device="cuda")
    assert f"host, per rank (saving): sharded async: {staged['sharded async'].rank0 / GIB:.2f} GiB staged per rank; " \
           f"gathered would hold {staged['gathered'].rank0 / GIB:.2f} GiB on rank 0" in out
    assert "sharded async" in out and "per rank (this run): its state dict staged (pinned), the buffers kept" in out
    assert "rank 0's machine" not in out  # no --host-memory: nothing to compare with

    assert main(["plan", str(path), "checkpoint.format=gathered", "checkpoint.async=false", "--gpus", "4", "--json",
                 "--host-memory", "1MiB", "--gpus-per-machine", "2"]) == 0  # the GPUs fit: exit code 0
    saving = json.loads(capsys.readouterr().out)["saving"]
    assert (saving["format"], saving["async"], saving["ranks_per_machine"], saving["fits"]) == (
        "gathered", False, 2, False)
    assert saving["rank0"] == staged["gathered"].rank0 and saving["machine"] == staged["gathered"].rank0
    assert saving["ways"]["sharded async"] == {"rank0": staged["sharded async"].rank0,
                                               "others": staged["sharded async"].others}
    assert [s["change"] for s in saving["suggestions"]] == ["checkpoint.format: sharded"]
    assert saving["suggestions"][0]["machine"] == staged["sharded sync"].rank0 + staged["sharded sync"].others

    whole = ways(model, strategy="ddp", ranks=4, device="cuda")["sharded async"].rank0  # DDP: on every rank
    host = f"{4 * whole // 1024}KiB"  # half of it: twice the whole state, less than the 4 ranks' DDP copies
    assert main(["plan", str(path), "distributed.strategy=ddp", "--gpus", "4", "--host-memory", host]) == 0
    out = capsys.readouterr().out
    assert "rank 0's machine (4 rank(s), data loading included)" in out and "too much (at most 50% for saving)" in out
    assert "would fit the host: checkpoint.async: false" in out
    assert "would fit the host: distributed.strategy: fsdp" in out  # FSDP2 stages a quarter of what DDP does
    assert main(["plan", str(path), "--host-memory", "lots"]) == 2
    assert "--host-memory 'lots': give a size such as" in capsys.readouterr().err


def test_a_save_that_fits_the_host_suggests_nothing():
    model, _ = planning_model(config())
    run = config(checkpoint={"format": "gathered"})
    whole = ways(model, strategy="fsdp2", ranks=8, device="cuda")["gathered"].rank0
    roomy = saving_memory(model, run.checkpoint, strategy="fsdp2", ranks=8, device="cuda",
                          host_memory=int(whole / HOST_SHARE) + 1, data_private=0)
    tight = saving_memory(model, run.checkpoint, strategy="fsdp2", ranks=8, device="cuda",
                          host_memory=int(whole / HOST_SHARE) + 1, data_private=1)  # 8 ranks' data loading: 8 B
    assert (roomy.fits, roomy.suggestions) == (True, [])
    assert tight.fits is False and tight.ranks_per_machine == 8
    assert [change for change, _ in tight.suggestions] == ["checkpoint.format: sharded"]


def test_the_lines_name_this_runs_way_and_the_others():
    """At real sizes (a 27B model's bf16 weights, 1B trained in fp32) on 8 ranks, 2 TiB hosts of 8 ranks."""
    saving = SavingMemory(way="sharded async", strategy="fsdp2", ranks=8, model=54 * GIB, optimizer=8 * GIB,
                          ways={"sharded sync": Way(GIB // 4, GIB // 4, "one tensor at a time"),
                                "sharded async": Way(62 * GIB // 8, 62 * GIB // 8, "its shard staged"),
                                "gathered": Way(62 * GIB, 0, "the whole state at once")},
                          sequence_parallel=2, host_memory=2048 * GIB, ranks_per_machine=8)
    assert saving.lines() == [
        "host, per rank (saving): sharded async: 7.75 GiB staged per rank; gathered would hold 62.00 GiB on rank 0",
        "  state          62.00 GiB   model 54.00 GiB (parameters and buffers as stored) + AdamW 8.00 GiB (moments "
        "and steps of what trains), FSDP2 shards over all 8 ranks (sequence-parallel ones included)",
        "  sharded sync    0.25 GiB   per rank: one tensor at a time",
        "  sharded async   7.75 GiB   per rank (this run): its shard staged",
        "  gathered       62.00 GiB   rank 0: the whole state at once",
        "  rank 0's machine (8 rank(s), data loading included): 62.00 GiB of 2048.00 GiB host memory: fits (at most "
        "50% for saving)"]
    gathered = SavingMemory(**{**saving.__dict__, "way": "gathered"})
    assert gathered.lines()[0] == ("host, per rank (saving): gathered: 62.00 GiB on rank 0, 0.00 GiB on each other "
                                   "rank; sharded would hold at most 0.25 GiB per rank (7.75 GiB staged with "
                                   "checkpoint.async)")
    one = SavingMemory(**{**saving.__dict__, "way": "gathered", "ranks": 1, "ranks_per_machine": 1})
    assert one.lines()[0].startswith("host, per rank (saving): gathered: 62.00 GiB on rank 0; sharded would hold")
    assert SavingMemory(**{**saving.__dict__, "way": "sharded sync"}).lines()[0] == (
        "host, per rank (saving): sharded sync: at most 0.25 GiB per rank (one tensor at a time); gathered would hold "
        "62.00 GiB on rank 0")
