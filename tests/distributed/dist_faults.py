"""What each rank runs in the fault tests: failures, mismatched programs, hangs."""
from __future__ import annotations

import time

import torch

import shmap
from shmap import P


def _rank():
    import torch.distributed as dist
    return dist.get_rank()


def _mesh():
    import torch.distributed as dist
    return shmap.make_mesh((dist.get_world_size(),), ("i",))


def raise_in_body(bad_rank):
    """`bad_rank` raises inside the body; the others wait in the psum that follows."""
    def body(x):
        if _rank() == bad_rank:
            raise ValueError(f"boom on purpose on rank {bad_rank}")
        return shmap.psum(x, "i")
    f = shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P())
    f(torch.ones(8))  # a warm-up call that works on every rank would not raise: the first one does
    return "finished"


def raise_in_backward(bad_rank):
    """`bad_rank` raises in a gradient hook; the others wait in the backward psum."""
    w = torch.ones(3, requires_grad=True)

    def body(x):
        y = x * w
        if _rank() == bad_rank:
            y.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed on purpose")))
        return shmap.psum(y.sum(), "i")
    f = shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P())
    f(torch.ones(8, 3)).full_tensor().backward()
    return "finished"


def mismatches():
    """Several mismatched programs in one world (strict checks): each is reported on every rank, and the
    world goes on."""
    shmap.configure_distributed(check_collectives="strict")
    rank = _rank()
    mesh = _mesh()
    seen = []

    def expect_mismatch(name, body, in_spec=P("i"), out_spec=P("i"), x=None):
        x = torch.ones(8) if x is None else x
        try:
            shmap.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec)(x)
        except shmap.CollectiveMismatchError as e:
            seen.append((name, str(e)))
        else:
            seen.append((name, "NOT RAISED"))
        # The process groups are still usable: a correct program runs.
        ok = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(
            torch.arange(8.0))
        assert ok.full_tensor().tolist() == [12.0, 16.0], ok

    expect_mismatch("different collectives",
                    lambda v: shmap.all_gather(v, "i", tiled=True) if rank == 1 else shmap.pvary(
                        shmap.psum(v, "i"), "i"))
    expect_mismatch("collective skipped on one rank",
                    lambda v: v * 2 if rank == 3 else shmap.pvary(shmap.psum(v, "i"), "i"))
    expect_mismatch("different shapes",
                    lambda v: shmap.pvary(shmap.psum(v[:1] if rank == 0 else v, "i"), "i")[:1],
                    out_spec=P("i"))
    expect_mismatch("different permutations",
                    lambda v: shmap.ppermute(v, "i", [(0, 1), (1, 0)] if rank == 2 else [(0, 1), (1, 2)]))
    return seen


def hang(slow_rank, timeout):
    """`slow_rank` never reaches the collective; the others time out and say who is missing."""
    shmap.configure_distributed(timeout=timeout)

    def body(x):
        if _rank() == slow_rank:
            time.sleep(120)
        return shmap.psum(x, "i")
    shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P())(torch.ones(8))
    return "finished"


def skip_unchecked(skip_rank):
    """Without signature checks, a rank that skips a collective and finishes is still named."""
    shmap.configure_distributed(check_collectives=False)
    # A correct call first, so that every process group exists before rank `skip_rank` leaves.
    shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=_mesh(), in_specs=P("i"), out_specs=P())(torch.ones(8))

    def body(x):
        return x if _rank() == skip_rank else shmap.pvary(shmap.psum(x, "i"), "i")
    shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P("i"))(torch.ones(8))
    return "finished"


# -- the fault-injection suite (default checks; every rank must end non-zero, the culprit named) --------
def _x():
    import torch.distributed as dist
    return torch.ones(2 * dist.get_world_size())


def _psum_program(x=None):
    f = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=_mesh(), in_specs=P("i"), out_specs=P())
    import torch.distributed as dist
    return f(torch.ones(2 * dist.get_world_size()) if x is None else x).full_tensor().tolist()


def sigkill_in_body(bad_rank, timeout=20.0):
    """`bad_rank` is SIGKILLed inside the body: no exception, no report; its connections just close."""
    import os
    import signal

    shmap.configure_distributed(timeout=timeout)
    _mesh()

    def body(x):
        if _rank() == bad_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return shmap.psum(x, "i")
    shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P())(_x())
    return "finished"


def return_before_first(bad_rank, timeout=20.0):
    """`bad_rank` returns right after make_mesh; the others run a shard_map."""
    shmap.configure_distributed(timeout=timeout)
    _mesh()
    if _rank() == bad_rank:
        return "returned early"
    _psum_program()
    return "finished"


def return_between(bad_rank, timeout=20.0):
    """`bad_rank` returns after the first of two shard_maps."""
    shmap.configure_distributed(timeout=timeout)
    _psum_program()
    if _rank() == bad_rank:
        return "returned early"
    _psum_program()
    return "finished"


def shut_down_early(bad_rank, timeout=20.0):
    """`bad_rank` calls `shmap.shutdown_distributed()` right after make_mesh; the others run a shard_map."""
    shmap.configure_distributed(timeout=timeout)
    _mesh()
    if _rank() == bad_rank:
        shmap.shutdown_distributed()  # hears that the others failed because of it: ends with status 1
        return "shut down early"
    _psum_program()
    return "finished"


def shut_down_together():
    """Every rank runs the program, then `shmap.shutdown_distributed()`: (process group left?, a value)."""
    import torch.distributed as dist

    out = _psum_program()
    shmap.shutdown_distributed()
    return dist.is_initialized(), out


def other_collective(bad_rank, timeout=20.0):
    """`bad_rank` calls all_gather where the others call psum (default checks)."""
    shmap.configure_distributed(timeout=timeout)

    def body(v):
        if _rank() == bad_rank:
            return shmap.all_gather(v, "i", tiled=True)
        return shmap.pvary(shmap.psum(v, "i"), "i")
    shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P("i"))(_x())
    return "finished"


def other_shape_bigger(bad_rank):
    return other_shape(bad_rank, True)


def other_shape(bad_rank, bigger=False, timeout=20.0):
    """`bad_rank` psums a block of another shape, smaller or `bigger` (default checks).  gloo aborts the
    process that receives more data than it expects: the culprit, or its peers."""
    shmap.configure_distributed(timeout=timeout)

    def body(v):
        if _rank() == bad_rank:
            v = torch.cat([v, v]) if bigger else v[:1]
        return shmap.pvary(shmap.psum(v, "i"), "i")[:1]
    shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P("i"))(_x())
    return "finished"


def skipped_same_shape(bad_rank, timeout=20.0):
    """`bad_rank` skips the first of two psums of the same shape: its data would silently pair with the
    others' second one; the shard_map count in the next signature gives it away (default checks)."""
    shmap.configure_distributed(timeout=timeout)

    def body(v):
        if _rank() != bad_rank:
            v = shmap.pvary(shmap.psum(v, "i"), "i")
        return shmap.pvary(shmap.psum(v, "i"), "i")
    f = shmap.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P("i"))
    f(_x())
    f(_x())
    return "finished"


def all_collectives_pass():
    """Every collective kind, forward and backward, with the default checks (nothing is flagged)."""
    mesh = _mesh()
    ring = [(s, (s + 1) % 4) for s in range(4)]
    w = torch.ones(8, requires_grad=True)

    def body(v):
        a = shmap.all_gather(v, "i", tiled=True)
        b = shmap.psum_scatter(a, "i", tiled=True)
        c = shmap.ppermute(b, "i", ring)
        d = shmap.all_to_all(c.reshape(2, 1).expand(2, 4).reshape(8), "i", 0, 0, tiled=True)
        e = shmap.pmax(d.sum(), "i") + shmap.pmin(d.sum(), "i")
        ints = shmap.psum((v.detach() > 0).to(torch.int8), "i")
        return shmap.psum(d.sum() + e, "i") + ints.sum()
    out = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())(w)
    out.full_tensor().backward()
    return out.full_tensor().item(), w.grad.tolist()


def hang_in_psum_scatter(slow_rank, timeout):
    """As `hang`, in a psum_scatter (whose gloo wait ignores timeouts: a helper thread waits for it)."""
    shmap.configure_distributed(timeout=timeout)

    def body(x):
        if _rank() == slow_rank:
            time.sleep(120)
        return shmap.psum_scatter(x, "i", tiled=True)
    shmap.shard_map(body, mesh=_mesh(), in_specs=P(), out_specs=P("i"))(_x().repeat(4))
    return "finished"


def slow_receiver():
    """A ppermute whose receiver arrives late, with the watched wait's slices made tiny: a gloo send
    whose wait slice times out is abandoned by gloo, so the wait must not time out on it (a helper
    thread waits).  Returns each round's result's first element and whether every round finished."""
    from datetime import timedelta

    from shmap.backends import config

    shmap.configure_distributed(timeout=20)
    saved = config._POLL[0], config._OPTIONS["poll"]
    config._POLL[0], config._OPTIONS["poll"] = timedelta(milliseconds=1), 0.001
    try:
        mesh = _mesh()
        n = mesh.shape["i"]
        ring = [(s, (s + 1) % n) for s in range(n)]
        f = shmap.shard_map(lambda x: shmap.ppermute(x, "i", ring), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
        firsts = []
        for k in range(3):
            if _rank() == k % n:
                time.sleep(0.3)  # this rank's receive is posted late: the others' sends wait for it
            x = torch.arange(n * 200_000, dtype=torch.float64) + k
            firsts.append(float(f(x).full_tensor()[0]))
        return firsts
    finally:
        config._POLL[0], config._OPTIONS["poll"] = saved


def ppermute_bigger_sender():
    """A partial ppermute (1 -> 0) whose sender's block is larger than the receiver's: gloo aborts the
    receiver (SIGABRT), and the sender, with nothing to receive, returns."""
    n = 4 if _rank() == 0 else 6
    shmap.shard_map(lambda b: shmap.ppermute(b, "i", [(1, 0)]), mesh=_mesh(), in_specs=P("i"),
                    out_specs=P("i"))(torch.ones(2, n))
    return "finished"


def _shm(**options):
    import importlib

    importlib.import_module("shmap.kernels.transport")
    shmap.configure_distributed(transport="shm", **options)


def shm_peer_raises(checks):
    """The shared-memory transport: rank 1 raises between two psums while rank 0 waits in the second one's
    kernel (with checks on, its signature rides in the payload: no exchange ran before the kernel)."""
    _shm(check_collectives=checks)
    f = shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=_mesh(), in_specs=P("i"), out_specs=P())
    f(torch.ones(8))
    if _rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    f(torch.ones(8))
    return "finished"


def shm_peer_stalls():
    """The shared-memory transport, checks off: rank 1 sleeps past the collective timeout (3 s) before the
    second psum; rank 0's wait in the kernel ends with the timeout, naming the rank that never came."""
    _shm(check_collectives=False, timeout=3)
    f = shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=_mesh(), in_specs=P("i"), out_specs=P())
    f(torch.ones(8))
    if _rank() == 1:
        time.sleep(12)
    f(torch.ones(8))
    return "finished"


def shm_mismatch(kind):
    """The shared-memory transport, checks on: rank 1 calls a psum of another shape ("shape") or an
    all_gather ("kind") where rank 0 calls a psum."""
    _shm()
    mesh = _mesh()
    psum = shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    if _rank() == 1 and kind == "kind":
        shmap.shard_map(lambda x: shmap.all_gather(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(
            torch.ones(8))
    else:
        psum(torch.ones(16 if _rank() == 1 and kind == "shape" else 8))
    return "finished"


def different_meshes(bad_rank):
    """`bad_rank` builds another mesh than the others: they waited in DeviceMesh's group creation for the
    store's timeout (30 min under torchrun), then a raw DistStoreError."""
    shape, names = ((1, 2), ("a", "i")) if _rank() == bad_rank else ((2,), ("i",))
    shmap.make_mesh(shape, names)
    return "finished"


def different_settings(bad_rank):
    """`bad_rank` turns the signature checks off before its mesh: the payloads differ in size and gloo
    aborted a rank."""
    if _rank() == bad_rank:
        shmap.configure_distributed(check_collectives=False)
    _mesh()
    return "finished"


def leave_before_full_tensor(bad_rank, how):
    """The others wait in DTensor's own all_gather (full_tensor), which shmap's guard does not watch, while
    `bad_rank` raises (they get gloo's 'Connection closed by peer') or returns."""
    out = shmap.shard_map(lambda x: x * 2, mesh=_mesh(), in_specs=P("i"), out_specs=P("i"))(torch.ones(8))
    if _rank() == bad_rank:
        if how == "raise":
            raise ValueError("raised before full_tensor on purpose")
        return "left"
    return out.full_tensor().tolist()


def extra_shard_map(bad_rank):
    """`bad_rank` calls the shard_map a second time; the others once, then return: the others, who were
    right, were named "returned early"."""
    f = shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=_mesh(), in_specs=P("i"), out_specs=P())
    x = torch.ones(2 * torch.distributed.get_world_size())
    f(x)
    if _rank() == bad_rank:
        f(x)
    return "finished"


def shm_peer_killed(checks):
    """The shared-memory transport: rank 1 is SIGKILLed between two psums while rank 0 waits in the
    second one's kernel (no report, and no connection closes)."""
    import os
    import signal

    _shm(check_collectives=checks)
    f = shmap.shard_map(lambda x: shmap.psum(x, "i"), mesh=_mesh(), in_specs=P("i"), out_specs=P())
    f(torch.ones(8))
    if _rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    f(torch.ones(8))
    return "finished"
