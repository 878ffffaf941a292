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
