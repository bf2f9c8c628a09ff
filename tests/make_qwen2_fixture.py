"""Write the Qwen2 fixtures: two tiny random Hugging Face Qwen2ForCausalLM folders and what Hugging
Face computes from them. Needs `transformers` (a one-off; the tests do not):

    python tests/make_qwen2_fixture.py

tests/fixtures/hf_qwen2_untied/   grouped-query attention (4 query heads, 2 key/value heads), an
                                  untied head, model.safetensors, config.json as transformers 5 writes it
tests/fixtures/hf_qwen2_tied/     a tied head, the weights sharded (model-0000N-of-0000M.safetensors and
                                  the index), config.json in transformers 4's form (rope_theta at the top)
tests/fixtures/hf_qwen2_expected.pt   per folder: an input, its logits, 8 greedy tokens after a prompt
Hugging Face initialises biases to 0 and norm weights to 1: both are randomised here."""

import json
import os

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
expected = {}
for name, tied, kv in (("untied", False, 2), ("tied", True, 4)):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
        tie_word_embeddings=tied,
    )
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in n or "lm_head" in n:
                p.normal_(0, 0.5)  # logits of some spread: greedy tokens without near-ties
    folder = os.path.join(HERE, f"hf_qwen2_{name}")
    hf.save_pretrained(folder, max_shard_size="20KB" if tied else "10GB")
    if tied:  # transformers 4's form of the rotary base
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(c, f, indent=1)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))
    idx = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(idx).logits
        greedy = hf.generate(idx[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected[name] = {"idx": idx, "logits": logits, "greedy": greedy}
    print(folder, sorted(os.listdir(folder)))
torch.save(expected, os.path.join(HERE, "hf_qwen2_expected.pt"))
