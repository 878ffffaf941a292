"""The page's examples: the held-out questions of the run a model belongs to, else scikit-image's photographs.

`default_examples(src, directory)` finds the run `src` belongs to (`RunDirectory.of`), reads its saved config (paths
absolute, so the same files from any working directory) and writes up to `MAX_EXAMPLES` single-image,
single-question records of its `data.eval` as PNGs into `directory` (the page's upload folder: the only files the
page serves); a model with no run, or a run without held-out data, gets scikit-image's sample photographs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mmadapt.data.problems import DataProblem

log = logging.getLogger(__name__)

MAX_EXAMPLES = 6


@dataclass(frozen=True)
class Example:
    """An example question with its image (a PNG the page wrote), and a name to pick it by."""

    name: str
    image: Path
    question: str


def examples_from(data_file: str | os.PathLike, directory: Path, *, limit: int = MAX_EXAMPLES,
                  image_root: str | os.PathLike | None = None) -> list[Example]:
    """Up to `limit` single-image, single-question records of a LLaVA / messages file, their images decoded
    (`load_image`: the data pipeline's limits) and written as PNGs into `directory` (named by a counter)."""
    from mmadapt.data.images import load_image
    from mmadapt.data.samples import IMAGE, parse_record, read_records

    root = Path(image_root) if image_root is not None else Path(data_file).parent
    found = []
    for k, record in enumerate(read_records(data_file, errors="report")):
        if len(found) == limit:
            break
        try:
            sample = parse_record(record, k, str(root))
            users = [t for t in sample.turns if t.role == "user"]
            if len(sample.images) != 1 or len(users) != 1:
                continue
            image = load_image(sample.images[0])
        except (DataProblem, ValueError, OSError) as e:
            log.warning("example %d of %s skipped: %s", k, data_file, e)
            continue
        path = directory / f"example-{len(found)}.png"
        image.save(path)
        question = users[0].text.replace(f"{IMAGE}\n", "").replace(IMAGE, "").strip()
        found.append(Example(f"{sample.id}", path, question))
    return found


def builtin_examples(directory: Path) -> list[Example]:
    """scikit-image's sample photographs (shipped offline), asked to be described."""
    from PIL import Image

    try:
        from skimage import data
    except ImportError:
        return []
    found = []
    for name in ("astronaut", "chelsea", "coffee", "rocket"):
        path = directory / f"{name}.png"
        Image.fromarray(getattr(data, name)()).save(path)
        found.append(Example(name, path, "Describe the image."))
    return found


def default_examples(src: str | os.PathLike | None, directory: Path) -> list[Example]:
    """The held-out questions of the run `src` belongs to (its saved config's data.eval, images under its
    data.image_root: absolute paths, so found from any working directory), else scikit-image's photographs."""
    import yaml

    from mmadapt.run_directory import RunDirectory
    from mmadapt.train.config import RunConfig

    run = RunDirectory.of(src) if src is not None else None
    if run is not None and run.config_file.is_file():
        try:
            data = RunConfig.load(run.config_file).data
            if data.eval and not Path(data.eval).is_file():
                log.warning("the run's held-out file %s (data.eval of %s) is not there: the page shows scikit-image's "
                            "photographs instead", data.eval, run.config_file)
            elif data.eval:
                found = examples_from(data.eval, directory, image_root=data.image_root)
                if found:
                    return found
        except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
            log.warning("the run's examples could not be read from %s: %s", run.config_file, e)
    return builtin_examples(directory)
