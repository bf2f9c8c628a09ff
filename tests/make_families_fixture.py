"""Write the fixtures of the Llama, Qwen3 and Mistral families: tiny random Hugging Face folders and what
transformers computes from them. Needs `transformers` and `tokenizers` (a one-off; the tests do not):

    python tests/make_families_fixture.py

tests/fixtures/hf_llama_tied/     LlamaForCausalLM: grouped-query attention (4 query heads, 2 key/value
                                  heads), a tied head, llama3 rotary scaling whose original context (32)
                                  is below the test's 40 tokens (every wavelength band is used), config.json
                                  as transformers 5 writes it (rope_parameters)
tests/fixtures/hf_llama_untied/   the same family untied, sharded weights, config.json in transformers 4's
                                  form (rope_theta and rope_scaling)
tests/fixtures/hf_qwen3/          Qwen3ForCausalLM: an explicit head size (16, not 32/4), q/k-norm, GQA, tied
tests/fixtures/hf_mistral/        MistralForCausalLM without a sliding window, untied
tests/fixtures/hf_smollm2/        a Llama with a tokenizer of its own (tokenizer.json, a byte-level BPE of 300
                                  ids trained here on a few sentences), as SmolLM2 folders carry one
tests/fixtures/hf_families_expected.pt   per folder: an input, its logits, 8 greedy tokens after a prompt
Hugging Face initialises norm weights to 1: they are randomised here (q/k-norm's too)."""

import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SHAPE = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
FOLDERS = {
    "llama_tied": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_parameters=LLAMA3, tie_word_embeddings=True)),
    "llama_untied": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_parameters=LLAMA3, tie_word_embeddings=False)),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **SHAPE,
            head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None, tie_word_embeddings=False)),
    "smollm2": (LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=True)),
}


def tokenizer_files(folder):
    """A byte-level BPE of 300 ids (specials first, as SmolLM2's), trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["First Citizen: Before we proceed any further, hear me speak.", "All: Speak, speak.",
            "You are all resolved rather to die than to famish? 1234567 + 89 = 90"] * 20  # fmt: skip
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
           "model_max_length": 64}  # fmt: skip
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


expected = {}
for name, (cls, cfg) in FOLDERS.items():
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in n or "lm_head" in n:
                p.normal_(0, 0.5)  # logits of some spread: greedy tokens without near-ties
    folder = os.path.join(HERE, f"hf_{name}")
    hf.save_pretrained(folder, max_shard_size="20KB" if name == "llama_untied" else "10GB")
    if name == "llama_untied":  # transformers 4's form of the rotary settings
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        rope = c.pop("rope_parameters")
        c["rope_theta"] = rope.pop("rope_theta")
        c["rope_scaling"] = rope
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(c, f, indent=1)
    if os.path.exists(os.path.join(folder, "generation_config.json")):
        os.remove(os.path.join(folder, "generation_config.json"))
    if name == "smollm2":
        tokenizer_files(folder)
    idx = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(idx).logits
        greedy = hf.generate(idx[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected[name] = {"idx": idx, "logits": logits, "greedy": greedy}
    print(folder, sorted(os.listdir(folder)))
torch.save(expected, os.path.join(HERE, "hf_families_expected.pt"))
