"""What can be wrong with one training sample, as a value: `DataProblem(reason, detail)`.

Every check in the data pipeline raises `DataProblem` with one of `REASONS`, the sample id
and the file involved, so a dataset scan can count problems by reason and a training run can
skip a bad sample (counted and logged) instead of crashing mid-run. `per_sample(sample_id)` turns
any other exception raised while one sample is worked on into its `DataProblem` (`out_of_memory`
for allocation failures, else `unexpected_error` with the exception's type and message), so no
per-sample failure ever leaves the pipeline as a raw exception; `KeyboardInterrupt` and
`SystemExit` pass through.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

REASONS: dict[str, str] = {
    "bad_format": "the record is not a LLaVA or messages sample (missing or malformed fields)",
    "missing_image": "an image file does not exist",
    "path_outside_root": "an image path is absolute or escapes the image root",
    "unreadable_image": "an image file is corrupt, truncated or not an image",
    "image_too_large": "an image has more pixels than the decompression-bomb cap",
    "placeholder_mismatch": "the number of <image> (<video>) placeholders differs from the number of images (videos)",
    "image_without_placeholder": "the sample has images but its text has no <image> placeholder",
    "empty_answer": "an assistant turn is empty",
    "no_supervised_tokens": "nothing to learn: the sample has no assistant tokens",
    "too_long": "the sample does not fit max_length without cutting an image span",
    "missing_video": "a video file does not exist",
    "unreadable_video": "a video file is not a container, has no video stream, or is truncated",
    "video_too_large": "a video has more frames, pixels per frame or seconds than the limits (header checked)",
    "empty_video": "a video (file or frame list) has no frames",
    "variable_frame_size": "the frames of a video do not all have the same size",
    "video_without_placeholder": "the sample has videos but its text has no <video> placeholder",
    "video_unsupported": "the sample has a video but the model takes none (a fixed-size encoder, or a backbone "
                         "without a video token); fatal: every video sample would be skipped",
    "template_error": "the chat template refuses the conversation (e.g. no user turn, an image in the system turn)",
    "sample_too_large": "a sample has more images, image pixels, video frames, decoded video bytes, or tar members "
                        "or bytes than the per-sample limits (header checked)",
    "unreadable_shard": "a WebDataset tar shard is truncated or corrupt: the samples from there on are skipped",
    "out_of_memory": "decoding the sample's images or videos could not allocate its memory",
    "table_too_large": "a Parquet / Arrow row group or cell over the table limits (max_row_group_bytes, "
                       "max_cell_bytes, max_decode_ratio): checked from the footer, never decoded",
    "unreadable_row": "a row of a Parquet / Arrow file or shard that cannot be read (e.g. a text cell that is not "
                      "UTF-8, a corrupt page); the source's other rows are read",
    "bad_pair": "a preference pair without two different answers, or whose answers follow different prompts",
    "unexpected_error": "an exception the pipeline did not foresee (its type and message are in the detail)",
}


class DataProblem(ValueError):
    """One bad sample: `reason` (a key of `REASONS`), `detail`, and where (`sample_id`, `path`).

    `fatal` problems (e.g. `truncation="raise"`) stop a training run; the others are counted and skipped.
    """

    def __init__(self, reason: str, detail: str, *, sample_id: str | None = None, path: str | None = None,
                 fatal: bool = False, source: str | None = None) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown data problem reason {reason!r}; known: {sorted(REASONS)}")
        self.reason, self.detail, self.sample_id, self.path, self.fatal = reason, detail, sample_id, path, fatal
        self.source = source  # the `data.train` source, in a mixture (`mmadapt.data.mixture`)
        super().__init__(self._message())

    def _message(self) -> str:
        where = "".join([f"sample {self.sample_id!r}: " if self.sample_id is not None else "",
                         f"{self.path}: " if self.path is not None else ""])
        return f"{where}{self.reason}: {self.detail}"

    def __reduce__(self) -> tuple:  # picklable across DataLoader workers
        return (_rebuild, (self.reason, self.detail, self.sample_id, self.path, self.fatal, self.source))

    def for_sample(self, sample_id: str) -> DataProblem:
        """The same problem, attributed to `sample_id` (image loaders do not know which sample asked)."""
        return DataProblem(self.reason, self.detail, sample_id=sample_id, path=self.path, fatal=self.fatal,
                           source=self.source)

    def to_dict(self) -> dict[str, str | None]:
        return {"id": self.sample_id, "reason": self.reason, "detail": self.detail, "path": self.path,
                **({"source": self.source} if self.source is not None else {})}


def _rebuild(reason: str, detail: str, sample_id: str | None, path: str | None, fatal: bool,
             source: str | None = None) -> DataProblem:
    return DataProblem(reason, detail, sample_id=sample_id, path=path, fatal=fatal, source=source)


@contextlib.contextmanager
def per_sample(sample_id: str) -> Iterator[None]:
    """Any exception but `DataProblem` raised inside becomes the sample's `DataProblem`: a `MemoryError` (or torch's
    allocation `RuntimeError`) is `out_of_memory`, anything else `unexpected_error` naming its type and message (a
    bug stays visible: its traceback is logged at debug level). `BaseException`s (Ctrl-C, exit) pass through."""
    try:
        yield
    except DataProblem:
        raise
    except Exception as e:
        raise problem_of(e, sample_id) from e


def problem_of(error: Exception, sample_id: str | None = None) -> DataProblem:
    """The `DataProblem` for an unforeseen exception `error` raised while sample `sample_id` was worked on."""
    what = f"{type(error).__name__}: {error}"
    if is_allocation_error(error):
        return DataProblem("out_of_memory", f"{what}. Fix: lower the data limits (max_image_pixels, "
                           "max_sample_pixels, max_video_bytes) or data.num_workers, or drop the sample",
                           sample_id=sample_id)
    log.debug("sample %r: unforeseen %s", sample_id, what, exc_info=error)
    return DataProblem("unexpected_error", f"{what}. This is likely a bug in mmadapt or an input it does not "
                       "handle: please report it with the sample", sample_id=sample_id)


def is_allocation_error(error: BaseException) -> bool:
    """Whether `error` is an allocation failure: a `MemoryError`, or torch's `RuntimeError` "can't allocate memory"."""
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "allocate" in str(error))


def read_guarded(records: Any, index: int) -> Any:
    """`records[index]`, or the `DataProblem` that stops it: a source that cannot give one record (a row that does not
    decode) costs that record, never the run (fatal problems, Ctrl-C and exit raise)."""
    try:
        return records[index]
    except DataProblem as problem:
        if problem.fatal:
            raise
        return problem
    except IndexError:  # out of range: the caller's mistake, not the record's
        raise
    except Exception as e:
        return problem_of(e, str(index))


def guarded(encode: Callable[[], Any], sample_id: Callable[[], str]) -> Any:
    """`encode()`, or the `DataProblem` that stops it: any exception becomes one (`problem_of`, attributed to
    `sample_id()`); fatal problems, Ctrl-C and exit raise. What a dataset's `__getitem__` returns for a bad sample."""
    try:
        return encode()
    except DataProblem as problem:
        if problem.fatal:
            raise
        return problem
    except Exception as e:
        return problem_of(e, sample_id())
