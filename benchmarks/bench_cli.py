"""The first command a newcomer types: wall time of `mmadapt --help` and `mmadapt COMMAND --help`, whole processes.

    python benchmarks/bench_cli.py [--reps 5] [--commands train serve ...] [--quick]

Each line runs `python -m mmadapt ARGS` `--reps` times (what the `mmadapt` script runs) and prints the median, the
fastest and the slowest wall time, and whether the process imported torch (a second run with `-X importtime`).
Target: every `--help` under 1 s (median of 5) with no torch (tests/test_cli.py checks each command and subcommand,
the best of 2 runs); a declaration a command's flags are derived from that starts importing torch shows it here.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, str]:
    """This checkout first on the path, as `pip install -e .` would have it."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def wall_times(args: list[str], reps: int) -> list[float]:
    """Seconds per run of `python -m mmadapt ARGS` (it must exit 0)."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "mmadapt", *args], check=True, capture_output=True, env=environment())
        times.append(time.perf_counter() - started)
    return times


def imports_torch(args: list[str]) -> bool:
    """Whether `python -m mmadapt ARGS` imports torch (from `-X importtime`'s list of imported modules)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "mmadapt", *args], check=True,
                          capture_output=True, text=True, env=environment())
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="runs per line (default 5: the median of 5)")
    parser.add_argument("--commands", nargs="*", default=None, help="commands whose --help to time (default: all)")
    parser.add_argument("--quick", action="store_true", help="one run per line, `--help` and `train --help` only")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from mmadapt.cli import COMMANDS

    reps = 1 if args.quick else args.reps
    commands = ["train"] if args.quick else (args.commands if args.commands is not None else list(COMMANDS))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}; "
          f"{reps} run(s) per line\n")
    print("| command | median s | min s | max s | imports torch |")
    print("|---|---|---|---|---|")
    for line in [["--help"], *([name, "--help"] for name in commands)]:
        times = wall_times(line, reps)
        print(f"| mmadapt {' '.join(line)} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | "
              f"{'yes' if imports_torch(line) else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
