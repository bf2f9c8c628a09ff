"""
What ends a run early. Ctrl-C (SIGINT) or SIGTERM: `Stop` notes it, the ranks agree on it at the
next step where the host reads the loss anyway, every rank saves a last consistent checkpoint set,
and the job ends; a second Ctrl-C ends it at once.

When a rank stops answering. A collective that waits longer than --timeout seconds raises (gloo:
"Timed out ...", NCCL: DistBackendError); train.main then asks `stalled_exit` for the message the
job ends with: the ranks that did not answer are named, and those on this host stopped, so that the
whole job ends within timeout + STALL_WAIT s (and the processes' exit) instead of hanging
(docs/RELIABILITY.md).

When a script ends without destroying its process groups (a user's script of taco's collectives): the gloo
groups those used meet at exit before the groups are destroyed, so that no rank aborts (meet_at_exit).
"""

import atexit
import datetime
import os
import signal
import socket
import time

import torch
import torch.distributed as dist

STALL_WAIT = 2.0  # seconds the ranks still running wait for the others to check in


class Stop:
    """SIGINT/SIGTERM handlers for the training loop. torchrun passes the signal it gets on to every
    worker, and a terminal's Ctrl-C reaches them as well: a repeat within a second is that same
    Ctrl-C; a second one later ends the process at once."""

    def __init__(self, master):
        self.master, self.signum, self.at = master, 0, 0.0
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        if self.signum and signum == signal.SIGINT and time.time() > self.at + 1.0:
            os._exit(128 + signum)
        if not self.signum:
            self.signum, self.at = signum, time.time()
            if self.master:
                print(
                    f"\n{signal.Signals(signum).name}: saving a checkpoint set after this step, then stopping "
                    f"(Ctrl-C again: stop at once, without it)",
                    flush=True,
                )

    def agreed(self, grid, device):
        """The signal any rank got (0: none), the same on every rank: one small all-reduce."""
        flag = torch.tensor([self.signum], device=device)
        if grid.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)


def timed_out(e):
    """Whether exception e is a collective's timeout (or NCCL's abort after one)."""
    return "timed out" in str(e).lower() or isinstance(e, dist.DistBackendError)


def stop_stalled(grid, wait=STALL_WAIT):
    """After a collective timed out: the ranks that do not answer, stopped. Every rank still
    running checks in through the process group's store; a rank still missing after `wait` seconds
    is stalled, and one on this host is killed now (torchrun would wait 30 s for a stopped process
    to end itself), so the job ends within timeout + wait. Returns the stalled ranks and which of
    them were stopped."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"nanotaco/alive/{grid.rank}", "1")
        deadline, missing = time.time() + wait, []
        while time.time() < deadline:
            missing = [r for r in range(grid.world) if not store.check([f"nanotaco/alive/{r}"])]
            if not missing:
                break
            time.sleep(0.1)
    except Exception:  # no store to ask (it went down with its host): name nobody
        return [], []
    stopped = [r for r in missing if grid.procs[r][0] == socket.gethostname()]
    for r in stopped:
        try:
            os.kill(grid.procs[r][1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    return missing, stopped


def stalled_exit(grid, timeout, e):
    """The SystemExit message after collective error e: who stalled, and who was stopped. No meeting at this
    process's exit (meet_at_exit): a peer that stalled would hold it."""
    _EXIT_GROUPS.clear()
    stalled, stopped = stop_stalled(grid)
    names = lambda ranks: ", ".join(map(str, ranks)) or "none"
    who = (
        "another rank died"
        if not stalled
        else f"rank {names(stalled)} did not answer"
        + (" and was stopped" if stopped == stalled else f" (stopped on this host: {names(stopped)})")
    )
    return (
        f"rank {grid.rank}: a collective did not complete within timeout={timeout} s: {who} ({str(e).splitlines()[0]})"
    )


# -----------------------------------------------------------------------------
# a script's exit: the gloo groups taco's collectives used meet before the interpreter ends

_EXIT_GROUPS = set()


def meet_at_exit(group):
    """Note a group a collective used (taco's, any codec): at exit, a gloo group's ranks meet and the process
    groups are destroyed (_meet_and_destroy), for a script that ends without destroy_process_group."""
    if group in _EXIT_GROUPS or dist.get_backend(group) != "gloo":
        return
    _EXIT_GROUPS.add(group)
    atexit.unregister(_meet_and_destroy)  # registered once
    atexit.register(_meet_and_destroy)


def _meet_and_destroy():
    """At interpreter exit, for a script that did not destroy its process groups: every gloo group that taco's
    collectives used (any codec) meets at a barrier, then its ranks meet once more in the job's store, then the
    process groups are destroyed. A gloo rank that leaves while a peer still exchanges bytes with it (a
    collective's, or the barrier's own last message) tears down gloo's transport under that work ("terminate
    called without an active exception", SIGABRT); so does a job whose groups are torn down by the interpreter's
    exit rather than destroyed (torch's own all_reduce included). The store's meeting (its own connection, not
    gloo's) makes sure that no rank closes a gloo connection before every rank has received the barrier's last
    message. The groups in one order on every rank (no crossed waits); each wait gives up after 60 s (a peer
    that died or is still busy: then the exit is as it was without this hook)."""
    if not dist.is_initialized():
        return
    wait = datetime.timedelta(seconds=60)
    groups = {}
    for g in _EXIT_GROUPS:
        try:
            groups[tuple(dist.get_process_group_ranks(g))] = g
        except (ValueError, RuntimeError):
            pass  # a group of a process group destroyed since
    store = dist.distributed_c10d._get_default_store()
    try:
        for ranks in sorted(groups):
            dist.monitored_barrier(groups[ranks], timeout=wait)
        for ranks in sorted(groups):  # the group's ranks meet in the store: the last to come lets all go
            if store.add(f"taco_exit_{ranks}", 1) == len(ranks):
                store.set(f"taco_exit_{ranks}_all", "1")
            store.wait([f"taco_exit_{ranks}_all"], wait)
    except RuntimeError:
        return  # a peer is gone: nothing left to wait for
    dist.destroy_process_group()
