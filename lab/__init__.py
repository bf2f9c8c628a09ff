"""The lab: studies, emulation and analysis built on the book (model.py, parallel.py, taco.py,
train.py). It imports the book; the book never imports it. Importing lab.tahquant registers the
codec `tahquant` with taco (lab.emulate and lab.analysis do)."""
