"""
The symmetric-memory transport of taco's collectives: inside one node, the compressed messages go
peer to peer, not through NCCL.

Every rank of a TP group maps one buffer from PyTorch's symmetric memory
(torch.distributed._symmetric_memory), so a kernel on rank r reads rank q's messages straight from
q's GPU over NVLink. The two-shot all-reduce (taco.py, steps 1-6) then becomes three kernels and
two barriers, queued by one call into the binding (its two_shot, with a named plan) on a side
stream, which the caller's stream joins at once or, with async_op, at handle.wait(). The first call
on a tensor captures the five as a CUDA graph, which later calls on it replay (one launch: the
host's cost of an eager call):

    1-2. encode my tensor into my sends (W messages, message q for rank q)
    3.   barrier                              (the all-to-all: every rank's sends are ready)
    4.   reduce_encode of every rank's message for me, in rank order, into my shard
    5.   barrier                              (the all-gather: every shard is ready)
    6.   decode every rank's shard (all W of them, mine included) into the tensor

The kernels are the ones of the torch.distributed path (they take message addresses), so the
bytes, and the results, are the same bit for bit.
"""

import functools
import os
import warnings

import torch
import torch.distributed as dist

import taco_ext

_WORKSPACES = {}


# the binding's calls on messages in the peers' symmetric memory
def decode_peers(cd, ptrs, L, out):
    return taco_ext.load().decode_peers(ptrs, out, taco_ext.params(cd, L))


def messages(ptrs):
    """The binding's form of messages at raw device addresses, built once and reused."""
    return taco_ext.load().Msgs(ptrs)


def signal_pads(ptrs):
    """The binding's form of the ranks' signal pads (a symmetric-memory handle's signal_pad_ptrs)."""
    return taco_ext.load().Pads(ptrs)


def barrier(pads, me, channel):
    """A barrier of the ranks on the current stream (taco_symm.cu: PyTorch's flags and protocol)."""
    return taco_ext.load().barrier(pads, me, channel)


def on_side(side, join, fn):
    """fn() with stream `side` (its (id, device, type)) current, after the current stream's work so
    far; join: the current stream waits for what fn queued (else later: join_stream)."""
    return taco_ext.load().on_side(side, join, fn)


def join_stream(side):
    """The current stream waits for what was queued on stream `side` so far."""
    return taco_ext.load().join_stream(side)


def shard(cd, n, W):
    """(L, S): the elements and bytes of each of the W messages of an all-reduce of n elements."""
    L = cd.padded(-(-n // W))
    return L, cd.nbytes(L)


def make_plan(cd, n, me, buf, ptrs, pads, side):
    """The binding's TwoShotPlan for rank me's all-reduce of n elements, filled by name: my buffer buf
    (a uint8 tensor of at least (W + 1) * S bytes: my sends, then my shard), every rank's buffer
    address (ptrs), the signal pads (signal_pads) and the stream (its (id, device, type)).
    Workspace makes one per size; a test makes two on one GPU, ranks in one process."""
    W = len(ptrs)
    L, S = shard(cd, n, W)
    plan = taco_ext.load().TwoShotPlan()
    plan.sends, plan.shard = buf[: W * S], buf[W * S : (W + 1) * S]
    plan.mine = messages([q + me * S for q in ptrs])  # my message in every rank's sends
    plan.every = messages([q + W * S for q in ptrs])  # every rank's shard
    plan.pads, plan.me, plan.p, plan.side = pads, me, taco_ext.params(cd, L), side
    return plan


def workspace(x, group, has_kernels, transport):
    """The symmetric-memory workspace for a collective of x, or None for the torch.distributed path.
    transport: "dist" (NCCL, gloo), "symm" (required: an error if impossible), or "auto" = symm when
    x is on a GPU, the kernels cover the codec (has_kernels), every rank of the group is on this node
    with peer access between all GPUs, and NCCL_P2P_DISABLE is not set (it stands for a host-staged
    link, and the NCCL path is the one that crosses it)."""
    if transport == "dist":
        return None
    key = ((group or dist.group.WORLD).group_name, x.device)
    if has_kernels and key in _WORKSPACES:  # decided on the first call; the checks cost microseconds
        return _WORKSPACES[key]
    why = _why_not(x, group, has_kernels)
    if why is not None:
        if transport == "symm":
            raise RuntimeError(f"taco: transport='symm' is impossible here: {why}; use transport='dist' or 'auto'")
        return None
    if key not in _WORKSPACES:
        _WORKSPACES[key] = Workspace(group, x.device)
    return _WORKSPACES[key]


def _why_not(x, group, has_kernels):
    """Why the symmetric-memory transport cannot carry this collective, or None if it can."""
    env = os.environ.get
    if not x.is_cuda:
        return "the tensor is not on a GPU"
    if not has_kernels:
        return "the codec has no fused kernel (the block codecs of 256 elements have)"
    if dist.get_world_size(group) > taco_ext.MAX_PEERS:
        return f"more than {taco_ext.MAX_PEERS} ranks"
    if env("LOCAL_WORLD_SIZE") is None:
        return "LOCAL_WORLD_SIZE is unset (torchrun sets it): cannot tell that the group is on one node"
    if _nodes(group or dist.group.WORLD, int(env("LOCAL_WORLD_SIZE"))) > 1:
        return "the group spans more than one node"
    if not _peer_access_everywhere():
        return "no peer access between the GPUs"
    if env("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        return "NCCL_P2P_DISABLE is set"
    return None


@functools.lru_cache(maxsize=None)
def _nodes(group, per_node):
    """How many nodes the group's ranks sit on (torchrun numbers ranks node by node); asked once
    per group, not on every collective."""
    return len({r // per_node for r in dist.get_process_group_ranks(group)})


@functools.lru_cache(maxsize=None)
def _peer_access_everywhere():
    n = torch.cuda.device_count()
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b)


class Workspace:
    """A buffer in symmetric memory, one per (group, device), mapped by every rank of the group.

    Layout: [ sends: W messages | shard: 1 message ]. Order of one call (all on this workspace's stream):
      all_reduce:         write my sends; barrier; reduce every rank's message for me into my shard;
                          barrier; decode every rank's shard
      gather_messages:    write my sends; barrier; read the peers' sends; barrier
    Why no call can overwrite what a peer still reads: every read of a rank's sends comes before a
    barrier that its owner passes before writing them again; a shard is written only after the call's
    first barrier, which a peer reaches only after it finished reading the previous shards. The barrier
    (barrier: the flags and protocol of symm_mem's own) consumes its signals (raise:
    0 -> 1 on the peer, lower: 1 -> 0 on mine), so a stale flag from an earlier call cannot
    satisfy a later one, also when a CUDA graph replays it.
    Growing the buffer is collective (every rank makes the same calls with the same sizes) and
    cannot happen inside a CUDA-graph capture: run the collective once before capturing. Old
    buffers are kept (a peer may still read them); sizes double, so that costs < 2x."""

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.group_name = (group or dist.group.WORLD).group_name
        self.W, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.stream = torch.cuda.Stream(device)
        self.side = (self.stream.stream_id, self.stream.device_index, self.stream.device_type)  # for the binding
        self.buf = None  # this rank's symmetric buffer (reserve)
        self.hdl = None  # its rendezvous handle: the peers' buffers and signal pads
        self.ptrs = []  # the peers' buffers' addresses
        self.pads = None  # the peers' signal pads, as the binding takes them (signal_pads)
        self.retired = []  # outgrown buffers, kept: a peer may still read them
        self.plans = {}  # (numel, codec) -> its TwoShotPlan (make_plan), made once per buffer

    def reserve(self, nbytes):
        if self.buf is not None and self.buf.numel() >= nbytes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "taco: the symmetric-memory buffer must grow, which cannot be captured in a "
                "CUDA graph: run the collective once with the same sizes before capturing"
            )
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # peer loads/stores only
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():  # needed by older torch, a deprecated no-op in newer
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        size = max(nbytes, 2 * (0 if self.buf is None else self.buf.numel()), 1 << 20)
        if self.buf is not None:
            self.retired.append((self.buf, self.hdl))
        self.plans = {}
        self.buf = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        self.hdl = symm_mem.rendezvous(self.buf, self.group_name)
        self.ptrs = [int(p) for p in self.hdl.buffer_ptrs]
        self.pads = signal_pads([int(p) for p in self.hdl.signal_pad_ptrs])

    @torch.compiler.disable  # streams and raw addresses: run eagerly, also inside torch.compile
    def run(self, fn, async_op, then=None):
        """fn() on this workspace's stream, ordered after the caller's stream (the binding's on_side,
        the one way onto it); the caller's stream waits for it now, or at handle.wait() (async_op:
        other work meanwhile, e.g. the weight-gradient matmuls), and then runs then()."""
        on_side(self.side, not async_op, fn)
        return self._joined(async_op, then)

    def _joined(self, async_op, then):
        """After work queued on this workspace's stream (joined already unless async_op): then()
        now, or a handle whose wait() joins the stream, then runs then()."""
        if not async_op:
            if then is not None:
                then()
            return None

        def done():
            join_stream(self.side)
            if then is not None:
                then()

        return taco_ext.Pending(done)

    @torch.compiler.disable  # raw addresses and a callback: run eagerly, also inside torch.compile
    def all_reduce(self, x, cd, stats, async_op):
        """taco.all_reduce of x over this workspace: steps 1-6 in one call into the binding (encode,
        barrier, reduce, barrier, decode) on this workspace's stream, joined now, or with async_op at
        handle.wait(); for the codec `none` PyTorch's own two-shot. A non-contiguous x is reduced in a
        contiguous copy, written back at the end. Returns x, or with async_op a handle."""
        flat = x.contiguous().view(-1)
        then = None if flat.data_ptr() == x.data_ptr() else (lambda: x.copy_(flat.view_as(x)))
        if cd.name == "none":
            handle = self.uncompressed(flat, stats, async_op, then)
        else:
            plan = self.plans.get((flat.numel(), cd)) or self._plan(flat.numel(), cd)
            if stats is not None:
                stats.add(2 * (self.W - 1) * plan.p.S, 2 * (self.W - 1) * flat.numel() * flat.element_size() / self.W)
            taco_ext.load().two_shot(flat, plan, replay=True, join=not async_op)
            handle = self._joined(async_op, then)
        return handle if async_op else x

    def _plan(self, n, cd):
        """make_plan for n elements, once per (n, codec) (the buffer grows only before a plan is
        made, and growing drops the plans)."""
        self.reserve((self.W + 1) * shard(cd, n, self.W)[1])
        plan = self.plans[(n, cd)] = make_plan(cd, n, self.me, self.buf, self.ptrs, self.pads, self.side)
        return plan

    def uncompressed(self, flat, stats, async_op, then=None):
        """Uncompressed: PyTorch's own symmetric-memory two-shot all-reduce, the fastest
        uncompressed one inside a node and so a baseline to beat. Its input must live in symmetric
        memory: flat is copied in, and the sum is written back to flat (one extra copy of the
        tensor, which the compressed path avoids: its encode kernel reads flat and writes my sends)."""
        n, esize = flat.numel(), flat.element_size()
        npad = -(-n // (16 // esize)) * (16 // esize)  # the op wants 16-byte multiples: zero padding
        nbytes = npad * esize
        self.reserve(nbytes)
        op = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None)

        def fn():
            buf = self.buf[:nbytes].view(flat.dtype)
            buf[:n].copy_(flat)
            if npad > n:
                buf[n:].zero_()
            if op is not None and npad == n:
                op(buf, "sum", self.group_name, flat)
            else:  # in place, then copy back
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
                flat.copy_(buf[:n])

        if stats is not None:
            logical = 2 * (self.W - 1) * nbytes / self.W
            stats.add(logical, logical)
        return self.run(fn, async_op, then)

    def gather_messages(self, cd, x, M, L, msg):
        """Encode x as M messages into my sends, then decode message `msg` of every rank's sends
        (rank order) into a (W, L) fp32 tensor (reduce_scatter: msg = my rank; all_gather: M = 1)."""
        S = cd.nbytes(L)
        self.reserve(M * S)
        out = torch.empty(self.W, L, dtype=torch.float32, device=self.device)

        def fn():
            taco_ext.load().encode(x.contiguous(), M, taco_ext.params(cd, L), self.buf[: M * S])
            barrier(self.pads, self.me, 0)
            decode_peers(cd, [p + msg * S for p in self.ptrs], L, out.view(-1))
            barrier(self.pads, self.me, 1)  # nobody rewrites its sends before all have read them

        self.run(fn, async_op=False)
        return out, S
