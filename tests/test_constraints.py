"""constraints.txt, the exact versions CI installs (.ci/run): every package pyproject's `test` install needs is pinned
there inside pyproject's range, the packages CI's log names are among them, and no other file of the project writes
their exact versions (pyproject keeps ranges, torch's too). `.ci/tested_versions.py --check` refuses an environment
that differs; its `--lowest` / `--newest` give the range ends `.ci/versions` installs."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def ci_versions():
    spec = importlib.util.spec_from_file_location("tested_versions", ROOT / ".ci" / "tested_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_requirements(extras: tuple[str, ...] = ("test",)) -> list[Requirement]:
    """pyproject's dependencies and those of `extras`, `mmadapt[...]` expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, todo, seen = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in map(Requirement, project["optional-dependencies"][extra]):
            if requirement.name == "mmadapt":
                todo.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


def test_every_requirement_is_pinned_inside_its_range():
    versions = ci_versions()
    pins = versions.pins(ROOT / "constraints.txt")
    requirements = install_requirements()
    assert {"transformers", "peft", "timm", "trl", "lmms-eval", "gradio", "fastapi", "torchao", "bitsandbytes"} <= {
        r.name for r in requirements}
    for requirement in requirements:
        name = versions.canonical(requirement.name)
        assert name in pins, f"constraints.txt does not pin {requirement}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])
    assert set(map(versions.canonical, versions.PRINTED)) <= set(pins)  # what CI's log names is what it installed


def test_the_constraints_file_is_the_one_place_the_exact_versions_are_written():
    names = list(ci_versions().PRINTED)
    files = [ROOT / "pyproject.toml", ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / ".ci").iterdir()]
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")\s*==\s*\d", re.IGNORECASE)
    written = [f"{path.name}: {m[0]}" for path in files if path.is_file() for m in pattern.finditer(path.read_text())]
    assert written == []


def test_a_line_that_is_not_a_pin_and_an_environment_that_differs_are_refused(tmp_path):
    versions = ci_versions()
    bad = tmp_path / "constraints.txt"
    bad.write_text("# a comment\ntransformers>=5.24\n")
    with pytest.raises(SystemExit, match=r"constraints.txt:2: 'transformers>=5.24' is not NAME==VERSION"):
        versions.pins(bad)
    bad.write_text("pytest==0.0.1\n")
    problems = versions.check(bad)
    assert any(p.startswith("pytest ") and p.endswith("pins 0.0.1") for p in problems)
    assert any("does not pin it" in p for p in problems) and not any(p.startswith("mmadapt ") for p in problems)


def test_the_torch_range_ends_are_read_from_pyproject():
    versions = ci_versions()
    torch = next(r for r in install_requirements() if r.name == "torch")
    assert versions.lowest("torch") == f"torch=={min(s.version for s in torch.specifier if s.operator == '>=')}"
    assert versions.lowest("torchvision").startswith("torchvision==0.")
    listing = ("torch (9.0.0)\nAvailable versions: 9.0.0, 2.16.0, 2.15.1rc1, 2.15.0, 2.14.1+cpu, 2.14.1, 2.13.0, "
               "2.12.1\n")
    assert versions.newest_listed("torch>=2.13.0,<2.16", listing) == "2.15.0"  # no pre-release, no local build
    assert versions.newest_listed("torch>=2.13.0,<=2.14.1", listing) == "2.14.1"
    assert versions.newest_listed("torch>=2.13,!=2.15.0,<2.16", listing) == "2.14.1"
    with pytest.raises(SystemExit, match=r"no release inside 'torch>=10'"):
        versions.newest_listed("torch>=10", listing)
    with pytest.raises(SystemExit, match=r"'torch~=2.13' is not a range of >=, >, <=, <, ==, != clauses"):
        versions.newest_listed("torch~=2.13", listing)
