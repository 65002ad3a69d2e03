"""`python -m shmap.demo`: the seed-000 examples on a simulated (4, 2) mesh.

Prints what each device holds inside the bodies, the global results, and the
communication that autodiff performs for the seed-004 data-parallel loss.
"""
from __future__ import annotations

from functools import partial

import torch

import shmap
from shmap import P


def main() -> None:
    torch.set_printoptions(precision=1, linewidth=120)
    mesh = shmap.make_mesh((4, 2), ("i", "j"))
    print(f"mesh: {mesh}\n")

    a = torch.arange(8 * 16.0).reshape(8, 16)
    b = torch.arange(16 * 32.0).reshape(16, 32)

    @partial(shmap.shard_map, mesh=mesh, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", None))
    def matmul_basic(a_block, b_block):
        print("a_block (each device's block of a, split over i and j):")
        print(a_block[:, :4], "\n")
        z_partialsum = a_block @ b_block
        z_block = shmap.psum(z_partialsum, "j")
        print("z_block after psum over 'j' (invariant along j, still varying along i):")
        print(z_block[:, :4], "\n")
        return z_block

    c = matmul_basic(a, b)
    print(f"matmul_basic: c.shape = {tuple(c.shape)}, equals a @ b: {torch.equal(c, a @ b)}\n")

    @partial(shmap.shard_map, mesh=mesh, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", "j"))
    def matmul_reduce_scatter(a_block, b_block):
        c_partialsum = a_block @ b_block
        return shmap.psum_scatter(c_partialsum, "j", scatter_dimension=1, tiled=True)

    with shmap.comm_log() as log:
        c2 = matmul_reduce_scatter(a, b)
    print(f"matmul_reduce_scatter: equals a @ b: {torch.equal(c2, a @ b)}; communication: {log}\n")

    x = torch.arange(12 * 12.0).reshape(12, 12)
    for name, axes, spec in (("f3", "j", P("i", None)), ("f4", "i", P(None, "j")), ("f5", ("i", "j"), P())):
        y = shmap.shard_map(lambda blk: shmap.psum(blk, axes), mesh=mesh, in_specs=P("i", "j"), out_specs=spec)(x)
        print(f"{name}: psum over {axes!r}, out_specs={spec} -> shape {tuple(y.shape)}")

    # Seed 004: a data-parallel loss; autodiff puts exactly one psum per parameter in the backward pass.
    dp = shmap.make_mesh((8,), ("batch",))
    w = torch.randn(16, 4, requires_grad=True)
    inputs, targets = torch.randn(64, 16), torch.randn(64, 4)

    @partial(shmap.shard_map, mesh=dp, in_specs=(P(), P("batch"), P("batch")), out_specs=P())
    def loss(w, x, t):
        return shmap.pmean(((x @ w - t) ** 2).mean(), "batch")

    value = loss(w, inputs, targets)
    with shmap.comm_log() as log:
        value.backward()
    print(f"\ndata-parallel loss {value.item():.4f}; backward communication: {log}")


if __name__ == "__main__":
    main()
