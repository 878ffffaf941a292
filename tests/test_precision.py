"""The precision policy is a type (`mmadapt.precision.Precision`): parsed once from the run config's name, asked for
its autocast context, dtypes and bytes by every reader, and no module compares a policy's name outside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mmadapt.numerics.deepspeed import deepspeed_config_for_run
from mmadapt.precision import BF16_AUTOCAST, FP32, PRECISIONS, Precision, as_precision
from mmadapt.train import RunConfig

PACKAGE = Path(__file__).resolve().parents[1] / "mmadapt"
# the spellings of a policy: its config names and its command-line flags other than "none"
SPELLINGS = {p.name for p in PRECISIONS} | {p.flag for p in PRECISIONS if p.autocasts}


def test_the_config_keeps_the_name_and_parses_it_once():
    config = RunConfig.load(None, ["precision.policy=bf16-autocast"])
    assert config.precision.mode is BF16_AUTOCAST and RunConfig.from_dict({}).precision.mode is FP32
    assert config.to_dict()["precision"] == {"policy": "bf16-autocast"}  # YAML stays as users write it
    with pytest.raises(ValueError, match=r"precision.policy must be one of \['fp32', 'bf16-autocast'\], got 'bf16'"):
        RunConfig.load(None, ["precision.policy=bf16"])
    assert Precision.from_flag("bf16") is BF16_AUTOCAST and Precision.from_flag("none") is FP32
    assert as_precision("fp32") is FP32 and as_precision(BF16_AUTOCAST) is BF16_AUTOCAST
    with pytest.raises(ValueError, match="--autocast must be one of"):
        Precision.from_flag("fp16")


def test_each_policy_answers_for_its_dtypes_bytes_and_autocast():
    assert (FP32.compute_dtype, FP32.hidden_bytes, FP32.logit_bytes, FP32.param_dtype) == (torch.float32, 4, 4, None)
    assert (BF16_AUTOCAST.compute_dtype, BF16_AUTOCAST.hidden_bytes, BF16_AUTOCAST.logit_bytes,
            BF16_AUTOCAST.param_dtype) == (torch.bfloat16, 2, 8, torch.bfloat16)
    assert FP32.reduce_dtype == BF16_AUTOCAST.reduce_dtype == torch.float32
    layer = torch.nn.Linear(4, 4)
    with BF16_AUTOCAST.autocast(torch.device("cpu")):
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    with FP32.autocast("cpu"):
        assert layer(torch.ones(1, 4)).dtype == torch.float32
    assert FP32.describe().startswith("precision: fp32 everywhere")
    assert "fp32 gradient reduction" in BF16_AUTOCAST.describe() and str(BF16_AUTOCAST) == "bf16-autocast"


def test_deepspeed_configs_follow_the_policy():
    for policy, enabled in (("fp32", False), ("bf16-autocast", True)):
        run = RunConfig.load(None, [f"precision.policy={policy}"])
        assert deepspeed_config_for_run(run, 2)["bf16"]["enabled"] is enabled


def precision_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing something with a policy's spelling (==, !=, is, in a literal tuple / list / set)."""
    def spelled(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in SPELLINGS
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(spelled(e) for e in node.elts)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            pairs = zip([node.left, *node.comparators[:-1]], node.ops, node.comparators, strict=True)
            if any(spelled(right) or (spelled(left) and not isinstance(op, (ast.In, ast.NotIn)))
                   for left, op, right in pairs):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and spelled(node.value):
            lines.append(node.lineno)
    return lines


def test_no_module_compares_a_precision_string_outside_the_type():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name != "precision.py":
            lines = precision_comparisons(ast.parse(path.read_text(), filename=str(path)))
            if lines:
                found[name] = lines
    assert not found, f"precision names compared outside mmadapt/precision.py: {found}"


def test_the_check_finds_what_it_forbids():
    source = ('a == "bf16-autocast"\nb != "fp32"\nc in ("fp32", "x")\n"bf16" == d\n'
              '"bf16" in cfg\ne == "float32"\nmatch f:\n    case "bf16":\n        pass\n')
    assert precision_comparisons(ast.parse(source)) == [1, 2, 3, 4, 8]
