"""
The book's size as a reader meets it: the route one tensor follows (train step -> model -> f / g -> the compressed
all-reduce -> the kernels and back), then the appendices beside it (machinery that makes a step fast or lean, one
visible call from the book each), file by file. The Python is counted as `ruff format` prints it (line length 120,
the repository's pyproject.toml), the kernels' C++ as written.

    python -m lab.book

CEILING is the route's room to grow, reported with the slack left under it; GUARD, far past it, is where the test
fails. Neither is a target: the route is not packed, and no comment that says why is cut, to stay under a number.
Appendices have no ceiling of their own (each file stays under ~500 lines, as every file).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = ("model.py", "parallel.py", "taco.py", "train.py")
NATIVE = (
    "taco_kernels.cu",
    "taco_kernels_lanes.cuh",
    "taco_kernels_io.cuh",
    "taco_kernels.h",
    "taco_binding.h",
    "taco_binding.cpp",
)
# appendix -> the book's file that calls it
APPENDICES = {"loss.py": "model.py", "recompute.py": "model.py", "optim.py": "train.py"}
CEILING = 3000
GUARD = 3300  # tests/test_style.py fails past this


def lines(name):
    """Lines of a file of the repository: a Python file as ruff format prints it, any other as written."""
    path = os.path.join(ROOT, name)
    with open(path) as f:
        src = f.read()
    if not name.endswith(".py"):
        return src.count("\n")
    out = subprocess.run(
        ["ruff", "format", "--stdin-filename", path, "-"], input=src, capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode:
        raise SystemExit(f"ruff format failed on {path}: {out.stderr}")
    return out.stdout.count("\n")


def counts():
    """[(file, lines)] of the route."""
    return [(f, lines(f)) for f in PYTHON + NATIVE]


def appendix_counts():
    """[(file, lines)] of the appendices."""
    return [(f, lines(f)) for f in APPENDICES]


def main():
    route = counts()
    for f, n in route:
        print(f"{f:26s} {n:6d}")
    total = sum(n for _, n in route)
    print(f"{'the route':26s} {total:6d}   (ceiling {CEILING}: {CEILING - total} lines of slack; guard {GUARD})")
    print()
    appendices = appendix_counts()
    for f, n in appendices:
        print(f"{f:26s} {n:6d}   (called from {APPENDICES[f]})")
    print(f"{'the appendices':26s} {sum(n for _, n in appendices):6d}")
    return 0 if total <= GUARD else 1


if __name__ == "__main__":
    sys.exit(main())
