"""
Hugging Face folders in and out. A folder's config.json becomes a GPTConfig and its weights (one
model.safetensors, shards listed by model.safetensors.index.json, or pytorch_model.bin; memory-mapped,
read one tensor at a time) our full-model tensors; a model goes back out as a folder that the same
transformers class loads to the same logits.

Everything family-specific is one LAYOUTS entry per Hugging Face model_type: our family, the class, the
weights' names, config.json's keys and defaults. A folder whose model the family's parts cannot build
(another activation, sliding-window attention, a rotary scaling other than llama3, biases the family
lacks) is refused naming what; so is a model the class cannot hold.
"""

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass

import torch

from model import FAMILIES, PARTS, GPTConfig


@dataclass(frozen=True)
class Layout:
    family: str  # ours (model.FAMILIES)
    architecture: str  # the transformers class that loads the folder
    block: str  # the prefix of block i's weights
    names: dict  # our full name (in a block: after "h.<i>.") -> the Hugging Face names it is made of, in order
    keys: dict  # GPTConfig field -> its config.json key
    defaults: dict  # GPTConfig fields a config.json may leave out: transformers' defaults
    extra: dict  # config.json's other keys, as an export writes them
    activation: tuple  # config.json's key of the MLP's activation, and the values the family's MLP is
    transposed: tuple = ()  # names stored (in, out): GPT-2's Conv1D weights


GPT2_NAMES = {
    "wte.weight": ["transformer.wte.weight"],
    "wpe.weight": ["transformer.wpe.weight"],
    "ln_f.weight": ["transformer.ln_f.weight"],
    "ln_f.bias": ["transformer.ln_f.bias"],
    **{
        f"{ours}.{p}": [f"{theirs}.{p}"]
        for ours, theirs in [("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn.qkv", "attn.c_attn")]
        + [("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]
        for p in ("weight", "bias")
    },
}
LLAMA_NAMES = {  # Llama's layout, which Qwen2, Qwen3 and Mistral share
    "wte.weight": ["model.embed_tokens.weight"],
    "ln_f.weight": ["model.norm.weight"],
    "lm_head.weight": ["lm_head.weight"],
    "ln_1.weight": ["input_layernorm.weight"],
    "ln_2.weight": ["post_attention_layernorm.weight"],
    "attn.qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "attn.q_norm.weight": ["self_attn.q_norm.weight"],
    "attn.k_norm.weight": ["self_attn.k_norm.weight"],
    "attn.proj.weight": ["self_attn.o_proj.weight"],
    "mlp.fc.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.proj.weight": ["mlp.down_proj.weight"],
}
GPT2_KEYS = {
    "vocab_size": "vocab_size",
    "n_embd": "n_embd",
    "n_layer": "n_layer",
    "n_head": "n_head",
    "intermediate_size": "n_inner",
    "max_positions": "n_positions",
    "norm_eps": "layer_norm_epsilon",
    "tie_embeddings": "tie_word_embeddings",
}
LLAMA_KEYS = {
    "vocab_size": "vocab_size",
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_kv_head": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "max_positions": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
ROTARY = {"n_kv_head": 0, "head_dim": 0, "norm_eps": 1e-6, "tie_embeddings": False}  # transformers' defaults
SILU = {"hidden_act": "silu", "attention_dropout": 0.0}
SILU_ACTS = ("hidden_act", ("silu", "swish"))
GELU_ACTS = ("activation_function", ("gelu_new", "gelu_pytorch_tanh"))
LAYOUTS = {  # Hugging Face model_type -> its layout
    "gpt2": Layout(
        "gpt2",
        "GPT2LMHeadModel",
        "transformer.h.{}.",
        GPT2_NAMES,
        GPT2_KEYS,
        {"intermediate_size": 0, "norm_eps": 1e-5, "tie_embeddings": True, "max_positions": 1024},
        {"activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        GELU_ACTS,
        ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"),
    ),
    "qwen2": Layout(
        "qwen2",
        "Qwen2ForCausalLM",
        "model.layers.{}.",
        LLAMA_NAMES,
        LLAMA_KEYS,
        {**ROTARY, "max_positions": 32768},
        {**SILU, "use_sliding_window": False},
        SILU_ACTS,
    ),
    "llama": Layout(
        "llama",
        "LlamaForCausalLM",
        "model.layers.{}.",
        LLAMA_NAMES,
        LLAMA_KEYS,
        {**ROTARY, "max_positions": 2048},
        {**SILU, "attention_bias": False, "mlp_bias": False},
        SILU_ACTS,
    ),
    "qwen3": Layout(
        "qwen3",
        "Qwen3ForCausalLM",
        "model.layers.{}.",
        LLAMA_NAMES,
        LLAMA_KEYS,
        {**ROTARY, "max_positions": 32768},
        {**SILU, "attention_bias": False, "use_sliding_window": False},
        SILU_ACTS,
    ),
    "mistral": Layout(
        "mistral",
        "MistralForCausalLM",
        "model.layers.{}.",
        LLAMA_NAMES,
        LLAMA_KEYS,
        {**ROTARY, "max_positions": 131072},
        {**SILU, "sliding_window": None},
        SILU_ACTS,
    ),
}
LAYOUT_OF = {layout.family: layout for layout in LAYOUTS.values()}


# -----------------------------------------------------------------------------
# config.json


def model_config(folder):
    """The GPTConfig of a Hugging Face folder's config.json (block_size: the folder's context). A
    model_type without a layout, a missing key, or a model the family's parts do not build is
    refused naming why."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        with open(path) as f:
            hf = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    kind = hf.get("model_type")
    if kind not in LAYOUTS:
        raise ValueError(f"{path}: model_type {kind!r} is not supported; the families read are {', '.join(LAYOUTS)}")
    layout = LAYOUTS[kind]
    values = {}
    for ours, theirs in layout.keys.items():
        if hf.get(theirs) is not None:
            values[ours] = hf[theirs]
        elif ours in layout.defaults:
            values[ours] = layout.defaults[ours]
        else:
            raise ValueError(f"{path} has no {theirs!r} (the model's {ours}): not a complete {kind} config.json")
    unbuilt = [why for bad, why in refusals(hf, layout, values["max_positions"]) if bad]
    if unbuilt:
        raise ValueError(
            f"{path}: this {kind} model uses {'; '.join(unbuilt)}, which the {layout.family} family here does not build"
        )
    rope = rope_settings(hf, path) if FAMILIES[layout.family].positions == "rotary" else {}
    named = {**layout.keys, **{ours: f"the rotary scaling's {theirs}" for ours, theirs in ROPE_KEYS.items()}}
    for ours, value in {**values, **rope}.items():  # "2" for a number reaches no layer: refused here, named
        if not of_type(value, FIELD_TYPES[ours]):
            said = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[FIELD_TYPES[ours]]
            raise ValueError(f"{path}: {named.get(ours, ours)} is {value!r}, not {said}")
    mc = GPTConfig(family=layout.family, block_size=values["max_positions"], **values, **rope)
    if mc.tie_embeddings and separate_head(folder, mc):  # as transformers loads it: the file's head, untied
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"note: {path} says tie_word_embeddings, but the weights hold an lm_head.weight of their own, "
                f"which transformers keeps: loaded untied (an export writes tie_word_embeddings false)",
                file=sys.stderr,
            )
        mc = dataclasses.replace(mc, tie_embeddings=False)
    return mc


def separate_head(folder, mc):
    """Whether the folder's weights hold an LM head other than the token embedding (a tied config.json over
    a head of its own). Weights that cannot be read say nothing here: where they are loaded, they are named."""
    try:
        read = Weights(folder)
    except ValueError:
        return False
    if "lm_head.weight" not in read.where:
        return False
    embed, head = read(hf_names("wte.weight", mc)[0]), read("lm_head.weight")
    return head.shape != embed.shape or not torch.equal(head, embed)


FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(GPTConfig)}


def of_type(value, want):
    """Whether a config.json value can be GPTConfig's field of type want (an int for a float; a bool is no number)."""
    if isinstance(value, bool) or want is bool:
        return isinstance(value, bool) and want is bool
    return isinstance(value, want) or (want is float and isinstance(value, int))


def refusals(hf, layout, context):
    """(is it so, why it cannot be built) for what a config.json may hold beyond the family's parts."""
    key, acts = layout.activation
    act = hf.get(key, acts[0])
    window, switch = hf.get("sliding_window"), hf.get("use_sliding_window")
    sliding = bool(switch) or "sliding_attention" in (hf.get("layer_types") or [])
    short = switch is None and window is not None and window < context  # a window that no flag turns off
    return [
        (act not in acts, f"the activation {act!r}"),
        (sliding, "sliding-window attention"),
        (short, f"a sliding window of {window} tokens, shorter than its context (full attention would differ)"),
        (bool(hf.get("attention_bias")) and not FAMILIES[layout.family].qkv_bias, "biases on the attention"),
        (bool(hf.get("mlp_bias")), "biases on the MLP"),
    ]


ROPE_KEYS = {  # GPTConfig field -> the key of a llama3 rope scaling
    "rope_factor": "factor",
    "rope_low_freq": "low_freq_factor",
    "rope_high_freq": "high_freq_factor",
    "rope_original_positions": "original_max_position_embeddings",
}


def rope_settings(hf, path):
    """The rotary base and scaling from config.json, as transformers reads them: `rope_parameters`
    (5.x: base and scaling in one) or `rope_theta` with `rope_scaling` (4.x); where a file carries both and
    they disagree, refused naming the conflict. Scalings other than llama3 are refused."""
    new, old = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    kind = lambda r: r.get("rope_type", r.get("type", "default"))
    if new and old and kind(new) != kind(old):
        raise ValueError(
            f"{path}: rope_parameters says {kind(new)!r} and rope_scaling says {kind(old)!r}; transformers "
            f"would apply one of them: make them agree"
        )
    if new.get("rope_theta") and hf.get("rope_theta") and new["rope_theta"] != hf["rope_theta"]:
        raise ValueError(
            f"{path}: rope_parameters and rope_theta give two rotary bases ({new['rope_theta']}, {hf['rope_theta']})"
        )
    scaling = new if kind(new) != "default" else old
    out = {"rope_theta": float(new.get("rope_theta") or hf.get("rope_theta") or 10000.0)}
    if kind(scaling) == "default":
        return out
    if kind(scaling) != "llama3":
        raise ValueError(f"{path}: rotary scaling {kind(scaling)!r} is not built here (default and llama3 are)")
    missing = [k for k in ROPE_KEYS.values() if k not in scaling]
    if missing:
        raise ValueError(f"{path}: the llama3 rotary scaling lacks {', '.join(missing)}")
    return {**out, "rope_scaling": "llama3", **{ours: scaling[theirs] for ours, theirs in ROPE_KEYS.items()}}


def config_json(mc):
    """config.json for a full model: what its family's transformers class reads. A model whose parts
    that class cannot hold is refused naming the part."""
    layout = LAYOUT_OF.get(mc.family)
    if layout is None:
        raise ValueError(f"family {mc.family!r} has no Hugging Face layout here")
    family = FAMILIES[mc.family]
    differ = [f"{p}={getattr(mc, p)}" for p in PARTS if getattr(mc, p) != getattr(family, p)]
    if "n_kv_head" not in layout.keys and mc.n_kv_head != mc.n_head:
        differ.append(f"n_kv_head={mc.n_kv_head} (grouped-query attention)")
    if differ:
        raise ValueError(f"{layout.architecture} cannot hold this model: it has {', '.join(differ)}")
    out = {"architectures": [layout.architecture], "model_type": MODEL_TYPE[mc.family]}
    out.update({theirs: getattr(mc, ours) for ours, theirs in layout.keys.items()})
    out.update(layout.extra)
    if mc.positions == "rotary":
        rope = {"rope_type": mc.rope_scaling or "default", "rope_theta": mc.rope_theta}
        if mc.rope_scaling:
            rope.update({theirs: getattr(mc, ours) for ours, theirs in ROPE_KEYS.items()})
        out.update(rope_theta=mc.rope_theta, rope_parameters=rope)
        if mc.rope_scaling:  # transformers 4.x reads this one
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {**out, "torch_dtype": "float32"}


MODEL_TYPE = {layout.family: kind for kind, layout in LAYOUTS.items()}


# -----------------------------------------------------------------------------
# weights


class Weights:
    """A folder's tensors by Hugging Face name, read when asked (memory-mapped: a 7B model is never
    whole in memory). GPT-2 names lacking "transformer." get it. A damaged file is named in one line."""

    def __init__(self, folder):
        from safetensors import SafetensorError, safe_open

        index, single, pt = (
            os.path.join(folder, n) for n in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")
        )
        self.where = {}
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        elif os.path.isfile(pt):
            sd = torch.load(pt, map_location="cpu", weights_only=True, mmap=True)
            self.where = {self.prefixed(k): (sd, k) for k in sd}
            files = []
        else:
            raise ValueError(f"{folder} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing (model.safetensors.index.json lists it)")
            try:
                h = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{path} is not a readable safetensors file ({e}): download it again") from None
            self.where.update({self.prefixed(k): (h, k) for k in h.keys()})

    @staticmethod
    def prefixed(k):
        return k if k.startswith(("transformer.", "model.", "lm_head.")) else "transformer." + k

    def __call__(self, name):
        h, k = self.where[name]
        try:
            return h.get_tensor(k) if hasattr(h, "get_tensor") else h[k]
        except Exception as e:  # a truncated file: its data ends early
            raise ValueError(f"the weights' {name} cannot be read ({e}): the file is damaged") from None

    def layers(self, layout):
        """How many blocks the weights hold (the largest block index + 1)."""
        pattern = re.compile(re.escape(layout.block).replace(r"\{\}", r"(\d+)"))
        found = [int(m[1]) for m in map(pattern.match, self.where) if m]
        return max(found, default=-1) + 1


def hf_names(name, mc):
    """The Hugging Face names our full-model tensor `name` is made of."""
    layout = LAYOUT_OF[mc.family]
    if name.startswith("h."):
        i, rest = name[2:].split(".", 1)
        return [layout.block.format(i) + n for n in layout.names[rest]]
    return layout.names[name]


def from_hf(read, mc):
    """get(name): our full-model tensor `name` (fp32) made from the Hugging Face tensors read(hf_name)
    gives, one at a time: fused layers concatenated, GPT-2's Conv1D weights transposed, the vocabulary
    padded, learned positions cut to block_size. A tied head is the embedding. Weights stored as
    integers (a quantized checkpoint) are refused."""
    transposed = LAYOUT_OF[mc.family].transposed

    def get(name):
        name = "wte.weight" if name == "lm_head.weight" and mc.tie_embeddings else name
        parts = []
        for n in hf_names(name, mc):
            try:
                t = read(n)
            except KeyError:
                raise ValueError(
                    f"the weights have no {n} (for {name}): not a {mc.family} model of this shape"
                ) from None
            if not t.is_floating_point():
                raise ValueError(f"{n} is stored as {t.dtype}: quantized weights are not read here (a float folder is)")
            parts.append(t.t() if name.endswith(transposed) else t)
        t = torch.cat(parts).float()
        if name in ("wte.weight", "lm_head.weight") and t.shape[0] == mc.vocab_size:
            t = torch.cat([t, t.new_zeros(mc.padded_vocab - mc.vocab_size, t.shape[1])])
        if name == "wpe.weight" and t.shape[0] >= mc.block_size:
            t = t[: mc.block_size]
        return t.contiguous()

    return get


def to_hf(full, mc):
    """from_hf's inverse: the Hugging Face state dict of a full one (a tied head is not written)."""
    transposed = LAYOUT_OF[mc.family].transposed
    sd = {}
    for name, t in full.items():
        if name == "lm_head.weight" and mc.tie_embeddings:
            continue
        t = t[: mc.vocab_size] if name in ("wte.weight", "lm_head.weight") else t
        names = hf_names(name, mc)
        if len(names) > 1:
            parts = t.split(mc.qkv_sections if ".attn.qkv." in name else mc.fc_sections)
        else:
            parts = [t]
        for n, p in zip(names, parts):
            sd[n] = (p.t() if name.endswith(transposed) else p).contiguous()
    return sd


def check_weights(read, mc, folder):
    """The weights must hold as many blocks as config.json says (transformers would ignore extra ones)."""
    found = read.layers(LAYOUT_OF[mc.family])
    if found != mc.n_layer:
        raise ValueError(
            f"{folder}: config.json says {mc.n_layer} layers, the weights hold {found}: the config and the "
            f"weights are of different models"
        )


def load_into(model, folder):
    """--init_from: a Hugging Face folder's weights into a (sharded, staged) model, every rank reading
    its slices only; what does not fit ends the run in one line."""
    import checkpoint

    try:
        read = Weights(folder)
        check_weights(read, model.config, folder)
        checkpoint.shard_into(model, from_hf(read, model.config))
    except ValueError as e:
        raise SystemExit(f"--init_from={folder}: {e}") from None


def save(model, dest):
    """A single-process model's weights and config.json into the folder dest."""
    from safetensors.torch import save_file

    cfg = config_json(model.config)
    os.makedirs(dest, exist_ok=True)
    save_file(to_hf(model.state_dict(), model.config), os.path.join(dest, "model.safetensors"), {"format": "pt"})
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
