"""The distributed backend on a GPU: one process, an NCCL world (run by tests/test_cuda.py).

A GPU host with one device cannot run two NCCL ranks (NCCL refuses two
ranks on one GPU), so this is the part of the NCCL path one GPU can run:
`make_mesh` over an NCCL world (the guard's gloo group and store beside it),
the boundary's DTensors on CUDA, every collective's call path and autograd
Function (over a group of one, where shmap moves nothing), `shmap.jit`'s
replay, checks on and off.  Results must equal the simulated mesh's on the
same GPU, value for value, gradient and `comm_log` alike.
"""
from __future__ import annotations

import torch

import shmap
from shmap import P


def _body(x, w):
    y = x @ w
    s = shmap.psum(y, "i")
    g = shmap.all_gather(y, "i", axis=0, tiled=True)
    r = shmap.psum_scatter(g, "i", scatter_dimension=0, tiled=True)
    p = shmap.ppermute(y, "i", perm=[(0, 0)])
    a = shmap.all_to_all(y, "i", 0, 0, tiled=True)
    return (s.sum() + r.sum() + p.sum() + a.sum() + shmap.pmax(y, "i").sum()).reshape(1)


def _global(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(mesh):
    """(output, w's gradient, comm_log summary, output device) of one differentiable call."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, device="cuda", dtype=torch.float64)
    w = torch.randn(16, 4, device="cuda", dtype=torch.float64, requires_grad=True)
    f = shmap.shard_map(_body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    with shmap.comm_log() as log:
        out = _global(f(x, w))
        out.sum().backward()
    return out.detach(), w.grad, log.summary(), out.device.type


def one_process_nccl():
    import torch.distributed as dist

    mesh = shmap.make_mesh((1,), ("i",))
    assert mesh.is_distributed and dist.get_backend() == "nccl", dist.get_backend()
    out, grad, log, device = _run(mesh)
    assert device == "cuda", f"the result came back on {device}"
    sim = _run(shmap.make_mesh((1,), ("i",), distributed=False, device="cuda"))
    torch.testing.assert_close(out, sim[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, sim[1], rtol=1e-12, atol=1e-12)
    assert log == sim[2], (log, sim[2])
    for checks in (False, True):
        shmap.configure_distributed(check_collectives=checks)
        again = _run(mesh)
        assert torch.equal(again[0], out) and torch.equal(again[1], grad) and again[2] == log
    f = shmap.shard_map(_body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    jitted = shmap.jit(f)
    x = torch.randn(8, 16, device="cuda", dtype=torch.float64)
    w = torch.randn(16, 4, device="cuda", dtype=torch.float64)
    eager = _global(f(x, w))
    jitted(x, w)  # (the capture)
    replay = _global(jitted(x, w))
    torch.testing.assert_close(replay, eager, rtol=1e-10, atol=1e-10)
    assert jitted.traces == 1, jitted.traces
    return log
