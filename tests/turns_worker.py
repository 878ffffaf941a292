"""A GRPO run with tools whose tiny random policy calls `zoom` after every answer of an odd number of characters
(`tests/test_turns.py`'s one-process / torchrun comparison): trajectories of different numbers of turns on each rank,
each row from its own seed, so one process and two ranks draw the same ones.

    python turns_worker.py CONFIG [overrides...]          (or under torchrun)
"""

from __future__ import annotations

import sys

import torch

from mmadapt.data.tool_turns import ToolTurns
from mmadapt.train import RunConfig, Trainer
from mmadapt.train.run import build_run


def odd_calls(self, text):
    """Every answer of an odd length calls zoom on the top-left of the prompt's image."""
    return [("zoom", {"box": [0, 0, 32, 32]})] if len(text) % 2 else []


def main(argv: list[str]) -> None:
    ToolTurns.parse = odd_calls
    ToolTurns.marker = property(lambda self: "")
    config = RunConfig.load(argv[0], argv[1:])
    parts = build_run(config)
    end = parts.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ending(module, args, output):  # answers of a few tokens: the end of turn made likely everywhere
        return output.index_add(-1, torch.tensor([end], device=output.device),
                                torch.full((*output.shape[:-1], 1), 5.0, device=output.device, dtype=output.dtype))

    parts.model.backbone.get_output_embeddings().register_forward_hook(ending)
    trainer = Trainer(parts.model, config, parts.train_data, parts.collate, eval_data=parts.eval_data,
                      tokenizer=parts.tokenizer)
    trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1:])
