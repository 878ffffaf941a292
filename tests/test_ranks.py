"""What makes ranks agree, tested in one process: the optimizer state's format (any world size resumes any other),
the collectives' timeout, the vision side's gradients in a step without images. The torchrun runs that show these
across two processes are in tests/test_distributed.py."""

import pytest
import torch

from mmadapt.train import distributed as dist_utils
from mmadapt.train.config import DistributedSection


def adamw(model):
    groups = [{"params": [model[0].weight], "lr": 1e-3},
              {"params": [model[0].bias, model[1].weight, model[1].bias], "lr": 1e-2, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups)


def stepped(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = adamw(model)
    for _ in range(2):
        model(torch.randn(5, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_optimizer_state_is_keyed_by_names_and_an_old_numbered_state_loads():
    model, optimizer = stepped(0)
    state = dist_utils.full_optimizer_state(model, optimizer)
    assert set(state["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}  # names, not positions
    for saved in (state, optimizer.state_dict()):  # the format of mmadapt >= 0.12 and the numbered one before
        other, restored = stepped(1)
        dist_utils.load_full_optimizer_state(other, restored, saved)
        for p, q in zip(optimizer.param_groups, restored.param_groups, strict=True):
            assert p["lr"] == q["lr"] and p["weight_decay"] == q["weight_decay"]
        ours, theirs = optimizer.state_dict()["state"], restored.state_dict()["state"]
        assert ours.keys() == theirs.keys()
        for k in ours:
            assert all(torch.equal(ours[k][name], theirs[k][name]) for name in ("step", "exp_avg", "exp_avg_sq"))


def test_collectives_timeout_is_a_setting():
    assert DistributedSection().timeout_minutes == 30.0
    with pytest.raises(ValueError, match="timeout_minutes"):
        DistributedSection(timeout_minutes=0)


def test_one_process_helpers_are_identities():
    assert dist_utils.broadcast_object({"a": 1}) == {"a": 1}
    assert dist_utils.gather_objects(3) == [3]
    with pytest.raises(KeyError), dist_utils.failing_together():  # one process: the error passes unchanged
        raise KeyError("x")


@pytest.mark.parametrize("count, size, world", [(3, 1, 2), (5, 2, 2), (4, 2, 2), (1, 4, 3), (0, 2, 2), (7, 3, 4)])
def test_eval_rounds_give_every_rank_as_many_rounds_and_every_batch_once(count, size, world):
    """Batch k of the eval set is rank k % world's, in round k // world; a rank with fewer batches gets empty rounds,
    so an eval that runs one forward (or generate) per round keeps its collectives paired with the other ranks'."""
    from mmadapt.train.batches import eval_rounds

    shares = [eval_rounds(count, size, rank, world) for rank in range(world)]
    assert len({len(rounds) for rounds in shares}) == 1
    batches = -(-count // size)
    assert len(shares[0]) == -(-batches // world)
    items = sorted(i for rounds in shares for r in rounds for i in r)
    assert items == list(range(count))  # each item once
    assert all(len(r) <= size for rounds in shares for r in rounds)
    if (count, size, world) == (3, 1, 2):
        assert shares == [[range(0, 1), range(2, 3)], [range(1, 2), range(0)]]
    with pytest.raises(ValueError, match="batch_size"):
        eval_rounds(3, 0, 0, 1)


def test_one_process_decodes_without_agreeing_and_generate_refuses_no_new_tokens():
    """Only a model sharded by FSDP2 in a process group agrees on each decoding step (one process: no collective)."""
    import mmadapt
    from mmadapt.generation import ranks_step_together

    torch.manual_seed(0)
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama").eval()
    assert not ranks_step_together(model)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        model.generate(ids, max_new_tokens=0)
    assert model.generate(ids, max_new_tokens=3).shape == (1, 3)
