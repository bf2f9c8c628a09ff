"""
Text out of a model (generation, also across TP ranks and pipeline stages) and GPT-2 weights into
it (a Hugging Face GPT2LMHeadModel state dict, sliced for this rank). train.py prints a sample with
print_sample() at the end of a run.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import GPT, ColumnParallelLinear


def full_logits(model, idx, grid=None):
    """Last-position logits over the whole vocabulary (gathered over TP): for sampling only.
    With pipeline stages every stage calls it: the context runs through the stages in turn
    (blocking send/recv to the neighbours, grid's convention); non-last stages return None."""
    if model.stages == 1:
        logits, _ = model(idx)
    else:
        h = None
        if not model.first:
            h = torch.empty(*idx.shape, model.config.n_embd, device=idx.device)
            dist.recv(h, grid.rank - grid.tp)
        logits, _ = model(idx if model.first else None, None, h)
        if not model.last:
            dist.send(logits.float().contiguous(), grid.rank + grid.tp)
            return None
    logits = logits[:, -1, :].float().contiguous()                                # (B, V/tp)
    if model.comm.size > 1:
        parts = [torch.empty_like(logits) for _ in range(model.comm.size)]
        dist.all_gather(parts, logits, group=model.comm.group)
        logits = torch.cat(parts, dim=-1)
    return logits[:, :model.config.vocab_size]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, grid=None):
    """Sample tokens. Under TP every rank must call this with the same idx and an identically
    seeded generator (all ranks take part in every forward and must draw the same token).
    With pipeline stages (pass the grid) every stage calls it; the last stage draws the token
    and broadcasts it to the other stages of its pipeline."""
    assert not model.comm.sp, "sampling with sequence parallelism is not implemented"
    for _ in range(max_new_tokens):
        ctx = idx[:, -model.config.block_size:]
        logits = full_logits(model, ctx, grid)
        nxt = torch.empty(idx.shape[0], 1, dtype=idx.dtype, device=idx.device)
        if model.last:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
                logits[logits < v[:, [-1]]] = float("-inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1).cpu(), 1, generator=generator).to(idx.device)
        if model.stages > 1:
            dist.broadcast(nxt, src=grid.last_stage_rank, group=grid.pp_group)
        idx = torch.cat((idx, nxt), dim=1)
    return idx


def print_sample(model, prompt, tokens, grid, seed, autocast):
    """Every rank of the model generates (all take part in each forward); rank 0 prints the text."""
    if model.comm.sp:
        if grid.rank == 0:
            print("(no sample: generation is not implemented with sequence parallelism)")
        return
    from data.tokenizer import get_encoding
    enc, dev = get_encoding(), next(model.parameters()).device
    model.eval()
    idx = torch.tensor([enc.encode_ordinary(prompt)], device=dev)
    gen = torch.Generator().manual_seed(seed)                 # identical on every TP rank
    with autocast:
        out = generate(model, idx, tokens, temperature=0.8, top_k=100, generator=gen, grid=grid)
    if grid.rank == 0:
        print("sample:\n" + enc.decode(out[0].tolist()))


def from_hf_state_dict(sd, config, comm=None):
    """A GPT loaded from a Hugging Face `GPT2LMHeadModel` state dict (its Conv1D weights are stored
    (in, out): transposed here), sliced for this rank. config must match the checkpoint's shapes."""
    model = GPT(config, comm)
    c = config
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    missing = [k for k in ("wte.weight", "wpe.weight", "ln_f.weight") if k not in sd]
    if missing or sd["wte.weight"].shape != (c.vocab_size, c.n_embd):
        raise ValueError(f"state dict does not match {c}: missing {missing} or wte shape "
                         f"{tuple(sd.get('wte.weight', torch.empty(0)).shape)}")
    wte = torch.zeros(c.padded_vocab, c.n_embd)
    wte[:c.vocab_size] = sd["wte.weight"]

    def put(mod, name, full, split=True):
        getattr(mod, name).data.copy_(mod.shard(full) if split and hasattr(mod, "shard") else full)

    with torch.no_grad():
        put(model.wte, "weight", wte)
        put(model.wpe, "weight", sd["wpe.weight"])
        put(model.ln_f, "weight", sd["ln_f.weight"])
        if c.bias:
            put(model.ln_f, "bias", sd["ln_f.bias"])
        for i, b in enumerate(model.h):
            p = f"h.{i}."
            for ln in ("ln_1", "ln_2"):
                put(getattr(b, ln), "weight", sd[p + ln + ".weight"])
                if c.bias:
                    put(getattr(b, ln), "bias", sd[p + ln + ".bias"])
            for mod, hf in ((b.attn.qkv, "attn.c_attn"), (b.attn.proj, "attn.c_proj"),
                            (b.mlp.fc, "mlp.c_fc"), (b.mlp.proj, "mlp.c_proj")):
                put(mod, "weight", sd[p + hf + ".weight"].t())          # Conv1D (in, out) -> (out, in)
                if c.bias:
                    put(mod, "bias", sd[p + hf + ".bias"], split=isinstance(mod, ColumnParallelLinear))
    return model
