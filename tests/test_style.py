"""The layout is the formatter's: every Python file as `ruff format` prints it (line length 120,
pyproject.toml), and `ruff check`'s small rule set (pyflakes, import order) clean. CI runs these with
the rest of the suite, so an unformatted file fails it."""

import shutil
import subprocess

import pytest

from launcher import ROOT


def ruff(*args):
    exe = shutil.which("ruff") or pytest.fail("ruff is not installed: pip install -r requirements.txt")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True)


def test_every_python_file_is_formatted():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, f"ruff format would change these files (run `ruff format .`):\n{out.stdout}{out.stderr}"


def test_ruff_check_is_clean():
    out = ruff("check", ".")
    assert out.returncode == 0, f"ruff check (pyflakes, import order; `ruff check --fix .`):\n{out.stdout}{out.stderr}"


def test_the_book_stays_under_its_ceiling():
    """model.py -> parallel.py -> taco.py -> the kernels -> train.py, counted as printed (python -m lab.book)."""
    from lab import book

    assert shutil.which("ruff"), "ruff is not installed: pip install -r requirements.txt"
    total = sum(n for _, n in book.counts())
    assert total <= book.CEILING, f"the book is {total} lines, over its ceiling of {book.CEILING}"
