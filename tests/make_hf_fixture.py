"""Write tests/fixtures/hf_gpt2_tiny.pt: a randomly initialised Hugging Face GPT2LMHeadModel's
state dict, an input and the logits Hugging Face computes for it. Needs `transformers`
(a one-off; the test itself does not):  python tests/make_hf_fixture.py"""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
cfg = GPT2Config(
    vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)  # gelu_new, as GPT-2
hf = GPT2LMHeadModel(cfg).eval()
with torch.no_grad():  # HF zero-inits biases and LayerNorm: make them random
    for n, p in hf.named_parameters():
        if "bias" in n or "ln" in n:
            p.add_(torch.randn_like(p) * 0.1)
idx = torch.randint(0, 300, (2, 16))
with torch.no_grad():
    logits = hf(idx).logits
sd = {k: v.clone() for k, v in hf.state_dict().items() if not k.endswith(".attn.bias")}
path = os.path.join(os.path.dirname(__file__), "fixtures", "hf_gpt2_tiny.pt")
torch.save(
    {
        "state_dict": sd,
        "idx": idx,
        "logits": logits,
        "config": dict(vocab_size=300, block_size=16, n_embd=32, n_layer=2, n_head=4),
    },
    path,
)
print("wrote", path, os.path.getsize(path), "bytes")
