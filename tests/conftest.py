"""Shared fixtures: tiny random transformers checkpoints written to a temporary directory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Tests never reach a hub: set before huggingface_hub is first imported (it reads this at import), and inherited by the
# processes tests start. bitsandbytes' import otherwise asks the hub for a CPU kernel (tests/test_bnb.py).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from mmadapt.backbones import BACKBONES
from mmadapt.encoders import ENCODERS


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`: the full suite's command) each worker computes on one thread, and so do the
    processes it starts: two workers on two cores, not four threads fighting for them. The records cache
    (mmadapt.data.records) and `datasets`' cache are a temporary directory of the session's, not the user's."""
    if "MMADAPT_CACHE" not in os.environ:
        cache = tempfile.mkdtemp(prefix="mmadapt-cache-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["MMADAPT_CACHE"] = cache
        os.environ["HF_DATASETS_CACHE"] = os.path.join(cache, "datasets")  # `datasets`' Parquet conversions
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def tiny_options(registry, name: str) -> dict:
    options = registry.get(name).options("tiny")
    return {k: v for k, v in options.items() if not k.endswith("token_id")}


@pytest.fixture(scope="session")
def hf_qwen_dir(tmp_path_factory):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    text = tiny_options(BACKBONES, "qwen3_5")
    vision = ENCODERS.get("qwen3_5_vit").options("tiny")
    config = Qwen3_5Config(text_config=text, vision_config={**vision, "out_hidden_size": text["hidden_size"]},
                           image_token_id=250, video_token_id=251, vision_start_token_id=248, vision_end_token_id=249)
    path = tmp_path_factory.mktemp("hf_qwen3_5")
    Qwen3_5ForConditionalGeneration(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_llava_dir(tmp_path_factory):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(vision_config={**ENCODERS.get("clip").options("tiny"), "model_type": "clip_vision_model"},
                         text_config={**tiny_options(BACKBONES, "llama"), "model_type": "llama"},
                         image_token_id=255)
    path = tmp_path_factory.mktemp("hf_llava")
    LlavaForConditionalGeneration(config).save_pretrained(path)
    return path
