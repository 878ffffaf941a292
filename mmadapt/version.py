"""mmadapt's version, declared once.

pyproject.toml reads it from this file's text (`[tool.setuptools.dynamic]`), `mmadapt.__version__` re-exports it,
and the records that name the version (a transformers export's processor record, an lmms-eval run's record) import
it from here. The bottom layer: it imports nothing, so any module may read it without an arrow that climbs.
"""

__version__ = "0.28.0"
