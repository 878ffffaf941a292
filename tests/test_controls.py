"""The image controls are declared once (`mmadapt.controls`): eval, sees, the preference view, the demo and the model
card take their names and labels from that declaration, and an older version's report keys read back in it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from mmadapt import demo, evaluate, sees
from mmadapt.controls import (
    BLANKED,
    IMAGE_CONTROLS,
    REAL,
    REVERSED,
    SHUFFLED,
    VIDEO_CONTROLS,
    control_named,
    current_key,
)
from mmadapt.run_directory import RunDirectory
from mmadapt.serve.card import evaluation

PACKAGE = Path(__file__).resolve().parents[1] / "mmadapt"
# the modules that show the controls; none spells a control's name or label itself
READERS = ("evaluate.py", "sees.py", "demo.py", "serve/card.py", "serve/page.py", "evidence/effect.py")


def spellings() -> set[str]:
    """Every name, former name and label of the controls ("images", an older name of `real`, is also a kind)."""
    words = {c.name for c in VIDEO_CONTROLS} | {f for c in VIDEO_CONTROLS for f in c.former} - {"images"}
    return words | {c.label(kind) for c in VIDEO_CONTROLS for kind in ("images", "videos")}


@pytest.mark.parametrize("module", READERS)
def test_the_readers_spell_no_control_themselves(module):
    tree = ast.parse((PACKAGE / module).read_text())
    spelled = sorted({node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                      and isinstance(node.value, str) and node.value in spellings()})
    assert not spelled, f"mmadapt/{module} spells {spelled}: take them from mmadapt.controls"


def eval_report(accuracy: dict[str, float]) -> evaluate.EvalReport:
    return evaluate.EvalReport(accuracy=accuracy, contained=accuracy, chance=0.1, margin=0.2, samples=4,
                               max_new_tokens=2)


def test_eval_sees_the_demo_and_the_card_take_their_names_and_labels_from_the_declaration():
    assert evaluate.VARIANTS == tuple(c.name for c in IMAGE_CONTROLS) == ("real", "blanked", "shuffled")
    assert evaluate.VIDEO_VARIANTS == (*evaluate.VARIANTS, REVERSED.name)
    report = eval_report({c.name: 0.9 if c is REAL else 0.1 for c in VIDEO_CONTROLS})
    assert report.controls == VIDEO_CONTROLS
    assert [line.split()[0] for line in report.lines()[2:6]] == [c.name for c in VIDEO_CONTROLS]
    assert all(c.label("images and videos") in report.verdict for c in (BLANKED, SHUFFLED, REVERSED))
    assert [title for title, _ in sees.COLUMNS[1:]] == [BLANKED.name, SHUFFLED.name]
    assert [key for _, key in sees.COLUMNS[1:] + sees.VIDEO_COLUMNS] == [
        "loss_blanked", "loss_shuffled", "loss_blanked_videos", "loss_reversed", "loss_shuffled_videos"]
    measured = sees.SeesImagesReport(loss=2.0, loss_blanked=2.5, loss_shuffled=2.4, grad_projector=1.0,
                                     grad_encoder=None, images=2, images_shuffled=2)
    printed = [line.split(":")[0] for line in str(measured).splitlines()[:3]]
    assert printed == [f"answer loss, {c.label()}" for c in IMAGE_CONTROLS]
    view = sees.PreferenceView(pairs=2, margin={c.name: 1.0 for c in IMAGE_CONTROLS},
                               accuracy={c.name: 1.0 for c in IMAGE_CONTROLS}, moved=2, with_reference=False)
    assert [line.split()[0] for line in str(view).splitlines()[2:5]] == [c.name for c in IMAGE_CONTROLS]
    shown = demo.DemoReport(evaluation=eval_report({c.name: 0.5 for c in IMAGE_CONTROLS}), steps=1, skipped=0,
                            train_seconds=1.0, final_loss=1.0, model={}, hyperparameters={}, train_samples=1,
                            eval_samples=4, sees_before=measured, sees_after=measured,
                            files={"loss_curve": "l.png", "predictions": "p.png"}, seconds=1.0, out="out")
    assert [line.split("  ")[1] for line in shown.lines()[2:5]] == [c.label() for c in IMAGE_CONTROLS]
    assert {f"accuracy_{c.name}" for c in IMAGE_CONTROLS} <= set(shown.to_dict())


def test_an_older_reports_keys_read_back_in_the_vocabulary(tmp_path):
    assert [current_key(k) for k in ("accuracy_images", "accuracy_blank", "contained_time_shuffled",
                                     "accuracy_shuffled", "chance", "loss_blank")] == [
        "accuracy_real", "accuracy_blanked", "contained_reversed", "accuracy_shuffled", "chance", "loss_blanked"]
    (tmp_path / "report.json").write_text(json.dumps({"accuracy_images": 0.9, "accuracy_blank": 0.1,
                                                      "accuracy_shuffled": 0.2, "chance": 0.1}))
    notes: list[str] = []
    assert list(evaluation(RunDirectory(tmp_path), notes).values()) == [
        {"accuracy_real": 0.9, "accuracy_blanked": 0.1, "accuracy_shuffled": 0.2, "chance": 0.1}]
    assert control_named("blank") is BLANKED and control_named("time_shuffled") is REVERSED
    with pytest.raises(ValueError, match=r"unknown image control 'noise'; known: \['blanked', 'real'"):
        control_named("noise")


def test_each_control_keeps_shapes_and_says_what_it_moved():
    grids = torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 4]])
    pixels = torch.arange(16.0)[:, None].expand(-1, 3)
    assert REAL.pixels(pixels, grids) == (pixels, 0)
    blank = BLANKED.pixels(pixels, grids)
    assert not blank.pixels.any() and blank.pixels.shape == pixels.shape and blank.moved == 3
    moved = SHUFFLED.pixels(pixels, grids)  # the two 2x2 images trade places, the 2x4 one has no partner
    assert moved.moved == 2 and torch.equal(moved.pixels, torch.cat([pixels[4:8], pixels[:4], pixels[8:]]))
    assert SHUFFLED.pixels(pixels[8:], grids[2:]) is None and REVERSED.pixels(pixels, grids) is None  # t == 1
    videos = torch.tensor([[2, 1, 2]])
    reversed_ = REVERSED.pixels(torch.arange(4.0)[:, None], videos)
    assert reversed_.moved == 1 and reversed_.pixels[:, 0].tolist() == [2.0, 3.0, 0.0, 1.0]
    fixed = torch.randn(3, 3, 8, 8)  # fixed-size images: one grid, rolled
    assert SHUFFLED.pixels(fixed).moved == 3 and REVERSED.pixels(fixed) is None
