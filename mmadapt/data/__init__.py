"""The data pipeline: sample formats, chat templates, images, preprocessing, collation."""

from mmadapt.data.collate import Collator
from mmadapt.data.problems import REASONS, DataProblem
from mmadapt.data.samples import EncodedSample, Sample, Turn, parse_record, read_records

__all__ = ["REASONS", "Collator", "DataProblem", "EncodedSample", "Sample", "Turn", "parse_record", "read_records"]
