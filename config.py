"""
The settings of a run. train.py's defaults block is the one source of truth: every setting's name,
its default (hence its type) and the comment on its line, which `python train.py --help` prints.
This module reads config files (plain Python assignments) and --key=value overrides into a dict,
and refuses, before any process group or model exists, whatever cannot work, with the fix.
"""

import ast
import difflib
import json
import os
import re
import sys
import time
import traceback

import torch

import checkpoint
import parallel
import taco
from data.loader import check_tokens, read_meta
from model import ARCHS, GPTConfig


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
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
                    }
                },
                f,
            )
    raise SystemExit(1)


CHOICES = {
    "arch": ARCHS,
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16"),
    "schedule": parallel.SCHEDULES,
    "tp_transport": taco.TRANSPORTS,
}
AT_LEAST = {
    1: (
        "vocab_size",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "batch_size",
        "gradient_accumulation_steps",
        "max_iters",
        "log_interval",
        "tp",
        "pp",
        "taco_chunks",
        "timeout",
    ),
    0: (
        "n_kv_head",
        "intermediate_size",
        "eval_interval",
        "eval_iters",
        "warmup_iters",
        "lr_decay_iters",
        "sample_tokens",
        "profile_steps",
        "taco_min_bytes",
        "seed",
        "learning_rate",
        "min_lr",
        "weight_decay",
        "grad_clip",
        "peak_flops",
    ),
    -1: ("ckpt_interval",),
}
BELOW_ONE = ("dropout", "beta1", "beta2")  # in [0, 1)
BOOLS = {"True": True, "False": False, "true": True, "false": False, "1": True, "0": False}


def options(source):
    """(section, key, default as written, comment) of every setting in the block between the two
    `# ----` lines of `source` (train.py): what --help prints."""
    out, section, inside = [], "", False
    with open(source) as f:
        for line in f:
            if line.startswith("# ----"):
                if inside:
                    break
                inside = True
            elif inside:
                m = re.match(r"(\w+) = (.+?)(?:\s+#\s*(.*))?$", line.rstrip())
                if m:
                    out.append((section, m[1], m[2], m[3] or ""))
                elif line.startswith("# "):
                    section = line[2:].strip()
    return out


def help_text(source):
    lines = [
        "usage: [torchrun --nproc_per_node=N] train.py [config.py ...] [--key=value ...]",
        "",
        "A config file is plain Python assignments to the settings below; --key=value (or --key value)",
        "overrides them, type-checked against the default. Settings:",
    ]
    section = None
    for sec, key, default, comment in options(source):
        if sec != section:
            lines += ["", f"# {sec}"]
            section = sec
        lines.append(f"  --{key}={default}".ljust(40) + (f"  {comment}" if comment else ""))
    return "\n".join(lines)


def known(key, defaults, where):
    if key not in defaults:
        near = difflib.get_close_matches(key, list(defaults), n=1)
        hint = f"; did you mean {near[0]}?" if near else "; python train.py --help lists them"
        raise ConfigError(f"{where}: unknown setting {key!r}{hint}")


def typed(key, value, defaults, where):
    """value with the default's type (an int where a float is expected becomes a float)."""
    want = type(defaults[key])
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        raise ConfigError(
            f"{where}: expected {want.__name__} (the default is {defaults[key]!r}), "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def read_file(path, defaults):
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
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        for t in targets:
            if isinstance(t, ast.Name) and not t.id.startswith("_"):
                known(t.id, defaults, f"{path}:{node.lineno}")
                out[t.id] = typed(t.id, ns[t.id], defaults, f"{path}:{node.lineno}")
    return out


def start(defaults, argv):
    """The resolved, checked settings (parse, check), and out_dir claimed (checkpoint.claim); a refusal
    ends every rank before launch, said once per node without a traceback (refuse)."""
    try:
        c = parse(defaults, argv)
        check(c, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
        checkpoint.claim(c["out_dir"], c["resume"], c["overwrite"], int(os.environ.get("RANK", "0")) == 0)
    except (ConfigError, SystemExit) as e:
        refuse(e.code if isinstance(e, SystemExit) else f"config error: {e}")
    return c


def parse(defaults, argv):
    """The resolved settings: defaults, then config files and --key=value overrides in order."""
    cfg, i = dict(defaults), 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):
            cfg.update(read_file(arg, defaults))
            continue
        key, eq, val = arg[2:].partition("=")
        known(key, defaults, f"--{key}")
        if not eq:  # --flag (a bool), or --key value
            if isinstance(defaults[key], bool) and not (i < len(argv) and argv[i] in BOOLS):
                val = "True"
            elif i < len(argv):
                val, i = argv[i], i + 1
            else:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
        if isinstance(defaults[key], bool) and val in BOOLS:
            v = BOOLS[val]
        else:
            try:
                v = ast.literal_eval(val)
            except (ValueError, SyntaxError):
                v = val  # a bare word is a string
        cfg[key] = typed(key, v, defaults, f"--{key}={val}")
    return cfg


def check_values(cfg):
    """Every setting inside its valid range."""
    for key, choices in CHOICES.items():
        if cfg[key] not in choices:
            extra = " (float16 would need loss scaling; bfloat16 has fp32's range)" if cfg[key] == "float16" else ""
            raise ConfigError(f"{key}={cfg[key]!r}: choose one of {', '.join(choices)}{extra}")
    for low, keys in AT_LEAST.items():
        for k in keys:
            if cfg[k] < low:
                raise ConfigError(f"{k}={cfg[k]} must be >= {low}")
    for k in BELOW_ONE:
        if not 0 <= cfg[k] < 1:
            raise ConfigError(f"{k}={cfg[k]} must be in [0, 1)")
    for k in ("rope_theta", "norm_eps"):
        if not cfg[k] > 0:
            raise ConfigError(f"{k}={cfg[k]} must be > 0")
    if cfg["eval_interval"] and cfg["eval_iters"] < 1:
        raise ConfigError(
            "eval_iters=0 with eval_interval > 0: set eval_iters >= 1, or eval_interval=0 for no evaluation"
        )
    b = cfg["codec_block"]
    if b < 32 or b > 1024 or b & (b - 1):
        raise ConfigError(f"codec_block={b} must be a power of two in [32, 1024]")
    if cfg["tp_auto_bits"] not in (8, 6):
        raise ConfigError(f"tp_auto_bits={cfg['tp_auto_bits']}: 8 (auto may choose hint8) or 6 (also hint6)")
    for k in (
        "tp_codec",
        "tp_codec_bwd",
        "tp_codec_embed",
        "tp_codec_attn",
        "tp_codec_mlp",
        "dp_codec",
        "pp_codec",
        "pp_codec_bwd",
        "zero_codec",
    ):
        if k in ("tp_codec", "tp_codec_bwd") and cfg[k] == "auto":
            continue
        optional = k.endswith(("_bwd", "_embed", "_attn", "_mlp"))  # "": the codec they default to
        if cfg[k] not in ("", *taco.codec_names()) or (cfg[k] == "" and not optional):
            raise ConfigError(
                f"{k}={cfg[k]!r} is not a codec; choose from {', '.join(taco.codec_names())} "
                f"(the lab's tahquant: launch with -m lab.tahquant instead of train.py)"
            )


def check_layout(
    tp, pp, world, dp=None, n_head=None, n_embd=None, vocab_size=None, n_layer=None, schedule="1f1b", n_kv_head=None
):
    """Refuse layouts that cannot work, with a message naming the fix (dp: derived when None).
    Returns dp. Pure function (testable)."""
    for name, v in (("tp", tp), ("pp", pp)) + ((("dp", dp),) if dp is not None else ()):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if world % (tp * pp) or (dp is not None and tp * pp * dp != world):
        raise ConfigError(
            f"the world size {world} is not tp*pp*dp (tp={tp}, pp={pp}, dp={dp or 'derived'}): "
            f"launch a multiple of tp*pp = {tp * pp} processes (torchrun --nproc_per_node=N) "
            f"or change tp/pp"
        )
    if n_layer is not None and n_layer % pp:
        raise ConfigError(
            f"n_layer={n_layer} is not divisible by pp={pp}: every pipeline stage gets the "
            f"same number of blocks; pick pp from the divisors of n_layer"
        )
    if n_head is not None and n_head % tp:
        raise ConfigError(
            f"n_head={n_head} is not divisible by tp={tp}: each TP rank must own whole "
            f"attention heads; pick tp from the divisors of n_head"
        )
    if n_kv_head and n_head is not None and n_head % n_kv_head:
        raise ConfigError(
            f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}: each key/value head "
            f"serves the same number of query heads; pick n_kv_head from the divisors of n_head"
        )
    if n_kv_head and n_kv_head % tp:
        raise ConfigError(
            f"n_kv_head={n_kv_head} is not divisible by tp={tp}: each TP rank must own whole "
            f"key/value heads (and the query heads that read them); pick tp from the divisors of "
            f"n_kv_head"
        )
    if n_embd is not None and n_embd % tp:
        raise ConfigError(f"n_embd={n_embd} is not divisible by tp={tp}")
    if n_embd is not None and n_head is not None and n_embd % n_head:
        raise ConfigError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    if vocab_size is not None and vocab_size % tp:
        raise ConfigError(
            f"the padded vocabulary ({vocab_size}) is not divisible by tp={tp}; "
            f"use a power-of-two tp (the vocabulary is padded to a multiple of 128)"
        )
    if schedule not in parallel.SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}: choose {' or '.join(parallel.SCHEDULES)}")
    return world // (tp * pp)


def check(cfg, world, local_world=None):
    """Everything that can be refused before launch: values, layout, devices, data files."""
    check_values(cfg)
    mc = GPTConfig.from_settings(cfg)
    dp = check_layout(
        cfg["tp"],
        cfg["pp"],
        world,
        None,
        mc.n_head,
        mc.n_embd,
        mc.padded_vocab,
        mc.n_layer,
        cfg["schedule"],
        mc.n_kv_head,
    )
    if mc.arch == "qwen2" and (mc.n_embd // mc.n_head) % 2:
        raise ConfigError(
            f"rotary positions rotate pairs of dimensions: the head size n_embd/n_head = "
            f"{mc.n_embd // mc.n_head} must be even"
        )
    if cfg["init_from"]:
        check_init_from(cfg["init_from"], mc)
    if cfg["resume_from"] and not (cfg["resume"] and os.path.isfile(os.path.join(cfg["resume_from"], "COMPLETE"))):
        raise ConfigError(
            f"resume_from={cfg['resume_from']!r} needs --resume and a complete checkpoint set "
            f"(a folder ckpt/iter_N holding COMPLETE)"
        )
    check_memory(cfg, mc, local_world or world)
    local_world = local_world or world
    if local_world % cfg["tp"]:
        raise ConfigError(
            f"tp={cfg['tp']} does not divide the {local_world} processes of a node (LOCAL_WORLD_SIZE): "
            f"a TP group must sit inside one node (it all-reduces every layer); use tp <= "
            f"{local_world} dividing it, and pp/dp across nodes"
        )
    if cfg["eval_interval"] and cfg["eval_iters"] % dp:
        raise ConfigError(
            f"eval_iters={cfg['eval_iters']} is not divisible by dp={dp}: every DP rank "
            f"evaluates the same number of batches; use a multiple of {dp}"
        )
    if cfg["sequence_parallel"] and cfg["block_size"] % cfg["tp"]:
        raise ConfigError(f"sequence_parallel needs block_size ({cfg['block_size']}) divisible by tp={cfg['tp']}")
    if cfg["zero1"] and dp == 1:
        raise ConfigError(
            f"zero1 shards the optimizer over data parallelism, but dp=1: launch "
            f"{2 * cfg['tp'] * cfg['pp']} processes (dp=2) or set zero1=False"
        )
    if cfg["zero_codec"] not in ("", "none") and not cfg["zero1"]:
        raise ConfigError("zero_codec compresses ZeRO-1's parameter all-gather: set zero1=True too")
    if cfg["tp_transport"] == "symm" and (cfg["device"] == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("tp_transport='symm' needs GPUs (symmetric memory): use auto or dist")
    if os.path.exists(cfg["out_dir"]) and not os.path.isdir(cfg["out_dir"]):
        raise ConfigError(f"out_dir={cfg['out_dir']!r} is a file, not a folder: choose another --out_dir")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no GPU is visible; use --device=cpu")
    for split in ("train", "val"):
        path = os.path.join(data_dir(cfg), f"{split}.bin")
        try:
            check_tokens(path, cfg["block_size"], mc.vocab_size, read_meta(data_dir(cfg))["dtype"])
        except ValueError as e:
            raise ConfigError(f"{e} (python data/prepare.py {cfg['dataset']} writes it)") from None
    return dp


def check_memory(cfg, mc, ranks_here):
    """Refuse a micro-batch whose logits alone cannot fit, before anything is allocated: the loss holds
    (batch_size, block_size, vocabulary/tp) fp32 values twice (the logits and their softmax)."""
    need = cfg["batch_size"] * cfg["block_size"] * mc.padded_vocab // cfg["tp"] * 8
    if cfg["device"] == "cuda" or (cfg["device"] == "auto" and torch.cuda.is_available()):
        have, where = torch.cuda.get_device_properties(0).total_memory, "a GPU's memory"
    else:
        try:  # MemAvailable, in kB, shared by this host's ranks
            with open("/proc/meminfo") as f:
                have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")) // ranks_here
        except (OSError, StopIteration):  # not Linux: nothing to compare with
            return
        where = f"the RAM available to each of {ranks_here} rank(s) here"
    if need > have:
        raise ConfigError(
            f"one micro-batch's logits alone need {need / 2**30:.1f} GiB (batch_size={cfg['batch_size']} "
            f"x block_size={cfg['block_size']} x {mc.padded_vocab // cfg['tp']} vocabulary columns x 8 "
            f"bytes), more than the {have / 2**30:.1f} GiB of {where}: lower --batch_size or "
            f"--block_size (gradient_accumulation_steps keeps the tokens per step)"
        )


def check_init_from(folder, mc):
    """The Hugging Face folder's model must be the one the settings describe: else the flags to pass."""
    import checkpoint

    try:
        hf = checkpoint.hf_model_config(folder)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"--init_from={folder}: {type(e).__name__ + ': ' if isinstance(e, KeyError) else ''}{e}")
    keys = (
        "arch",
        "vocab_size",
        "n_layer",
        "n_head",
        "n_kv_head",
        "n_embd",
        "intermediate_size",
        "rope_theta",
        "norm_eps",
        "tie_embeddings",
        "bias",
    )
    wrong = [f"--{k}={getattr(hf, k)}" for k in keys if getattr(hf, k) != getattr(mc, k)]
    if wrong:
        raise ConfigError(
            f"--init_from={folder} holds a {hf.arch} model these settings do not describe: pass {' '.join(wrong)}"
        )
    if mc.block_size > hf.block_size:
        raise ConfigError(
            f"block_size={mc.block_size} is more than the {hf.block_size} positions of --init_from={folder}"
        )


def data_dir(cfg):
    """The dataset's folder: <data_dir>/<dataset>, data_dir defaulting to this repository's data/."""
    return os.path.join(
        cfg["data_dir"] or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"), cfg["dataset"]
    )
