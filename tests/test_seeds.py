"""Every example of seed 000 (the shard_map design doc) and seed 004 (efficient transposes),
written with torch: values, shapes, gradients, and the backward pass's collective counts."""
from functools import partial

import pytest
import torch

import shmap
from shmap import P

torch.set_default_dtype(torch.float64)
MESH = shmap.make_mesh((4, 2), ("i", "j"))
MESH8 = shmap.make_mesh((8,), ("i",))


# ------------------------------------------------------------------ seed 000
def test_matmul_basic():
    a = torch.arange(8 * 16.0).reshape(8, 16)
    b = torch.arange(16 * 32.0).reshape(16, 32)
    shapes = []

    @partial(shmap.shard_map, mesh=MESH, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", None))
    def matmul_basic(a_block, b_block):
        shapes.append((tuple(a_block.shape), tuple(b_block.shape)))
        z_partialsum = a_block @ b_block
        return shmap.psum(z_partialsum, "j")

    c = matmul_basic(a, b)
    assert shapes == [((2, 8), (8, 32))] and c.shape == (8, 32)
    torch.testing.assert_close(c, a @ b)


def test_matmul_reduce_scatter():
    a = torch.arange(8 * 16.0).reshape(8, 16)
    b = torch.arange(16 * 32.0).reshape(16, 32)

    @partial(shmap.shard_map, mesh=MESH, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", "j"))
    def matmul_reduce_scatter(a_block, b_block):
        c_partialsum = a_block @ b_block
        c_block = shmap.psum_scatter(c_partialsum, "j", scatter_dimension=1, tiled=True)
        assert c_block.shape == (2, 16)
        return c_block

    torch.testing.assert_close(matmul_reduce_scatter(a, b), a @ b)


def test_f1_f2_unmentioned_input_axis_is_a_tile():
    shapes = []

    def f(x_block):
        shapes.append(tuple(x_block.shape))
        return x_block

    x = torch.arange(12 * 12.0).reshape(12, 12)
    f1 = shmap.shard_map(f, mesh=MESH, in_specs=P("i", None), out_specs=P("i", "j"))
    f2 = shmap.shard_map(f, mesh=MESH, in_specs=P("i", "j"), out_specs=P("i", "j"))
    y1 = f1(x)
    y2 = f2(torch.tile(x, (1, 2)))
    assert shapes == [(3, 12), (3, 12)]
    torch.testing.assert_close(y1, y2)
    assert y1.shape == (12, 24)


def test_closure_outputs_untile():
    x = torch.tensor([[3.0]])
    z = shmap.shard_map(lambda: x, mesh=MESH, in_specs=(), out_specs=P("i", "j"))()
    torch.testing.assert_close(z, torch.tile(x, (4, 2)))
    z = shmap.shard_map(lambda: x, mesh=MESH, in_specs=(), out_specs=P("i", None))()
    torch.testing.assert_close(z, torch.tile(x, (4, 1)))
    z = shmap.shard_map(lambda: x, mesh=MESH, in_specs=(), out_specs=P(None, None))()
    torch.testing.assert_close(z, x)


@pytest.mark.parametrize("name,axes,out_spec,shape", [
    ("f3", "j", P("i", None), (12, 6)),
    ("f4", "i", P(None, "j"), (3, 12)),
    ("f5", ("i", "j"), P(None, None), (3, 6)),
])
def test_f3_f4_f5_psum_then_unmapped_output(name, axes, out_spec, shape):
    x = torch.arange(12 * 12.0).reshape(12, 12)
    y = shmap.shard_map(lambda b: shmap.psum(b, axes), mesh=MESH, in_specs=P("i", "j"), out_specs=out_spec)(x)
    assert y.shape == shape
    blocks = x.reshape(4, 3, 2, 6).permute(0, 2, 1, 3)  # [i, j, 3, 6]
    summed = blocks.sum(dim=tuple(["ij".index(a) for a in (axes if isinstance(axes, tuple) else (axes,))]),
                        keepdim=True)
    full = summed.expand(4, 2, 3, 6)
    if name == "f3":
        expect = full[:, 0].reshape(12, 6)
    elif name == "f4":
        expect = full[0].permute(1, 0, 2).reshape(3, 12)
    else:
        expect = full[0, 0]
    torch.testing.assert_close(y, expect)


# ------------------------------------------------------------------ seed 004
def g(x):
    return torch.sin(x).pow(2).sum()


def _grad_and_log(out, inputs, ct=None, create_graph=False):
    with shmap.comm_log() as log:
        grads = torch.autograd.grad(out, inputs, ct, create_graph=create_graph)
    return grads, log


def test_example1_psum_to_unmapped_output_transposes_without_communication():
    x = torch.randn(16, requires_grad=True)
    f1 = shmap.shard_map(lambda v: shmap.psum(g(v), "i"), mesh=MESH8, in_specs=P("i"), out_specs=P())
    (gx,), log = _grad_and_log(f1(x), x)
    assert log.count() == 0
    torch.testing.assert_close(gx, torch.autograd.grad(g(x), x)[0])


def test_example2_psum_to_mapped_output_transposes_to_one_psum():
    x = torch.randn(16, requires_grad=True)
    y = torch.randn(16)
    f2 = shmap.shard_map(lambda v, w: shmap.psum(g(v), "i") * w, mesh=MESH8, in_specs=(P("i"), P("i")),
                         out_specs=P("i"))
    (gx,), log = _grad_and_log(f2(x, y).sum(), x)
    assert log.summary() == {"psum": 1}
    torch.testing.assert_close(gx, torch.autograd.grad(g(x) * y.sum(), x)[0])


@pytest.mark.parametrize("times", [1, 2, 3])
def test_example3_cursed_identity_stays_the_identity(times):
    cursed_identity = shmap.shard_map(lambda v: v, mesh=MESH8, in_specs=P(), out_specs=P())
    x = torch.randn(5, requires_grad=True)
    with shmap.comm_log() as log:
        out = cursed_identity(x)
        cts = []
        for _ in range(times):
            ct = torch.randn(5, requires_grad=True)
            (out,) = torch.autograd.grad(out, x if not cts else cts[-1], ct, create_graph=True)
            cts.append(ct)
    assert log.count() == 0
    torch.testing.assert_close(out, cts[-1])


def test_example4_all_gather_invariant_to_unmapped_output_transposes_to_a_slice():
    x = torch.randn(8, 3, requires_grad=True)
    f4 = shmap.shard_map(lambda v: shmap.all_gather_invariant(v, "i", tiled=True), mesh=MESH8,
                         in_specs=P("i"), out_specs=P())
    out = f4(x)
    torch.testing.assert_close(out, x)
    ct = torch.randn(8, 3)
    (gx,), log = _grad_and_log(out, x, ct)
    assert log.count() == 0
    torch.testing.assert_close(gx, ct)


def test_example4_with_all_gather_needs_a_mapped_output():
    x = torch.randn(8, 3)
    with pytest.raises(shmap.VmaError, match="all_gather"):
        shmap.shard_map(lambda v: shmap.all_gather(v, "i", tiled=True), mesh=MESH8, in_specs=P("i"),
                        out_specs=P())(x)


def test_example5_all_gather_to_mapped_output_transposes_to_one_psum_scatter():
    x = torch.randn(8, requires_grad=True)
    y = torch.randn(64)
    f5 = shmap.shard_map(lambda v, w: shmap.all_gather(v, "i", tiled=True) * w, mesh=MESH8,
                         in_specs=(P("i"), P("i")), out_specs=P("i"))
    (gx,), log = _grad_and_log(f5(x, y).sum(), x)
    assert log.summary() == {"psum_scatter": 1}
    torch.testing.assert_close(gx, y.reshape(8, 8).sum(0))


def test_data_parallel_loss_one_psum_per_parameter():
    torch.manual_seed(0)
    params = {"w1": torch.randn(4, 8), "b1": torch.randn(8), "w2": torch.randn(8, 2)}
    for p in params.values():
        p.requires_grad_()
    inputs, targets = torch.randn(32, 4), torch.randn(32, 2)

    def predict(ps, x):
        return torch.tanh(x @ ps["w1"] + ps["b1"]) @ ps["w2"]

    @partial(shmap.shard_map, mesh=MESH8, in_specs=(P(), P("i")), out_specs=P())
    def loss(ps, batch):
        x, t = batch
        local_loss = (predict(ps, x) - t).sum(-1).mean()
        return shmap.pmean(local_loss, "i")

    out = loss(params, (inputs, targets))
    grads, log = _grad_and_log(out, list(params.values()))
    assert log.summary() == {"psum": 3}
    ref = (predict(params, inputs) - targets).sum(-1).mean()
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, torch.autograd.grad(ref, list(params.values()))):
        torch.testing.assert_close(a, b)
