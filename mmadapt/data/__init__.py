"""The data pipeline: sample formats, chat templates, images, preprocessing, collation, dataset checks.

    tokenizer = prepare_tokenizer(model, char_tokenizer())      # or any transformers tokenizer
    encoder = SampleEncoder.for_model(model, tokenizer, image_root="images/", max_length=2048)
    dataset = VLMDataset("train.jsonl", encoder)
    loader = DataLoader(dataset, batch_size=8, num_workers=2,
                        collate_fn=Collator.for_model(model, encoder.pad_token_id, max_tokens=4096))
"""

from mmadapt.data.collate import Collator
from mmadapt.data.geometry import Geometry
from mmadapt.data.images import DEFAULT_MAX_PIXELS, image_size, load_image
from mmadapt.data.mixture import Mixture, Source, parse_sources, training_set
from mmadapt.data.pipeline import DataConfig, SampleEncoder, VLMDataset, length_grouped_sampler
from mmadapt.data.problems import REASONS, DataProblem
from mmadapt.data.processors import FixedSizeProcessor, ImageProcessor, ProcessedImages, QwenProcessor, processor_for
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
