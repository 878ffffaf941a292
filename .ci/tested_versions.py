"""What this environment tests: one line per package (`tested: NAME==VERSION`), for CI's log; `--check FILE` also
fails, naming each, when an installed distribution is missing from the constraints FILE or differs from it.

    python .ci/tested_versions.py                      # after the install (.ci/run, .ci/versions)
    python .ci/tested_versions.py --check constraints.txt

Standard library only: it also runs in a fresh virtual environment before anything is installed
(`--lowest transformers` prints `transformers==<pyproject's lower bound>`, what `.ci/versions lowest` installs;
`--lowest torch` what `.ci/versions torch-lowest` installs; `--newest torch` prints `torch==<the newest release the
package indexes list inside pyproject's range>`, what `.ci/versions torch-newest` tries, asking
`pip index versions`, which ignores pip's constraints: whether pip may install it here is the install's to say).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the packages whose versions decide what the suite's numbers mean, printed in this order
PRINTED = ("torch", "torchvision", "torchao", "bitsandbytes", "transformers", "tokenizers", "huggingface-hub",
           "accelerate", "peft", "timm", "trl", "lmms-eval", "gradio", "fastapi", "numpy", "pillow", "av")
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


def requirement_of(name: str) -> str:
    """The requirement pyproject.toml's dependencies give NAME, as written (`torch>=2.13.0,<2.16`)."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in dependencies:
        if canonical(re.match(r"[A-Za-z0-9._-]+", requirement)[0]) == canonical(name):
            return requirement
    sys.exit(f"pyproject.toml's dependencies do not name {name!r}")


def lowest(name: str) -> str:
    """`NAME==LOWER`, LOWER the `>=` bound pyproject.toml's dependencies give NAME."""
    requirement = requirement_of(name)
    bound = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", requirement)
    if not bound:
        sys.exit(f"pyproject.toml: {requirement!r} has no >= lower bound to install. Fix: give the range one")
    return f"{name}=={bound[1]}"


def release(text: str) -> tuple[int, ...] | None:
    """`2.13.0` -> (2, 13, 0); None for what a range's end is not tried with: pre-releases, dev and local builds."""
    return tuple(map(int, text.split("."))) if re.fullmatch(r"\d+(\.\d+)*", text) else None


def allows(requirement: str, version: tuple[int, ...]) -> bool:
    """Whether `requirement`'s clauses (>=, >, <=, <, ==, != on plain releases) allow `version`."""
    clauses = re.findall(r"(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)(?=\s*(?:,|;|$))", requirement)
    if not clauses or len(clauses) != requirement.count(",") + 1:
        sys.exit(f"pyproject.toml: {requirement!r} is not a range of >=, >, <=, <, ==, != clauses on releases. "
                 "Fix: write it so, or teach .ci/tested_versions.py the operator")
    width = max(len(version), *(len(bound.split(".")) for _, bound in clauses))
    compare = {">=": tuple.__ge__, ">": tuple.__gt__, "<=": tuple.__le__, "<": tuple.__lt__, "==": tuple.__eq__,
               "!=": tuple.__ne__}
    return all(compare[op](padded(version, width), padded(release(bound), width)) for op, bound in clauses)


def padded(numbers: tuple[int, ...], width: int) -> tuple[int, ...]:
    """(2, 16) -> (2, 16, 0) for width 3: 2.16 and 2.16.0 are one release."""
    return numbers + (0,) * (width - len(numbers))


def newest_listed(requirement: str, listing: str) -> str:
    """The newest plain release `pip index versions` output lists that `requirement` allows."""
    line = re.search(r"^Available versions:(.*)$", listing, re.MULTILINE)
    found = [(release(v.strip()), v.strip()) for v in line[1].split(",")] if line else []
    allowed = [(numbers, text) for numbers, text in found if numbers and allows(requirement, numbers)]
    if not allowed:
        sys.exit(f"the package indexes list no release inside {requirement!r} (`pip index versions` printed "
                 f"{listing.strip()[:200]!r}). Fix: check the network and pip's index settings")
    return max(allowed)[1]


def newest(name: str) -> str:
    """`NAME==NEWEST`, NEWEST the newest release the package indexes list inside pyproject.toml's range for NAME."""
    requirement = requirement_of(name)
    listing = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True,
                             text=True, check=False)
    return f"{name}=={newest_listed(requirement, listing.stdout)}"


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
    if argv[:1] in (["--lowest"], ["--newest"]) and len(argv) == 2:
        print((lowest if argv[0] == "--lowest" else newest)(argv[1]))
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
        sys.exit("usage: python .ci/tested_versions.py [--check CONSTRAINTS | --lowest PACKAGE | --newest PACKAGE]")


if __name__ == "__main__":
    main(sys.argv[1:])
