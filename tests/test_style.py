"""The layout is the formatter's: every Python file as `ruff format` prints it (line length 120,
pyproject.toml), and `ruff check`'s small rule set (pyflakes, import order) clean. CI runs these with
the rest of the suite, so an unformatted file fails it."""

import os
import re
import shutil
import subprocess

import pytest

from launcher import ROOT


def ruff(*args):
    exe = shutil.which("ruff") or pytest.fail("ruff is not installed: pip install -r requirements-test.txt")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True)


def test_every_python_file_is_formatted():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, f"ruff format would change these files (run `ruff format .`):\n{out.stdout}{out.stderr}"


def test_ruff_check_is_clean():
    out = ruff("check", ".")
    assert out.returncode == 0, f"ruff check (pyflakes, import order; `ruff check --fix .`):\n{out.stdout}{out.stderr}"


def test_the_route_stays_under_its_guard():
    """train.py -> model.py -> parallel.py -> taco.py -> the kernels, counted as printed (python -m lab.book): the
    test fails only past the guard, far above the ceiling that lab.book reports the slack under."""
    from lab import book

    assert shutil.which("ruff"), "ruff is not installed: pip install -r requirements-test.txt"
    total = sum(n for _, n in book.counts())
    assert book.CEILING < book.GUARD
    assert total <= book.GUARD, f"the route is {total} lines, past its guard of {book.GUARD} (ceiling {book.CEILING})"


def test_the_appendices_are_called_from_the_book_and_import_no_lab():
    """Each appendix is imported by the book file that calls it, and none imports the lab or the tests."""
    from lab import book

    for appendix, caller in book.APPENDICES.items():
        name = appendix.removesuffix(".py")
        with open(os.path.join(ROOT, caller)) as f:
            src = f.read()
        assert re.search(rf"^(import {name}$|from {name} import )", src, re.M), f"{caller} does not import {name}"
        with open(os.path.join(ROOT, appendix)) as f:
            assert not re.search(r"^(import|from) (lab|tests)\b", f.read(), re.M), f"{appendix} imports the lab"
