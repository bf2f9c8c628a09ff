"""sample.py and the tokenizer: Hugging Face weight loading, generation."""
import os

import torch

from data.tokenizer import get_encoding
from launcher import run_ranks
from model import GPT, GPTConfig
from checkpoint import hf_to_full, shard_into
from sample import full_logits, generate
from test_parallel import comm_for

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_gpt2_tiny.pt")


def from_hf_state_dict(sd, config, comm=None):
    model = GPT(config, comm)
    shard_into(model, hf_to_full(sd, config))
    return model


def test_tokenizer_gives_gpt2_ids():
    enc = get_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257
    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    assert enc.decode(enc.encode(text)) == text


def test_hf_state_dict_gives_hf_logits():
    fx = torch.load(FIXTURE, weights_only=False)
    model = from_hf_state_dict(fx["state_dict"], GPTConfig(**fx["config"])).eval()
    idx, ref = fx["idx"], fx["logits"]
    with torch.no_grad():
        logits, _ = model(idx, idx)
    # our head is padded to a multiple of 128 columns; the first 300 must be Hugging Face's logits
    torch.testing.assert_close(logits[..., :300], ref, rtol=1e-4, atol=1e-5)


def _hf_tp(rank, world):
    fx = torch.load(FIXTURE, weights_only=False)
    model = from_hf_state_dict(fx["state_dict"], GPTConfig(**fx["config"]), comm_for(rank, world)).eval()
    with torch.no_grad():
        return full_logits(model, fx["idx"]), fx["logits"][:, -1, :]


def test_hf_state_dict_sliced_for_tp2():
    for ours, ref in run_ranks(_hf_tp, 2):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_generate_is_deterministic_and_in_vocabulary():
    model = GPT(GPTConfig(block_size=8, vocab_size=200, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.zeros(1, 1, dtype=torch.long)
    a = generate(model, idx, 20, generator=torch.Generator().manual_seed(0))
    b = generate(model, idx, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (1, 21)
    assert int(a.max()) < 200                     # never a padding id (vocab padded to 256)
