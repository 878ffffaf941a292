"""What this environment tests: one line per package (`tested: NAME==VERSION`), for CI's log; `--check FILE` also
fails, naming each, when an installed distribution is missing from the constraints FILE or differs from it.

    python .ci/tested_versions.py                      # after the install (.ci/run, .ci/versions)
    python .ci/tested_versions.py --check constraints.txt

Standard library only: it also runs in a fresh virtual environment before anything is installed
(`--lowest transformers` prints `transformers==<pyproject's lower bound>`, what `.ci/versions lowest` installs).
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the packages whose versions decide what the suite's numbers mean, printed in this order
PRINTED = ("torch", "torchvision", "transformers", "tokenizers", "huggingface-hub", "accelerate", "peft", "timm",
           "trl", "lmms-eval", "gradio", "fastapi", "numpy", "pillow", "av")
UNPINNED = {"pip", "setuptools", "wheel", "distribute", "mmadapt"}  # what `pip freeze --exclude-editable` leaves out


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """constraints FILE as {canonical name: version}: every line `NAME==VERSION` (comments and blank lines aside)."""
    found = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if not match:
            sys.exit(f"{path}:{number}: {line!r} is not NAME==VERSION. Fix: regenerate the file (.ci/versions freeze)")
        found[canonical(match[1])] = match[2]
    return found


def lowest(name: str) -> str:
    """`NAME==LOWER`, LOWER the `>=` bound pyproject.toml's dependencies give NAME."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in dependencies:
        if canonical(re.match(r"[A-Za-z0-9._-]+", requirement)[0]) == canonical(name):
            bound = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", requirement)
            if not bound:
                sys.exit(f"pyproject.toml: {requirement!r} has no >= lower bound to install. Fix: give the range one")
            return f"{name}=={bound[1]}"
    sys.exit(f"pyproject.toml's dependencies do not name {name!r}")


def check(path: Path) -> list[str]:
    """Each installed distribution that `path` does not pin at its installed version, as a line saying so."""
    wanted = pins(path)
    problems = []
    for dist in sorted(distributions(), key=lambda d: canonical(d.metadata["Name"])):
        name = canonical(dist.metadata["Name"])
        if name in UNPINNED:
            continue
        if name not in wanted:
            problems.append(f"{name} {dist.version} is installed but {path.name} does not pin it")
        elif wanted[name] != dist.version:
            problems.append(f"{name} {dist.version} is installed but {path.name} pins {wanted[name]}")
    return problems


def main(argv: list[str]) -> None:
    if argv[:1] == ["--lowest"] and len(argv) == 2:
        print(lowest(argv[1]))
        return
    print(f"tested: python=={sys.version.split()[0]}")
    for name in PRINTED:
        try:
            print(f"tested: {name}=={version(name)}")
        except PackageNotFoundError:
            print(f"tested: {name} not installed")
    if argv[:1] == ["--check"] and len(argv) == 2:
        problems = check(Path(argv[1]))
        if problems:
            sys.exit("the environment is not the constraints file's: " + "; ".join(problems)
                     + ". Fix: a fresh virtual environment, or regenerate the file (README, Development)")
    elif argv:
        sys.exit("usage: python .ci/tested_versions.py [--check CONSTRAINTS | --lowest PACKAGE]")


if __name__ == "__main__":
    main(sys.argv[1:])
