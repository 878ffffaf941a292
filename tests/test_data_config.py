"""Data settings are declared once (`mmadapt.data.DataConfig`): each field is a run key (`data.NAME`) and a flag of
`data check`, `data show`, `eval` and `sees`, with the field's one default; a dataset that `data check` passes with a
setting trains with the same setting from run.yaml, counting the same samples as bad.
"""

import json
from dataclasses import fields

import numpy as np
import pytest
import yaml
from helpers import TINY_LLAVA, noise_image, write_jsonl, write_run

from mmadapt.cli import build_parser, main
from mmadapt.cli.common import data_settings
from mmadapt.cli.data import run_config
from mmadapt.data import DataConfig
from mmadapt.data.config import Setting, settings
from mmadapt.train import latest_checkpoint
from mmadapt.train.config import DataSection, RunConfig

COMMANDS = {"data check": ["data", "check", "d.jsonl"], "data show": ["data", "show", "d.jsonl"],
            "eval": ["eval", "MODEL", "d.jsonl"], "sees": ["sees", "MODEL", "d.jsonl"]}
STRINGS = {"chat_template": "tokenizer"}  # str settings whose values are checked; any other str takes "elsewhere"
LLAVA = ["--encoder", "clip", "--projector", "mlp2x_gelu", "--backbone", "llama"]


def other_value(s: Setting):
    """A valid value of the setting that is not its default."""
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if s.kind is bool:
        return not s.default
    if s.kind in (int, float):
        return (s.default or 0) + 1
    if s.kind is dict:
        return yaml.safe_load(s.example)
    return STRINGS.get(s.name, "elsewhere")


def as_text(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip() if isinstance(value, dict) else str(value)


def flag_args(s: Setting, value) -> list[str]:
    if s.kind is bool:
        return [s.flag if value else s.flag.replace("--", "--no-", 1)]
    return [s.flag, as_text(value)]


def test_every_data_setting_is_a_run_key_and_a_flag_with_one_default(tmp_path):
    parser = build_parser()
    for argv in COMMANDS.values():
        assert data_settings(parser.parse_args(argv)) == {}  # no flag restates a default: the field's holds
    assert DataConfig.of(RunConfig.from_dict({}).data) == DataConfig()
    assert DataConfig().max_length == 2048  # eval / sees too (they said 4096)
    run_keys = {f.name for f in fields(DataSection)}
    for s in settings():
        value = other_value(s)
        expected = getattr(DataConfig(**{s.name: value}), s.name)
        assert expected != getattr(DataConfig(), s.name), s.name
        assert s.name in run_keys
        run = RunConfig.from_dict({"data": {s.name: value}})
        assert getattr(run.data, s.name) == expected, f"data.{s.name} in a run file"
        run.save(tmp_path / "run.yaml")
        assert RunConfig.load(tmp_path / "run.yaml") == run.resolved(), f"data.{s.name} round-trips through config.yaml"
        for command, argv in COMMANDS.items():
            args = parser.parse_args([*argv, *flag_args(s, value)])
            assert getattr(DataConfig(**data_settings(args)), s.name) == expected, f"{command} {s.flag}"
        args = parser.parse_args([*COMMANDS["data check"], f"data.{s.name}={as_text(value)}"])
        assert getattr(DataConfig.of(run_config(args)[0].data), s.name) == expected, f"data check data.{s.name}=..."


def test_a_bad_setting_fails_where_it_is_read():
    with pytest.raises(ValueError, match=r"data.truncation must be one of \['drop', 'raise', 'text'\]"):
        RunConfig.load(None, ["data.truncation=cut"])
    with pytest.raises(ValueError, match=r"Did you mean 'data\.allow_outside_root'"):
        RunConfig.load(None, ["data.allow_outside_roots=true"])
    with pytest.raises(ValueError, match="truncation must be one of"):
        DataConfig(truncation="cut")
    with pytest.raises(TypeError, match="video must be a mapping"):
        DataConfig(video="fast")
    assert main(["data", "check", "d.jsonl", "--template-kwargs", "[1]"]) == 2


@pytest.fixture
def drifted(tmp_path):
    """Six good records, one whose image is an absolute path outside the image root, one whose image is missing."""
    root, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    root.mkdir(), elsewhere.mkdir()
    rng = np.random.default_rng(0)
    records = []
    for k in range(8):
        image = {6: str(elsewhere / "abs.png"), 7: "gone.png"}.get(k, f"{k}.png")
        if k != 7:
            noise_image(root / image, rng)
        records.append({"id": f"s{k}", "image": image, "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": f"noise {k}"}]})
    write_jsonl(tmp_path / "train.jsonl", records)
    write_run(tmp_path / "run.yaml", model=TINY_LLAVA,
              data={"train": tmp_path / "train.jsonl", "image_root": root, "allow_outside_root": True,
                    "batch_size": 8},
              train={"steps": 1, "out": tmp_path / "out", "progress": False})
    return tmp_path


def checked(path, *args) -> dict[str, str]:
    """`mmadapt data check`'s problems, id -> reason."""
    out = path / "report.json"
    assert main(["data", "check", str(path / "train.jsonl"), *args, "--json", str(out), "--max-bad-fraction",
                 "0.5"]) == 0
    return {p["id"]: p["reason"] for p in json.loads(out.read_text())["problems"]}


def trained(path, *overrides) -> dict[str, str]:
    """`mmadapt train run.yaml` for one step over all 8 samples: its bad samples, id -> reason."""
    assert main(["train", str(path / "run.yaml"), *overrides]) == 0
    out = yaml.safe_load((path / "run.yaml").read_text())["train"]["out"]
    out = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.out=")), out)
    state = json.loads((latest_checkpoint(out) / "trainer_state.json").read_text())
    assert state["samples_seen"] == 8 and state["bad_samples"] == sum(state["bad_counts"].values())
    assert all(n == 1 for n in state["bad_counts"].values())
    return {problem["id"]: reason for reason, problem in state["first_bad"].items()}


@pytest.mark.slow
def test_a_dataset_that_data_check_passes_with_a_setting_trains_with_it_from_run_yaml(drifted):
    root = str(drifted / "images")
    allowed = checked(drifted, *LLAVA, "--image-root", root, "--allow-outside-root")
    assert allowed == {"s7": "missing_image"}
    assert checked(drifted, *LLAVA, "--image-root", root) == {"s6": "path_outside_root", "s7": "missing_image"}
    assert checked(drifted, str(drifted / "run.yaml")) == allowed  # the run file's model and data section
    data, run = str(drifted / "train.jsonl"), str(drifted / "run.yaml")
    assert main(["data", "check", data, run]) == 0  # 1 of 8 bad: within the run's data.max_bad_fraction 0.2
    assert main(["data", "check", data, run, "data.max_bad_fraction=0.1"]) == 1
    assert trained(drifted) == allowed
    assert trained(drifted, "data.allow_outside_root=false", f"train.out={drifted / 'out2'}") == {
        "s6": "path_outside_root", "s7": "missing_image"}
