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
    return shmap.make_mesh((4,), ("i",))


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
    """Several mismatched programs in one world: each is reported on every rank, and the world goes on."""
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
