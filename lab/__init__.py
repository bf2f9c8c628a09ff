"""The lab: studies, emulation and analysis built on the book (model.py, parallel.py, taco.py,
train.py). It imports the book; the book never imports it."""
from lab import tahquant  # noqa: F401  (registers the codec `tahquant` with taco)
