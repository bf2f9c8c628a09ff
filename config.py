"""
The settings of a run: one dataclass, Settings, whose fields are every setting's name, type, default
and the comment on its line; `python train.py --help`, the type checks and the did-you-mean refusal of
an unknown name all come from it. A config file is plain Python assignments to those names (as
nanoGPT's); --key=value overrides it. parse() gives a Settings; check() refuses, before any process
group or model exists, whatever cannot work, with the fix; start() does both and claims out_dir.
"""

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import time
import traceback
import types
import typing
from dataclasses import dataclass

import torch

import checkpoint
import hf
import parallel
import taco
import taco_ext
from data.loader import check_tokens, read_meta
from model import FAMILIES, PART_VALUES, PARTS, RECOMPUTE, ROPE_SCALINGS, GPTConfig


@dataclass
class Settings:
    # run and data (the defaults are the CPU demo: a tiny GPT-2 on ~1 MB of Shakespeare)
    out_dir: str = "out"  # log.jsonl and checkpoint sets (ckpt/iter_N/) go here
    overwrite: bool = False  # start a new run in an out_dir that holds another run's checkpoints
    dataset: str = "small"  # <data_dir>/<dataset>/{train,val}.bin (python data/prepare.py small)
    data_dir: str = ""  # "" = this repository's data/ folder, wherever you run from
    init_from: str = ""  # a Hugging Face folder (config.json and weights): the model's family, shape and weights
    tokenizer: str = ""  # the data's tokenizer: "" = the family's (gpt2 | qwen2 | llama3 | a folder's)
    # model: a family chooses the parts (model.FAMILIES), the numbers below give the shape
    family: str = "gpt2"  # gpt2 | qwen2 | llama (Llama 3, SmolLM2) | qwen3 | mistral
    vocab_size: int = 50257  # rows of the token embedding: GPT-2's tokenizer 50257, Qwen2's 151936
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads (a multiple of tp)
    n_kv_head: int = 0  # key/value heads, dividing n_head and a multiple of tp (0: n_head)
    n_embd: int = 128  # model width C
    head_dim: int = 0  # the size of a head (0: n_embd / n_head)
    intermediate_size: int = 0  # the MLP's width (0: 4 * n_embd); SwiGLU: each of gate and up
    rope_theta: float = 10000.0  # rotary positions: the base
    rope_scaling: str = ""  # rotary positions: "" or llama3 (Llama 3.1/3.2's long-context frequencies)
    rope_factor: float = 8.0  # llama3 scaling: long wavelengths' frequencies divided by this
    rope_low_freq: float = 1.0  # llama3 scaling: low_freq_factor
    rope_high_freq: float = 4.0  # llama3 scaling: high_freq_factor
    rope_original_positions: int = 8192  # llama3 scaling: original_max_position_embeddings
    max_positions: int = 0  # rotary: the model's context, exported as max_position_embeddings (0: block_size)
    norm_eps: float = 1e-5  # epsilon of the norms
    tie_embeddings: bool = True  # the LM head's weight is the token embedding's (untied: a weight of its own)
    block_size: int = 64  # context length T in tokens
    dropout: float = 0.0  # in [0, 1)
    loss_chunk: int = 4096  # tokens per chunk of the fused LM head and loss (0: all at once)
    recompute: str = ""  # "" | "pointwise" (norms, activation) | "mlp" (fc too) | "block": redone in the backward
    norm: str | None = None  # a part (None: the family's): layernorm | rmsnorm
    positions: str | None = None  # a part: learned | rotary
    mlp: str | None = None  # a part: gelu | swiglu
    qkv_bias: bool | None = None  # a part: a bias on the q, k and v projections
    linear_bias: bool | None = None  # a part: a bias on the attention's output projection and the MLP's linears
    norm_bias: bool | None = None  # a part: LayerNorm's additive bias
    qk_norm: bool | None = None  # a part: RMSNorm over each query and key head (Qwen3)
    # batch: tokens per step = batch_size * block_size * gradient_accumulation_steps * dp
    batch_size: int = 16  # sequences per micro-batch per DP rank
    gradient_accumulation_steps: int = 1  # with pp > 1: the pipeline's micro-batches
    # optimizer: AdamW, linear warmup then cosine decay to min_lr
    learning_rate: float = 2e-3  # peak learning rate
    min_lr: float = 2e-4  # learning rate at the end of the decay
    max_iters: int = 300  # optimizer steps of the whole run
    warmup_iters: int = 30  # steps of linear warmup
    lr_decay_iters: int = 300  # step where the cosine decay reaches min_lr
    weight_decay: float = 0.1  # AdamW weight decay (2-D weights only)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    # evaluation, logging, checkpoints
    eval_interval: int = 100  # evaluate train/val loss every N steps and at the end (0: never)
    eval_iters: int = 10  # micro-batches per evaluation (a multiple of dp)
    log_interval: int = 10  # one log line (mean loss, ms, tok/s, wire bytes) every N steps
    ckpt_interval: int = 0  # 0: at every evaluation, the end and on SIGINT/SIGTERM; N: every N steps; -1: never
    resume: bool = False  # continue from out_dir's newest complete checkpoint set (of out_dir's own run)
    resume_from: str = ""  # with resume: this set's folder instead (also another run's: it goes on as that run)
    progress: bool = True  # tqdm bar on rank 0 (only when the output is a terminal)
    tensorboard: bool = False  # also write log.jsonl's records as TensorBoard events into out_dir
    sample_tokens: int = 120  # sample this many tokens at the end (0: none)
    sample_prompt: str = "\n"  # the text the sample starts from
    # parallelism: world = tp * pp * dp (dp is derived)
    tp: int = 1  # tensor-parallel ranks (inside one node)
    pp: int = 1  # pipeline stages (n_layer divisible by pp)
    schedule: str = "1f1b"  # pipeline schedule: 1f1b | gpipe
    sequence_parallel: bool = False  # shard norm/residual regions along the sequence over the TP group
    pp_verbose: bool = False  # print every pipeline send/receive (for learning how a schedule runs)
    # tensor-parallel compression (taco.py): codec for forward activations / backward gradients
    tp_codec: str = "none"  # codec of the forward TP all-reduces: none | hint8 | taco | hint6 | ... | auto
    tp_codec_bwd: str = ""  # "" = same as tp_codec (auto: decided per direction, timed at start: tp_auto.py)
    tp_codec_embed: str = ""  # the embedding's forward all-reduce ("" = tp_codec's forward codec; none: exact)
    tp_codec_attn: str = ""  # the attention blocks' all-reduces, where their direction compresses ("": its codec)
    tp_codec_mlp: str = ""  # the MLP blocks' all-reduces, likewise
    tp_auto_bits: int = 8  # the codecs auto may choose: 8 (hint8) or 6 (hint8, hint6)
    codec_block: int = 256  # elements per codec block (a power of two; the kernels: 256)
    dp_codec: str = "none"  # data-parallel gradient all-reduce codec (SDP4Bit-style: hint8 | hint4)
    dp_overlap: bool = True  # start each DP gradient bucket's all-reduce during the backward pass (False: after it)
    zero1: bool = False  # ZeRO stage 1 over DP: AdamW state (fp32 master + moments) sharded, 1/dp per rank
    zero_codec: str = "none"  # with zero1: the parameter all-gather sends weight differences in this codec (hint4)
    pp_codec: str = "none"  # activations between pipeline stages (TAH-Quant-style: tahquant, see lab/tahquant.py)
    pp_codec_bwd: str = ""  # gradients between stages ("" = same as pp_codec; TAH-Quant: higher precision, hint8)
    tp_transport: str = "auto"  # auto: symmetric memory inside a node (GPU peers), else NCCL/gloo | dist | symm
    taco_chunks: int = 1  # split each compressed all-reduce into pipelined chunks
    taco_min_bytes: int = 8388608  # smaller TP all-reduces stay uncompressed (the codec's fixed costs dominate)
    # system
    seed: int = 1337  # weights, data order and dropout
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    compile: bool = False  # torch.compile the model
    timeout: int = 600  # seconds a collective may wait for a stalled rank before the job stops
    profile_steps: int = 0  # > 0: the CUDA kernel timeline of the last N steps -> out_dir/trace_rank<r>.json.gz
    peak_flops: float = 989e12  # per-GPU dense bf16 peak for MFU (H100/H200 SXM datasheet)

    def model_config(self):
        """The model's config: the fields of GPTConfig's names, the family's parts filled in."""
        return GPTConfig.from_settings(self)

    def as_dict(self):
        return dataclasses.asdict(self)

    def codecs_in_use(self, ways):
        """The codecs this run can use: those set for a group of 2+ ranks (ways: group -> its ranks), auto as the
        8-bit codec it may choose."""
        return [
            "hint8" if getattr(self, k) == "auto" else getattr(self, k)
            for group, keys in CODEC_SETTINGS.items()
            for k in keys
            if getattr(self, k) and ways[group] > 1
        ]


# the settings that name a codec, by the group whose traffic it compresses
CODEC_SETTINGS = {
    "tp": ("tp_codec", "tp_codec_bwd", "tp_codec_embed", "tp_codec_attn", "tp_codec_mlp"),
    "dp": ("dp_codec",),
    "zero": ("zero_codec",),
    "pp": ("pp_codec", "pp_codec_bwd"),
}
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
TYPES = typing.get_type_hints(Settings)


class ConfigError(ValueError):
    """A configuration that cannot work; raised before any work starts, names the fix."""


WAIT_FOR_RANK0 = 60.0  # seconds another local rank waits, after a refusal, for torchrun to stop it


def refuse(message):
    """End every rank of a launch whose settings were refused before it started: local rank 0 says
    why, once per node, also in torchrun's failure summary (its error file). The checks read only the
    command line and this node, so every rank of a node refuses alike: the others wait for torchrun to
    stop them once local rank 0 has failed (however slow its start), so that it is the failure torchrun
    reports; one still running after WAIT_FOR_RANK0 s (no torchrun, or local rank 0 went on) says why."""
    if not isinstance(message, str):  # an exit code
        raise SystemExit(message)
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        time.sleep(WAIT_FOR_RANK0)
    print(message, file=sys.stderr, flush=True)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun, whose own report follows: say what it is
        print(
            "(the line above is the whole story: nothing started. torchrun's report follows, a traceback of its own "
            "with this line as its root cause and the other ranks stopped; fix the setting and launch again)",
            file=sys.stderr,
            flush=True,
        )
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
    raise SystemExit(1)


CHOICES = {
    "family": tuple(FAMILIES),
    **PART_VALUES,
    "rope_scaling": ROPE_SCALINGS,
    "recompute": RECOMPUTE,
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16"),
    "schedule": parallel.SCHEDULES,
    "tp_transport": taco.TRANSPORTS,
}
AT_LEAST = {
    1: "vocab_size n_layer n_head n_embd block_size batch_size gradient_accumulation_steps max_iters log_interval "
    "tp pp taco_chunks timeout".split(),
    0: "n_kv_head head_dim intermediate_size max_positions loss_chunk eval_interval eval_iters warmup_iters lr_decay_iters "
    "sample_tokens profile_steps taco_min_bytes seed learning_rate min_lr weight_decay grad_clip peak_flops".split(),
    -1: ["ckpt_interval"],
}
BELOW_ONE = ("dropout", "beta1", "beta2")  # in [0, 1)
BOOLS = {"True": True, "False": False, "true": True, "false": False, "1": True, "0": False}
RENAMED = {"arch": "family", "bias": "qkv_bias, linear_bias and norm_bias"}  # settings of earlier versions


def options():
    """(section, key, default as written, comment) of every setting, from Settings' source: what --help prints."""
    out, section = [], ""
    for line in inspect.getsource(Settings).splitlines()[1:]:
        m = re.match(r"\s+(\w+): [\w |]+ = (.+?)(?:\s+#\s*(.*))?$", line)
        if m:
            out.append((section, m[1], m[2], m[3] or ""))
        elif line.strip().startswith("# "):
            section = line.strip()[2:]
        elif line.strip().startswith("def "):
            break
    return out


def help_text():
    lines = [
        "usage: [torchrun --nproc_per_node=N] train.py [config.py ...] [--key=value ...]",
        "",
        "A config file is plain Python assignments to the settings below; --key=value (or --key value)",
        "overrides them, type-checked against the setting's type. Settings:",
    ]
    section = None
    for sec, key, default, comment in options():
        if sec != section:
            lines += ["", f"# {sec}"]
            section = sec
        lines.append(f"  --{key}={default}".ljust(40) + (f"  {comment}" if comment else ""))
    return "\n".join(lines)


def known(key, where):
    if key not in FIELDS:
        near = difflib.get_close_matches(key, list(FIELDS), n=1)
        hint = f"; did you mean {near[0]}?" if near else "; python train.py --help lists them"
        hint = f"; it is now {RENAMED[key]}" if key in RENAMED else hint
        raise ConfigError(f"{where}: unknown setting {key!r}{hint}")


def typed(key, value, where):
    """value as the setting's type (an int where a float is expected becomes a float)."""
    want = TYPES[key]
    allowed = typing.get_args(want) if isinstance(want, types.UnionType) else (want,)
    if float in allowed and type(value) is int:
        value = float(value)
    if float in allowed and isinstance(value, str) and value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise ConfigError(f"{where}: a finite number is needed (the default is {FIELDS[key].default!r})")
    if type(value) not in allowed:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
        raise ConfigError(
            f"{where}: expected {names} (the default is {FIELDS[key].default!r}), got {type(value).__name__} {value!r}"
        )
    return value


def read_file(path):
    """{key: value} of a config file; an unknown name, a wrong type or an error names file and line."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} not found (settings are given as --key=value)")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is a directory, not a config file (one of configs/*.py, or --key=value)")
    with open(path) as f:
        src = f.read()
    ns = {}
    try:
        exec(compile(src, path, "exec"), ns)
    except SyntaxError as e:
        raise ConfigError(f"{path}:{e.lineno}: {e.msg}") from None
    except Exception as e:
        line = next((fr.lineno for fr in reversed(traceback.extract_tb(e.__traceback__)) if fr.filename == path), "?")
        raise ConfigError(f"{path}:{line}: {type(e).__name__}: {e}") from None
    out = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            targets = []
        for t in targets:
            if isinstance(t, ast.Name) and not t.id.startswith("_"):
                known(t.id, f"{path}:{node.lineno}")
                out[t.id] = typed(t.id, ns[t.id], f"{path}:{node.lineno}")
    return out


def start(argv):
    """The resolved, checked settings (parse, check), and out_dir claimed (checkpoint.claim); a refusal
    ends every rank before launch, said once per node without a traceback (refuse)."""
    try:
        cfg = parse(argv)
        check(cfg, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
        checkpoint.claim(cfg.out_dir, cfg.resume, cfg.overwrite, int(os.environ.get("RANK", "0")) == 0)
    except (ConfigError, SystemExit) as e:
        refuse(e.code if isinstance(e, SystemExit) else f"config error: {e}")
    return cfg


def parse(argv, **overrides):
    """The resolved Settings: the defaults, then config files and --key=value overrides in order, then
    `overrides` (for tests and the lab). Its attribute `given` holds the names set by a file or a flag."""
    given, i = dict(overrides), 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):
            given.update(read_file(arg))
            continue
        key, eq, val = arg[2:].partition("=")
        known(key, f"--{key}")
        is_bool = bool in typing.get_args(TYPES[key]) or TYPES[key] is bool
        if not eq:  # --flag (a bool), or --key value
            if is_bool and not (i < len(argv) and argv[i] in BOOLS):
                val = "True"
            elif i < len(argv):
                val, i = argv[i], i + 1
            else:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
        if is_bool and val in BOOLS:
            v = BOOLS[val]
        else:
            try:
                v = ast.literal_eval(val)
            except (ValueError, SyntaxError):
                v = val  # a bare word is a string
        given[key] = typed(key, v, f"--{key}={val}")
    cfg = Settings(**given)
    cfg.given = set(given)
    return cfg


def check_values(cfg):
    """Every setting inside its valid range."""
    for key, choices in CHOICES.items():
        value = getattr(cfg, key)
        if value not in choices and not (value is None and key in PARTS):
            extra = " (float16 would need loss scaling; bfloat16 has fp32's range)" if value == "float16" else ""
            said = ", ".join("''" if c == "" else str(c) for c in choices)  # the empty choice shown, not skipped
            raise ConfigError(f"{key}={value!r}: choose one of {said}{extra}")
    for low, keys in AT_LEAST.items():
        for k in keys:
            if getattr(cfg, k) < low:
                raise ConfigError(f"{k}={getattr(cfg, k)} must be >= {low}")
    for k in BELOW_ONE:
        if not 0 <= getattr(cfg, k) < 1:
            raise ConfigError(f"{k}={getattr(cfg, k)} must be in [0, 1)")
    for k, t in TYPES.items():  # a config file can give float("nan"), which no range above refuses
        if float in (typing.get_args(t) or (t,)) and isinstance(getattr(cfg, k), float):
            if not math.isfinite(getattr(cfg, k)):
                raise ConfigError(f"{k}={getattr(cfg, k)}: a finite number is needed")
    if cfg.eval_interval and cfg.eval_iters < 1:
        raise ConfigError(
            "eval_iters=0 with eval_interval > 0: set eval_iters >= 1, or eval_interval=0 for no evaluation"
        )
    b = cfg.codec_block
    if b < 32 or b > 1024 or b & (b - 1):
        raise ConfigError(f"codec_block={b} must be a power of two in [32, 1024]")
    if cfg.tp_auto_bits not in (8, 6):
        raise ConfigError(f"tp_auto_bits={cfg.tp_auto_bits}: 8 (auto may choose hint8) or 6 (also hint6)")
    for k in (k for keys in CODEC_SETTINGS.values() for k in keys):
        check_codec(cfg, k)


def check_codec(cfg, k):
    value = getattr(cfg, k)
    if k in ("tp_codec", "tp_codec_bwd") and value == "auto":
        return
    optional = k.endswith(("_bwd", "_embed", "_attn", "_mlp"))  # "": the codec they default to
    if value not in ("", *taco.codec_names()) or (value == "" and not optional):
        raise ConfigError(
            f"{k}={value!r} is not a codec; choose from {', '.join(taco.codec_names())} "
            f"(the lab's tahquant: launch with -m lab.tahquant instead of train.py)"
        )


def check_model(mc, tp=1):
    """Refuse a model that cannot be built, or not split over tp ranks, naming the fix (training and
    sample.py ask the same)."""
    if mc.n_head % tp:
        raise ConfigError(
            f"n_head={mc.n_head} is not divisible by tp={tp}: each TP rank must own whole "
            f"attention heads; pick tp from the divisors of n_head"
        )
    if mc.n_head % mc.n_kv_head:
        raise ConfigError(
            f"n_head={mc.n_head} is not a multiple of n_kv_head={mc.n_kv_head}: each key/value head "
            f"serves the same number of query heads; pick n_kv_head from the divisors of n_head"
        )
    if mc.n_kv_head % tp:
        raise ConfigError(
            f"n_kv_head={mc.n_kv_head} is not divisible by tp={tp}: each TP rank must own whole "
            f"key/value heads (and the query heads that read them); pick tp from the divisors of n_kv_head"
        )
    if mc.n_embd % tp:
        raise ConfigError(f"n_embd={mc.n_embd} is not divisible by tp={tp}")
    derived = mc.head_dim == mc.n_embd // mc.n_head  # not an explicit head size (Qwen3's may be any)
    if derived and mc.n_embd % mc.n_head:
        raise ConfigError(
            f"n_embd={mc.n_embd} is not divisible by n_head={mc.n_head}: set head_dim for heads of another size"
        )
    if mc.intermediate_size % tp:
        raise ConfigError(
            f"intermediate_size={mc.intermediate_size} is not divisible by tp={tp}: each TP rank owns an equal "
            f"slice of the MLP; pick tp from its divisors"
        )
    if mc.padded_vocab % tp:
        raise ConfigError(
            f"the padded vocabulary ({mc.padded_vocab}) is not divisible by tp={tp}; "
            f"use a power-of-two tp (the vocabulary is padded to a multiple of 128)"
        )
    scaled = ("rope_factor", "rope_low_freq", "rope_high_freq", "rope_original_positions")
    for k in ("norm_eps", "rope_theta") + (scaled if mc.rope_scaling == "llama3" else ()):
        if not getattr(mc, k) > 0:  # 0 gives NaN logits, a negative one other positions than the model's
            raise ConfigError(f"{k}={getattr(mc, k)} must be > 0")
    if mc.rope_scaling == "llama3" and not mc.rope_high_freq > mc.rope_low_freq:
        raise ConfigError(
            f"rope_high_freq={mc.rope_high_freq} must be > rope_low_freq={mc.rope_low_freq} (Llama 3's scaling "
            f"blends the wavelengths between original / high_freq and original / low_freq)"
        )
    if mc.positions == "rotary" and mc.head_dim % 2:
        what = "n_embd/n_head" if derived else "head_dim"
        raise ConfigError(
            f"rotary positions rotate pairs of dimensions: the head size {what} = {mc.head_dim} must be even"
        )


def check_layout(tp, pp, world, dp=None, mc=None, schedule="1f1b"):
    """Refuse layouts that cannot work, with a message naming the fix (dp: derived when None); mc, a
    GPTConfig, is checked against tp and pp too. Returns dp. Pure function (testable)."""
    for name, v in (("tp", tp), ("pp", pp)) + ((("dp", dp),) if dp is not None else ()):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if world % (tp * pp) or (dp is not None and tp * pp * dp != world):
        raise ConfigError(
            f"the world size {world} is not tp*pp*dp (tp={tp}, pp={pp}, dp={dp or 'derived'}): "
            f"launch a multiple of tp*pp = {tp * pp} processes (torchrun --nproc_per_node=N) "
            f"or change tp/pp"
        )
    if mc is not None and mc.n_layer % pp:
        raise ConfigError(
            f"n_layer={mc.n_layer} is not divisible by pp={pp}: every pipeline stage gets the "
            f"same number of blocks; pick pp from the divisors of n_layer"
        )
    if mc is not None:
        check_model(mc, tp)
    if schedule not in parallel.SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}: choose {' or '.join(parallel.SCHEDULES)}")
    return world // (tp * pp)


def check(cfg, world, local_world=None):
    """Everything that can be refused before launch: values, layout, devices, data files."""
    missing = taco_ext.gpu_missing(build=False) if cfg.device == "cuda" else None  # before any CUDA call
    if missing:
        raise ConfigError(f"device='cuda': {missing}; or use --device=cpu")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard=True needs the tensorboard package: pip install tensorboard")
    if cfg.init_from:
        take_init_from(cfg)
    check_values(cfg)
    mc = cfg.model_config()
    dp = check_layout(cfg.tp, cfg.pp, world, None, mc, cfg.schedule)
    if cfg.resume_from and not (cfg.resume and os.path.isfile(os.path.join(cfg.resume_from, "COMPLETE"))):
        raise ConfigError(
            f"resume_from={cfg.resume_from!r} needs --resume and a complete checkpoint set "
            f"(a folder ckpt/iter_N holding COMPLETE)"
        )
    check_memory(cfg, mc, local_world or world, dp)
    local_world = local_world or world
    if local_world % cfg.tp:
        raise ConfigError(
            f"tp={cfg.tp} does not divide the {local_world} processes of a node (LOCAL_WORLD_SIZE): "
            f"a TP group must sit inside one node (it all-reduces every layer); use tp <= "
            f"{local_world} dividing it, and pp/dp across nodes"
        )
    if cfg.eval_interval and cfg.eval_iters % dp:
        raise ConfigError(
            f"eval_iters={cfg.eval_iters} is not divisible by dp={dp}: every DP rank "
            f"evaluates the same number of batches; use a multiple of {dp}"
        )
    if cfg.sequence_parallel and cfg.block_size % cfg.tp:
        raise ConfigError(f"sequence_parallel needs block_size ({cfg.block_size}) divisible by tp={cfg.tp}")
    if cfg.zero1 and dp == 1:
        raise ConfigError(
            f"zero1 shards the optimizer over data parallelism, but dp=1: launch "
            f"{2 * cfg.tp * cfg.pp} processes (dp=2) or set zero1=False"
        )
    if cfg.zero_codec not in ("", "none") and not cfg.zero1:
        raise ConfigError("zero_codec compresses ZeRO-1's parameter all-gather: set zero1=True too")
    if cfg.tp_transport == "symm" and (cfg.device == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("tp_transport='symm' needs GPUs (symmetric memory): use auto or dist")
    if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        raise ConfigError(f"out_dir={cfg.out_dir!r} is a file, not a folder: choose another --out_dir")
    cfg.tokenizer = model_tokenizer(cfg)  # resolved: the run records the one it read
    try:
        check_family_reads_the_data(cfg, read_meta(data_dir(cfg)))
        for split in ("train", "val"):
            check_tokens(data_dir(cfg), split, cfg.block_size, mc.vocab_size)
        check_data_tokenizer(cfg, read_meta(data_dir(cfg)))
    except ValueError as e:
        raise ConfigError(f"{e} (to write it: {prepare_hint(cfg)})") from None
    return dp


def check_family_reads_the_data(cfg, meta):
    """Data of a known tokenizer that is not the model's, where no --tokenizer or --init_from says otherwise: one
    refusal naming every setting a model that reads it needs together (family, vocab_size; the tokenizer follows
    from the family), or the data to prepare for this model. (Separately, the ids past the vocabulary and then
    the tokenizer were refused one at a time, and neither named the family.)"""
    from data.tokenizer import NAMES, get_encoding

    theirs = meta.get("tokenizer")
    if theirs not in NAMES or theirs == cfg.tokenizer or "tokenizer" in getattr(cfg, "given", ()) or cfg.init_from:
        return
    families = [name for name, family in FAMILIES.items() if family.tokenizer == theirs]
    n_vocab = get_encoding(theirs).n_vocab
    raise ConfigError(
        f"{data_dir(cfg)} holds {theirs} tokens (ids up to {n_vocab - 1:,}), which a {cfg.family} model with "
        f"{cfg.tokenizer}'s tokenizer does not read: train a model that reads them with --family={families[0]} "
        f"--vocab_size={n_vocab} (or --init_from=<a {' or '.join(families)} folder>), or prepare data for this "
        f"model: {prepare_hint(cfg)}"
    )


def model_tokenizer(cfg):
    """The tokenizer the model reads: --tokenizer, else the --init_from folder's own (tokenizer.json),
    else the family's."""
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.init_from and os.path.isfile(os.path.join(cfg.init_from, "tokenizer.json")):
        return cfg.init_from
    if not FAMILIES[cfg.family].tokenizer:
        raise ConfigError(
            f"the {cfg.family} family has no tokenizer here: --tokenizer=<a folder holding tokenizer.json>, or "
            f"--init_from such a folder"
        )
    return FAMILIES[cfg.family].tokenizer


def check_data_tokenizer(cfg, meta):
    """The data's tokenizer (meta.json) must be the model's, else it trains on ids that mean other
    words: refused naming both, unless --tokenizer names the data's on purpose."""
    from data.tokenizer import identity

    theirs = meta.get("tokenizer_id") or meta.get("tokenizer")
    if theirs is None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"note: {data_dir(cfg)} has no meta.json: its ids are read as uint16 and their tokenizer is not checked"
            )
        return
    if theirs != identity(cfg.tokenizer):
        raise ConfigError(
            f"{data_dir(cfg)} holds {meta.get('tokenizer')} tokens, but this {cfg.family} model reads "
            f"{cfg.tokenizer}'s: prepare the data for it ({prepare_hint(cfg)}), or pass "
            f"--tokenizer={meta.get('tokenizer')} to train this model on those ids on purpose"
        )


def prepare_hint(cfg):
    """The data/prepare.py command that writes the dataset the settings name. A built-in corpus for another
    tokenizer than GPT-2's gets a name of its own (small_llama3), with the --dataset that reads it, so that
    following the hint never replaces the GPT-2 dataset the CPU demo reads."""
    corpus, _, _ = cfg.dataset.partition("_")
    tok = "" if cfg.tokenizer == "gpt2" else f" --tokenizer={cfg.tokenizer}"
    if cfg.dataset in ("small", "large") and tok:
        own = f"{cfg.dataset}_{os.path.basename(cfg.tokenizer.rstrip('/'))}"
        return f"python data/prepare.py {own} --corpus={cfg.dataset}{tok}, and train with --dataset={own}"
    if cfg.dataset in ("small", "large"):
        return f"python data/prepare.py {cfg.dataset}"
    if corpus in ("small", "large"):
        return f"python data/prepare.py {cfg.dataset} --corpus={corpus}{tok}"
    return f"python data/prepare.py {cfg.dataset} --files <your text>{tok}"


def check_memory(cfg, mc, ranks_here, dp=1):
    """Refuse a run that cannot fit, before anything is allocated, by a lower bound of what one rank
    holds at once: its share of the fp32 weights and their gradients (8 bytes a parameter over tp x pp)
    and of AdamW's two moments (8 more, also over dp with zero1), the residual stream each of its layers
    keeps for the backward (fp32, a micro-batch's tokens x n_embd, over tp under sequence parallelism)
    and one chunk of the fused loss (the chunk's fp32 logits and softmax over vocabulary/tp columns)."""
    tokens, n = cfg.batch_size * cfg.block_size, mc.num_params(False) // (cfg.tp * cfg.pp)
    parts = {
        "weights and gradients": n * 8,
        "AdamW's moments": n * 8 // (dp if cfg.zero1 else 1),
        "the residual stream": tokens * mc.n_embd * 4 * (mc.n_layer // cfg.pp) // (cfg.tp if cfg.sequence_parallel else 1),
        "a loss chunk": min(mc.loss_chunk or tokens, tokens) * mc.padded_vocab // cfg.tp * 8,
    }  # fmt: skip
    need, (have, where) = sum(parts.values()), memory_here(cfg, ranks_here)
    if have is not None and need > have:
        said = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in parts.items())
        raise ConfigError(
            f"each rank needs at least {need / 2**30:.1f} GiB ({said}), more than the {have / 2**30:.1f} GiB "
            f"of {where}: more --tp / --pp, a lower --batch_size or --block_size (gradient_accumulation_steps "
            f"keeps the tokens per step), or a smaller --loss_chunk"
        )


def memory_here(cfg, ranks_here):
    """(bytes, where) a rank may use: a GPU's memory, else its share of the RAM available on this host
    ((None, "") where that cannot be read)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.cuda.get_device_properties(0).total_memory, "a GPU's memory"
    try:  # MemAvailable, in kB, shared by this host's ranks
        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")) // ranks_here
    except (OSError, StopIteration):  # not Linux: nothing to compare with
        return None, ""
    return have, f"the RAM available to each of {ranks_here} rank(s) here"


def take_init_from(cfg):
    """--init_from: the model's family, shape and parts are the folder's (config.json): set here, where a
    setting given explicitly (a flag or a config file) must agree, else refused naming both values. The
    training context block_size stays the settings' (at most the folder's); dropout too."""
    folder = cfg.init_from
    try:
        mc = hf.model_config(folder)
    except (ValueError, OSError) as e:
        raise ConfigError(f"--init_from={folder}: {e}") from None
    keep = ("block_size", "dropout", "loss_chunk", "recompute")
    wrong = []
    for f in dataclasses.fields(GPTConfig):
        theirs, given = getattr(mc, f.name), f.name in getattr(cfg, "given", ()) and f.name not in keep
        if given and getattr(cfg, f.name) is not None and getattr(cfg, f.name) != theirs:
            wrong.append(f"{f.name}={getattr(cfg, f.name)!r} (the folder's: {theirs!r})")
        elif f.name not in keep:
            setattr(cfg, f.name, theirs)
    if wrong:
        raise ConfigError(
            f"--init_from={folder} holds a {mc.family} model that these settings contradict: {', '.join(wrong)}; "
            f"drop those settings (the folder's config.json gives the model)"
        )
    if cfg.block_size > mc.max_positions:
        raise ConfigError(
            f"block_size={cfg.block_size} is more than the {mc.max_positions} positions of --init_from={folder}"
        )


def data_dir(cfg):
    """The dataset's folder: <data_dir>/<dataset>, data_dir defaulting to this repository's data/."""
    return os.path.join(cfg.data_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"), cfg.dataset)
