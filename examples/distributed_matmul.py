"""A sharded matmul and a data-parallel gradient on one process per device.

    torchrun --nproc-per-node 4 examples/distributed_matmul.py

Uses gloo on CPU, or NCCL when CUDA is available (one GPU per process).  The
body is the same one the simulated mesh runs (python -m shmap.demo); the
script runs it on both and checks they agree.
"""
from __future__ import annotations

import logging
import os
from functools import partial

import torch
import torch.distributed as dist

import shmap
from shmap import P


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    # DTensor warns when full_tensor() gathers over two mesh axes one after the other.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = (2, world // 2) if world % 2 == 0 else (world, 1)
    mesh = shmap.make_mesh(shape, ("i", "j"))  # one device per process: prod(shape) == world size
    sim = shmap.make_mesh(shape, ("i", "j"), distributed=False)  # the same devices, simulated here

    # Plain tensors are global values every rank holds: seed every rank alike.
    torch.manual_seed(0)
    a = torch.randn(8 * shape[0], 16 * shape[1])
    b = torch.randn(16 * shape[1], 4)

    def matmul_body(a_block, b_block):
        return shmap.psum(a_block @ b_block, "j")  # partial sums over j -> invariant along j

    def matmul(m):
        return shmap.shard_map(matmul_body, mesh=m, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", None))

    c = matmul(mesh)(a, b)  # a DTensor: Shard(0) over i, Replicate over j
    if rank == 0:
        print(f"mesh {mesh}; c is a DTensor with placements {c.placements}")
        print(shmap.visualize_sharding(c))
    assert torch.allclose(c.full_tensor().cpu(), matmul(sim)(a, b), atol=1e-4)
    assert torch.allclose(c.full_tensor().cpu(), a @ b, atol=1e-4)

    # Data parallelism: the batch is split over every device, the weight replicated.
    # Every rank computes the same global loss; autodiff puts exactly one psum on w's gradient.
    x = torch.randn(4 * world, 16)
    w = torch.randn(16, 4, requires_grad=True)

    @partial(shmap.shard_map, mesh=mesh, in_specs=(P(("i", "j")), P()), out_specs=P())
    def loss_fn(x_block, w):
        return shmap.psum(((x_block @ w) ** 2).sum(), ("i", "j"))

    with shmap.comm_log() as log:
        loss_fn(x, w).full_tensor().backward()
    assert torch.allclose(w.grad.cpu(), torch.func.grad(lambda w: ((x @ w) ** 2).sum())(w.detach()), rtol=1e-4)
    if rank == 0:
        print(f"loss/grad step: {log.summary()} collectives forward and backward, {log.total_bytes} bytes")
        print("OK: the distributed mesh agrees with the simulated mesh and with plain torch")
    shmap.shutdown_distributed()  # tell the other ranks this one finished, wait for them, destroy the groups


if __name__ == "__main__":
    main()
