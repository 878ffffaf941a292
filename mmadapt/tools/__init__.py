"""Tools a policy calls in a multi-turn rollout, and that may return images ("thinking with images").

In a GRPO trajectory the policy may end a turn with a tool call in its chat template's format; the rollout parses it
into a `ToolCall` (a name and JSON arguments), runs it with `run_call`, and renders the `ToolResult` as a `tool`
message the policy reads before it goes on. A tool sees its trajectory through a `ToolContext`: the images so far
(the prompt's first, then each image tools returned, in order) and the limits on what it may return (`max_pixels` per
image, `max_images` per call; `min_pixels`, the size the built-ins scale a small region up to).

Tools (`build_tools`, from a run config's list):
- the built-ins (`TOOLS`, mmadapt/tools/builtin.py): `crop(box, image=0)`, a region at its own pixels, and
  `zoom(box, image=0)`, a region at the resolution the budget allows; `box` = [x0, y0, x1, y1] in pixels of
  trajectory image `image` (-1: the latest);
- user tools, `package.module:function`: a plain function, imported only when the config names it, called as
  `function(**arguments)` (or with `context=` too when it declares that parameter); its schema, what the model reads
  in its tool list, comes from its type hints and Google-style docstring (`transformers.utils.get_json_schema`).

What a tool returns: a str; a PIL image; a list / tuple of str and PIL images (the texts joined with newlines); a
dict {"text": str, "images": [PIL images]}; or a `ToolResult`. Images are converted to RGB, never resized: one over
`max_pixels` is a problem, so a user tool must respect the budget.

`run_call` never raises for what a call or its tool does. Each failure is a `ToolResult` whose `problem` is one of
`PROBLEMS` and whose `text` says what went wrong in one short line, no traceback (the first problem of each kind per
tool is logged at WARNING, with the traceback of an exception): "bad_call" (the rollout's: a call it could not read
in the template's format), "unknown_tool", "bad_arguments" (the arguments
against the tool's JSON schema: missing, unknown or mistyped keys; or a box the tool refuses), "tool_error" (it
raised), "timeout", "invalid_result", "image_too_large", "too_many_images", "text_too_long".

Time: a call runs in a worker thread and is abandoned after `timeout` seconds (10 by default). A Python thread cannot
be killed: an abandoned tool keeps running, and holding what it holds, until it returns by itself; the thread is a
daemon, so it never blocks the process's exit. A tool that may block (a network call, a subprocess) should bound its
own waits.
"""

from mmadapt.tools.base import PROBLEMS, FunctionTool, Tool, ToolArgumentError, ToolCall, ToolContext, ToolResult
from mmadapt.tools.build import build_tools
from mmadapt.tools.builtin import TOOLS, Crop, Zoom
from mmadapt.tools.calling import run_call

__all__ = ["PROBLEMS", "TOOLS", "Crop", "FunctionTool", "Tool", "ToolArgumentError", "ToolCall", "ToolContext",
           "ToolResult", "Zoom", "build_tools", "run_call"]
