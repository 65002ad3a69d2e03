"""pmap and nested pmap on one process per device: the design docs' 2x2 grid.

    torchrun --nproc-per-node 4 examples/nested_pmap.py

Rows are data parallel (`'data'`), columns model parallel (`'model'`); each
axis name is scoped to its own pmap call.  The script runs the same program
on the simulated mesh too and checks that the two agree, values and gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import shmap


@shmap.pmap(axis_name="model")
def inner_op(x, p):
    return shmap.psum(x * p, axis_name="model") * 2


@shmap.pmap(axis_name="data")
def outer_op(x, p):
    return shmap.psum(inner_op(x, p), axis_name="data")


@shmap.pmap(axis_name="i")
def normalise(x):  # a single-level pmap: each device's row over the sum of all rows
    return x / shmap.psum(x.sum(), "i")


def whole(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def run():
    data = torch.arange(16.).reshape(2, 2, 2, 2)
    params = (torch.ones(16).reshape(2, 2, 2, 2) * 0.5).requires_grad_()
    out = outer_op(data, params)
    (g,) = torch.autograd.grad(whole(out).square().sum(), params)
    rows = torch.arange(1., 1 + 4 * 3).reshape(4, 3)
    return whole(out).detach(), whole(g), whole(normalise(rows))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "run with torchrun --nproc-per-node 4"
    out, grad, norm = run()                      # one process per device
    shmap.shutdown_distributed()  # tell the other ranks this one finished, wait for them, destroy the groups
    sim_out, sim_grad, sim_norm = run()          # the same program, simulated in this process
    assert torch.equal(out[0, 0], torch.tensor([[24., 28.], [32., 36.]])) and (out == out[0, 0]).all()
    for a, b in ((out, sim_out), (grad, sim_grad), (norm, sim_norm)):
        torch.testing.assert_close(a, b)
    if rank == 0:
        print(f"nested pmap on {world} processes: {out[0, 0].tolist()} on every device; gradients and a "
              "single-level pmap equal the simulated mesh")
        print("OK: pmap and nested pmap agree between the meshes")


if __name__ == "__main__":
    main()
