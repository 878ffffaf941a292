"""The data pipeline: sample formats, chat templates, images, preprocessing, collation, dataset checks.

    tokenizer = prepare_tokenizer(model, char_tokenizer())      # or any transformers tokenizer
    encoder = SampleEncoder.for_model(model, tokenizer, image_root="images/", max_length=2048)
    dataset = VLMDataset("train.jsonl", encoder)
    loader = DataLoader(dataset, batch_size=8, num_workers=2,
                        collate_fn=Collator.for_model(model, encoder.pad_token_id, max_tokens=4096))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmadapt.lazy import lazy_names

if TYPE_CHECKING:
    from mmadapt.data.collate import Collator
    from mmadapt.data.config import DataConfig
    from mmadapt.data.geometry import Geometry
    from mmadapt.data.images import DEFAULT_MAX_PIXELS, image_size, load_image
    from mmadapt.data.mixture import Mixture, Source, parse_sources, training_set
    from mmadapt.data.pipeline import SampleEncoder, VLMDataset, length_grouped_sampler
    from mmadapt.data.problems import REASONS, DataProblem
    from mmadapt.data.processors import (
        FixedSizeProcessor,
        ImageProcessor,
        ProcessedImages,
        QwenProcessor,
        processor_for,
    )
    from mmadapt.data.report import BadDataError, BadSampleBudget, DataReport, check_dataset, show_sample
    from mmadapt.data.samples import IMAGE, VIDEO, EncodedSample, Sample, Turn, parse_record, read_records
    from mmadapt.data.templates import TEMPLATES, ChatTemplate
    from mmadapt.data.tokenizer import char_tokenizer, prepare_tokenizer, saved_tokenizer, tokenizer_for
    from mmadapt.data.video import (
        ProcessedVideos,
        Video,
        VideoConfig,
        VideoLimits,
        VideoProcessor,
        VideoSampling,
        load_video,
        probe_video,
    )

EXPORTS: dict[str, str] = {
    "Collator": "mmadapt.data.collate",
    "Geometry": "mmadapt.data.geometry",
    "DEFAULT_MAX_PIXELS": "mmadapt.data.images",
    "image_size": "mmadapt.data.images",
    "load_image": "mmadapt.data.images",
    "Mixture": "mmadapt.data.mixture",
    "Source": "mmadapt.data.mixture",
    "parse_sources": "mmadapt.data.mixture",
    "training_set": "mmadapt.data.mixture",
    "DataConfig": "mmadapt.data.config",
    "SampleEncoder": "mmadapt.data.pipeline",
    "VLMDataset": "mmadapt.data.pipeline",
    "length_grouped_sampler": "mmadapt.data.pipeline",
    "REASONS": "mmadapt.data.problems",
    "DataProblem": "mmadapt.data.problems",
    "FixedSizeProcessor": "mmadapt.data.processors",
    "ImageProcessor": "mmadapt.data.processors",
    "ProcessedImages": "mmadapt.data.processors",
    "QwenProcessor": "mmadapt.data.processors",
    "processor_for": "mmadapt.data.processors",
    "BadDataError": "mmadapt.data.report",
    "BadSampleBudget": "mmadapt.data.report",
    "DataReport": "mmadapt.data.report",
    "check_dataset": "mmadapt.data.report",
    "show_sample": "mmadapt.data.report",
    "IMAGE": "mmadapt.data.samples",
    "VIDEO": "mmadapt.data.samples",
    "EncodedSample": "mmadapt.data.samples",
    "Sample": "mmadapt.data.samples",
    "Turn": "mmadapt.data.samples",
    "parse_record": "mmadapt.data.samples",
    "read_records": "mmadapt.data.samples",
    "TEMPLATES": "mmadapt.data.templates",
    "ChatTemplate": "mmadapt.data.templates",
    "char_tokenizer": "mmadapt.data.tokenizer",
    "prepare_tokenizer": "mmadapt.data.tokenizer",
    "saved_tokenizer": "mmadapt.data.tokenizer",
    "tokenizer_for": "mmadapt.data.tokenizer",
    "ProcessedVideos": "mmadapt.data.video",
    "Video": "mmadapt.data.video",
    "VideoConfig": "mmadapt.data.video",
    "VideoLimits": "mmadapt.data.video",
    "VideoProcessor": "mmadapt.data.video",
    "VideoSampling": "mmadapt.data.video",
    "load_video": "mmadapt.data.video",
    "probe_video": "mmadapt.data.video",
}
"""Each public name -> the module that defines it, imported when the name is first read (`mmadapt.lazy`)."""
__getattr__, __dir__ = lazy_names(__name__, EXPORTS)

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "IMAGE",
    "REASONS",
    "TEMPLATES",
    "VIDEO",
    "BadDataError",
    "BadSampleBudget",
    "ChatTemplate",
    "Collator",
    "DataConfig",
    "DataProblem",
    "DataReport",
    "EncodedSample",
    "FixedSizeProcessor",
    "Geometry",
    "ImageProcessor",
    "Mixture",
    "ProcessedImages",
    "ProcessedVideos",
    "QwenProcessor",
    "Sample",
    "SampleEncoder",
    "Source",
    "Turn",
    "VLMDataset",
    "Video",
    "VideoConfig",
    "VideoLimits",
    "VideoProcessor",
    "VideoSampling",
    "char_tokenizer",
    "check_dataset",
    "image_size",
    "length_grouped_sampler",
    "load_image",
    "load_video",
    "parse_record",
    "parse_sources",
    "prepare_tokenizer",
    "probe_video",
    "processor_for",
    "read_records",
    "saved_tokenizer",
    "show_sample",
    "tokenizer_for",
    "training_set",
]
