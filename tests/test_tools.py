"""mmadapt.tools: the built-in crop / zoom on a real photograph (scikit-image's astronaut), every problem kind of
run_call, user tools described from their docstrings, build_tools' refusals, and the schemas through a real chat
template."""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from PIL import Image
from real_tokenizers import real_tokenizer
from skimage import data

from mmadapt.tools import (
    PROBLEMS,
    TOOLS,
    Tool,
    ToolArgumentError,
    ToolCall,
    ToolContext,
    ToolResult,
    build_tools,
    run_call,
)
from mmadapt.tools.builtin import fit_within

ROOT = Path(__file__).resolve().parents[1]


# ---- user tools, imported by build_tools as `test_tools:<name>` (tests/ is on the path) ------------------------------
def my_tool(query: str, count: int = 2, context: ToolContext = None) -> str:
    """Look up a query in the trajectory.

    Args:
        query: what to look up
        count: how many answers to give
        context: the trajectory (not shown to the model)
    """
    return f"{query} x{count}; {len(context.images)} images, budget {context.max_pixels}"


def undocumented(query: str) -> str:
    """Look up a query, its argument undescribed."""
    return query


def crop(box: list[float]) -> str:
    """A user tool named like the built-in crop.

    Args:
        box: a box
    """
    return "mine"


@pytest.fixture(scope="module")
def astronaut() -> Image.Image:
    return Image.fromarray(data.astronaut())  # 512 x 512 RGB


@pytest.fixture(scope="module")
def tools() -> tuple[Tool, ...]:
    return build_tools(["crop", {"name": "zoom"}])


def context(*images: Image.Image, max_pixels: int = 128 * 128, **limits) -> ToolContext:
    return ToolContext(images=images, max_pixels=max_pixels, **limits)


def call(tools, name, context, timeout=10.0, **arguments) -> ToolResult:
    return run_call(tools, ToolCall(name, arguments), context, timeout=timeout)


# ---- crop and zoom ---------------------------------------------------------------------------------------------------
def test_crop_returns_the_exact_region_at_its_own_pixels(tools, astronaut):
    result = call(tools, "crop", context(astronaut), box=[100, 40, 180.4, 99.6])
    assert result.problem is None and len(result.images) == 1
    np.testing.assert_array_equal(np.asarray(result.images[0]), data.astronaut()[40:100, 100:180])
    assert result.text == "cropped [100, 40, 180, 100] of image 0 (512x512) to 80x60: image 1"


def test_crop_clips_the_box_picks_images_by_index_and_fits_a_large_region(tools, astronaut):
    other = Image.fromarray(data.chelsea())  # 451 x 300
    ctx = context(astronaut, other, max_pixels=100 * 100)
    last = call(tools, "crop", ctx, box=[-20, -5, 30, 40], image=-1)
    np.testing.assert_array_equal(np.asarray(last.images[0]), data.chelsea()[0:40, 0:30])
    assert "of image 1 (451x300)" in last.text and last.text.endswith("image 2")
    whole = call(tools, "crop", ctx, box=[0, 0, 512, 256])  # 131072 px over a 10000 px budget: scaled down
    assert whole.images[0].size == fit_within(512, 256, 10_000) == (141, 70)
    tiny = call(tools, "crop", context(astronaut, min_pixels=400), box=[10, 10, 15, 14])  # 20 px up to >= 400
    assert tiny.images[0].size == (23, 18)


def test_zoom_fills_the_pixel_budget_and_shrinks_back_to_the_crop(tools, astronaut):
    box = [200, 150, 264, 198]  # 64 x 48
    budget = 300 * 200
    result = call(tools, "zoom", context(astronaut, max_pixels=budget), box=box)
    width, height = result.images[0].size
    assert budget - (width + height) <= width * height <= budget and abs(width / height - 64 / 48) < 0.01
    assert result.text == f"zoomed [200, 150, 264, 198] of image 0 (512x512) to {width}x{height}: image 1"
    back = np.asarray(result.images[0].resize((64, 48), Image.Resampling.BICUBIC), dtype=np.float64)
    region = data.astronaut()[150:198, 200:264].astype(np.float64)
    assert np.abs(back - region).mean() < 6  # 8-bit values: the zoom is the region, enlarged
    again = call(tools, "zoom", context(astronaut, max_pixels=budget), box=box)
    assert np.array_equal(np.asarray(again.images[0]), np.asarray(result.images[0]))  # deterministic


@pytest.mark.parametrize("size, budget", [((64, 48), 60_000), ((512, 512), 512 * 512), ((7, 13), 10_007),
                                          ((640, 17), 4_000)])
def test_fit_within_keeps_the_aspect_and_fills_the_budget(size, budget):
    width, height = fit_within(*size, budget)
    scale = math.sqrt(budget / (size[0] * size[1]))
    assert abs(width - size[0] * scale) <= 1 and abs(height - size[1] * scale) <= 1
    assert budget - (width + height) <= width * height <= budget


@pytest.mark.parametrize("size, budget, fitted", [((1, 500), 100, (1, 100)), ((500, 1), 7, (7, 1)),
                                                  ((3, 3), 1, (1, 1)), ((2, 1000), 50, (1, 50))])
def test_fit_within_keeps_a_side_of_one_pixel_within_the_budget(size, budget, fitted):
    assert fit_within(*size, budget) == fitted


@pytest.mark.parametrize("arguments, message", [
    ({"box": [600, 10, 700, 20]}, "holds no pixel of image 0, which is 512x512 pixels"),
    ({"box": [50, 50, 50, 80]}, "holds no pixel of image 0, which is 512x512 pixels"),
    ({"box": [1, 2, 3, 4], "image": 2}, "image must be an image index from -1 to 0 (this conversation has 1 image)"),
    ({"box": [1, 2, 3, 4], "image": -2}, "image must be an image index from -1 to 0"),
    ({"box": [1, 2, float("nan"), 4]}, "box must be 4 numbers [x0, y0, x1, y1], got [1, 2, nan, 4]"),
])
def test_a_box_or_image_the_tool_refuses_is_bad_arguments_with_the_size(tools, astronaut, arguments, message):
    for name in ("crop", "zoom"):
        result = call(tools, name, context(astronaut), **arguments)
        assert (result.problem, result.images) == ("bad_arguments", ())
        assert result.text.startswith(f"error: {name}: ") and message in result.text


def test_relative_coordinates_are_thousandths_of_each_side(astronaut):
    other = Image.fromarray(data.chelsea())  # 451 x 300
    relative = build_tools([{"name": "crop", "coordinates": "relative"}, {"name": "zoom", "coordinates": "relative"}])
    ctx = context(astronaut, other, max_pixels=256 * 256)
    result = call(relative, "crop", ctx, box=[100, 250, 600, 500.2], image=1)  # x: 45.1 .. 270.6, y: 75 .. 150.06
    np.testing.assert_array_equal(np.asarray(result.images[0]), data.chelsea()[75:150, 45:271])
    assert result.text == "cropped [45, 75, 271, 150] of image 1 (451x300) to 226x75: image 2"
    pixels = call(build_tools(["zoom"]), "zoom", ctx, box=[45, 75, 271, 150], image=1)
    zoomed = call(relative, "zoom", ctx, box=[100, 250, 600, 500.2], image=1)
    assert np.array_equal(np.asarray(zoomed.images[0]), np.asarray(pixels.images[0]))
    assert "0 to 1000" in relative[1].schema()["function"]["parameters"]["properties"]["box"]["description"]
    empty = call(relative, "zoom", ctx, box=[1000, 0, 1200, 10])
    assert empty.problem == "bad_arguments" and "x and y from 0 to 1000" in empty.text
    with pytest.raises(ValueError, match=r"^grpo.tools\[1\]: tool 'zoom': coordinates must be one of \['pixels', "):
        build_tools(["crop", {"name": "zoom", "coordinates": "normalized"}])


def test_a_conversation_without_images_has_nothing_to_crop(tools):
    result = call(tools, "crop", context(), box=[0, 0, 4, 4])
    assert (result.problem, result.text) == ("bad_arguments", "error: crop: this conversation has no image to look at")


def test_called_directly_a_builtin_refuses_a_short_box_in_its_own_words(astronaut):
    with pytest.raises(ToolArgumentError, match=r"^box must be 4 numbers \[x0, y0, x1, y1\], got \[1, 2\]$"):
        TOOLS.get("zoom")()(context(astronaut), {"box": [1, 2]})


# ---- run_call's problems ---------------------------------------------------------------------------------------------
def test_run_call_takes_tools_by_name_and_refuses_a_name_twice(tools, astronaut):
    by_name = {tool.name: tool for tool in tools}
    assert call(by_name, "crop", context(astronaut), box=[0, 0, 2, 2]).images[0].size == (2, 2)
    with pytest.raises(ValueError, match="two tools are named 'zoom'"):
        call([*tools, tools[1]], "crop", context(astronaut), box=[0, 0, 2, 2])
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        call(tools, "crop", context(astronaut), timeout=0, box=[0, 0, 2, 2])


def test_an_unknown_tool_names_the_known_ones(tools, astronaut):
    result = call(tools, "rotate", context(astronaut), angle=90)
    assert (result.problem, result.text) == ("unknown_tool", "error: there is no tool 'rotate'; the tools: crop, zoom")


@pytest.mark.parametrize("arguments, says", [
    ({}, "'box' is a required property"),
    ({"box": [1, 2, 3, 4], "scale": 2}, "'scale' was unexpected"),
    ({"box": "1, 2, 3, 4"}, "box: '1, 2, 3, 4' is not of type 'array'"),
    ({"box": [1, 2, "3", 4]}, "box[2]: '3' is not of type 'number'"),
    ({"box": [1, 2, 3, 4], "image": 0.5}, "image: 0.5 is not of type 'integer'"),
    ({"box": [1, 2]}, "box: [1, 2] is too short"),
])
def test_arguments_that_do_not_fit_the_schema_are_bad_arguments(tools, astronaut, arguments, says):
    result = call(tools, "zoom", context(astronaut), **arguments)
    assert result.problem == "bad_arguments" and result.text.startswith("error: zoom: ") and says in result.text
    assert "\n" not in result.text and not result.images


def test_arguments_that_are_no_object_are_bad_arguments(tools, astronaut):
    result = run_call(tools, ToolCall("zoom", [1, 2, 3, 4]), context(astronaut))
    assert result.problem == "bad_arguments" and "must be a JSON object" in result.text


class Returns(Tool):
    """A test tool: returns (or raises, or sleeps on) what it is given."""

    description = "a test tool"
    parameters: ClassVar[dict] = {"type": "object", "properties": {}}

    def __init__(self, name, value=None, sleep=0.0, error=None):
        self.name, self.value, self.sleep, self.error = name, value, sleep, error

    def __call__(self, context, arguments):
        time.sleep(self.sleep)
        if self.error is not None:
            raise self.error
        return self.value


def test_a_tool_that_raises_is_a_tool_error_in_one_line(astronaut, caplog):
    tool = Returns("flaky", error=RuntimeError("disk on fire\nline two"))
    with caplog.at_level(logging.WARNING, logger="mmadapt.tools.calling"):
        result = call([tool], "flaky", context(astronaut))
    assert (result.problem, result.text) == ("tool_error", "error: flaky failed: RuntimeError: disk on fire line two")
    assert "Traceback" not in result.text and "disk on fire" in caplog.text  # the traceback goes to the log
    exits = call([Returns("quits", error=SystemExit(3))], "quits", context(astronaut))
    assert (exits.problem, exits.text) == ("tool_error", "error: quits failed: SystemExit: 3")
    bare = call([Returns("bare", error=KeyError())], "bare", context(astronaut))
    assert bare.text == "error: bare failed: KeyError"


def test_a_tool_past_its_timeout_is_abandoned_promptly(astronaut):
    started = time.perf_counter()
    result = call([Returns("slow", value="late", sleep=3.0)], "slow", context(astronaut), timeout=0.2)
    assert time.perf_counter() - started < 1.0
    assert (result.problem, result.text) == ("timeout", "error: slow: no result within 0.2 s; the call was abandoned")
    assert any(t.name == "tool-slow" and t.daemon for t in threading.enumerate())  # still running, never joined


@pytest.mark.parametrize("value, problem, says", [
    (7, "invalid_result", "returned a int (7)"),
    (b"\x00\x01\x02", "invalid_result", "returned a bytes"),
    (None, "invalid_result", "returned a NoneType"),
    (["text", 3], "invalid_result", "item 1 is a int (3)"),
    ({"text": "t", "pixels": []}, "invalid_result", "keys ['pixels']"),
    ({"images": [b"png"]}, "invalid_result", "'images' is not a list of PIL images"),
    ([Image.new("RGB", (300, 300))], "image_too_large", "image 0 is 300x300 = 90000 pixels, over the limit of 16384"),
    ([Image.new("RGB", (8, 8))] * 5, "too_many_images", "returned 5 images; a call may return at most 4"),
    (Image.new("RGB", (0, 5)), "invalid_result", "it has no pixels"),
    ("x" * 20000, "text_too_long", "returned 20000 characters of text; a call may return at most 16384"),
])
def test_an_invalid_return_is_its_problem(astronaut, value, problem, says):
    result = call([Returns("bad", value=value)], "bad", context(astronaut))
    assert result.problem == problem and says in result.text and not result.images
    assert result.text.startswith("error: bad") and "\n" not in result.text


def test_an_image_that_cannot_be_decoded_is_an_invalid_result(astronaut):
    png = io.BytesIO()
    Image.fromarray(data.astronaut()[:64, :64]).save(png, "PNG")
    truncated = Image.open(io.BytesIO(png.getvalue()[:200]))  # the header reads, the pixels do not
    result = call([Returns("broken", value=truncated)], "broken", context(astronaut))
    assert result.problem == "invalid_result" and "image 0 cannot be read as RGB (OSError" in result.text


def test_a_problem_the_tool_reports_itself_is_kept_in_one_line(astronaut):
    value = ToolResult(text="error: the index is down\nretry later", problem="tool_error")
    result = call([Returns("search", value=value)], "search", context(astronaut))
    assert (result.problem, result.text) == ("tool_error", "error: the index is down retry later")


def test_every_valid_return_form_becomes_rgb_images_and_text(astronaut):
    grey, rgba = Image.new("L", (4, 3), 200), Image.new("RGBA", (5, 2), (10, 20, 30, 40))
    forms = [
        ("plain text", ("plain text", [])),
        (grey, ("", [(4, 3)])),
        (("one", grey, "two", rgba), ("one\ntwo", [(4, 3), (5, 2)])),
        ({"text": "d", "images": [rgba]}, ("d", [(5, 2)])),
        ({"images": (grey,)}, ("", [(4, 3)])),
        (ToolResult(text="r", images=(grey,)), ("r", [(4, 3)])),
    ]
    for value, expected in forms:
        result = call([Returns("ok", value=value)], "ok", context(astronaut))
        assert result.problem is None and (result.text, [i.size for i in result.images]) == expected
        assert all(image.mode == "RGB" for image in result.images)
    first = call([Returns("ok", value=grey)], "ok", context(astronaut)).images[0]
    assert np.asarray(first)[0, 0].tolist() == [200, 200, 200]


def test_a_context_refuses_limits_and_images_it_cannot_hold(astronaut):
    with pytest.raises(ValueError, match=r"ToolContext.max_pixels must be a positive int, got 0"):
        ToolContext(images=(astronaut,), max_pixels=0)
    with pytest.raises(ValueError, match=r"min_pixels \(500\) is over max_pixels \(100\)"):
        ToolContext(images=(astronaut,), max_pixels=100, min_pixels=500)
    with pytest.raises(TypeError, match=r"must be PIL images .* got \['ndarray'\]"):
        ToolContext(images=(np.zeros((4, 4, 3)),), max_pixels=100)


def test_problem_kinds_are_the_documented_ones():
    assert PROBLEMS == ("bad_call", "unknown_tool", "bad_arguments", "tool_error", "timeout", "invalid_result",
                        "image_too_large", "too_many_images", "text_too_long")
    with pytest.raises(ValueError, match="is none of"):
        ToolResult(problem="oops")


# ---- user tools and build_tools --------------------------------------------------------------------------------------
def test_a_user_tool_is_described_from_its_docstring_without_its_context(astronaut):
    (tool,) = build_tools(["test_tools:my_tool"])
    assert tool.schema() == {"type": "function", "function": {
        "name": "my_tool", "description": "Look up a query in the trajectory.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look up"},
            "count": {"type": "integer", "description": "how many answers to give"}},
            "required": ["query"]}}}
    result = call([tool], "my_tool", context(astronaut, astronaut), query="cat")
    assert (result.problem, result.text) == (None, "cat x2; 2 images, budget 16384")
    refused = run_call([tool], ToolCall("my_tool", {"query": "cat", "context": "mine"}), context(astronaut))
    assert refused.problem == "bad_arguments" and "'context' was unexpected" in refused.text
    assert call([tool], "my_tool", context(astronaut), query=3).problem == "bad_arguments"


def test_a_user_tool_without_argument_descriptions_is_refused_naming_it():
    with pytest.raises(ValueError) as caught:
        build_tools(["zoom", "test_tools:undocumented"], where="grpo.tools")
    message = str(caught.value)
    assert message.startswith("grpo.tools[1]: tool 'test_tools:undocumented' cannot be described to the model")
    assert "no description for the argument 'query'" in message and "Google-style docstring" in message
    assert "\n" not in message


@pytest.mark.parametrize("entries, says", [
    (["zoom", "crop", {"name": "zoom"}], r"grpo.tools\[2\]: a tool named 'zoom' is already grpo.tools\[0\]"),
    (["crop", "test_tools:crop"], r"grpo.tools\[1\]: a tool named 'crop' is already grpo.tools\[0\]"),
    (["rotate"], r"grpo.tools\[0\]: unknown tool 'rotate'; known: crop, zoom; or 'package.module:function'"),
    ([{"name": "zoom", "factor": 2}], r"grpo.tools\[0\]: tool 'zoom' has no option \['factor'\]; its options: "
                                      r"\['coordinates'\]"),
    (["test_tools:my_tool", {"name": "test_tools:my_tool", "k": 1}], r"grpo.tools\[1\]: options \['k'\]"),
    (["test_tools:nothing_here"], r"grpo.tools\[0\]: cannot import tool 'test_tools:nothing_here'"),
    (["tools/mine.py:fn"], r"grpo.tools\[0\]: 'tools/mine.py:fn' is not 'package.module:function'"),
    ([{"weight": 1}], r"grpo.tools\[0\]: expected a tool name or a mapping with a 'name'"),
    ("zoom", r"grpo.tools must be a list"),
])
def test_build_tools_refuses_with_the_entry_and_the_fix(entries, says):
    with pytest.raises(ValueError, match=says):
        build_tools(entries)


def test_build_tools_takes_builtins_by_name_and_no_tools_as_empty():
    assert [t.name for t in build_tools(["zoom", "crop"])] == ["zoom", "crop"]
    assert build_tools([]) == ()
    assert TOOLS.names() == ["crop", "zoom"]


@pytest.mark.parametrize("template", ["qwen3_5", "qwen3_vl"])
def test_the_schemas_reach_a_real_chat_template(tools, template):
    tokenizer = real_tokenizer("qwen3")
    template = (ROOT / "mmadapt" / "data" / "chat_templates" / f"{template}.jinja").read_text()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[t.schema() for t in tools],
                                         tokenize=False, chat_template=template)
    assert '"name": "zoom"' in text and '"name": "crop"' in text and '"box"' in text
    assert "pixel coordinates of that image" in text
