"""
The book's size as a reader meets it: the Python as `ruff format` prints it (line length 120, the
repository's pyproject.toml) and the kernels' C++ as written, file by file, against the ceiling.

    python -m lab.book
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = ("model.py", "parallel.py", "taco.py", "train.py")
NATIVE = ("taco_kernels.cu", "taco_kernels_io.cuh", "taco_kernels.h", "taco_binding.h", "taco_binding.cpp")
CEILING = 3200


def formatted_lines(path):
    """Lines of a Python file as ruff format prints it."""
    with open(path) as f:
        src = f.read()
    out = subprocess.run(
        ["ruff", "format", "--stdin-filename", path, "-"], input=src, capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode:
        raise SystemExit(f"ruff format failed on {path}: {out.stderr}")
    return out.stdout.count("\n")


def counts():
    rows = [(f, formatted_lines(os.path.join(ROOT, f))) for f in PYTHON]
    for f in NATIVE:
        with open(os.path.join(ROOT, f)) as fh:
            rows.append((f, fh.read().count("\n")))
    return rows


def main():
    rows = counts()
    for f, n in rows:
        print(f"{f:24s} {n:6d}")
    total = sum(n for _, n in rows)
    print(f"{'the book':24s} {total:6d}   (ceiling {CEILING})")
    return 0 if total <= CEILING else 1


if __name__ == "__main__":
    sys.exit(main())
