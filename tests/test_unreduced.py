"""Unreduced values (pending sums): creation, linear ops, reduction, boundaries, and errors."""
import pytest
import torch

import shmap
from shmap import P

torch.set_default_dtype(torch.float64)
MESH = shmap.make_mesh((4,), ("i",))


def sm(f, i, o, mesh=MESH):
    return shmap.shard_map(f, mesh=mesh, in_specs=i, out_specs=o)


def test_gradient_accumulation_psums_once_instead_of_per_microbatch():
    """Summing K pending per-device gradients and reducing once: 1 psum, not K."""
    x = torch.randn(4 * 6, 3)
    w = torch.randn(3, requires_grad=True)

    def accumulate(xb, wb, pending):
        total = None
        for mb in xb.chunk(3):  # three micro-batches per device
            g = 2 * mb.T @ (mb @ wb)  # this device's gradient of |mb @ w|^2 on the micro-batch
            g = shmap.pcast(g, "i", to="unreduced") if pending else shmap.psum(g, "i")
            total = g if total is None else total + g
        return shmap.psum(total, "i") if pending else total

    expect = 2 * x.T @ (x @ w)
    for pending, psums in ((True, 1), (False, 3)):
        with shmap.comm_log() as log:
            out = sm(lambda a, b: accumulate(a, b, pending), (P("i"), P()), P())(x, w)
        torch.testing.assert_close(out, expect)
        assert log.count("psum") == psums


def test_types_and_linear_ops():
    seen = {}

    def body(a, s):
        u = shmap.pcast(a, "i", to="unreduced")
        seen["u"] = (shmap.vma(u), shmap.unreduced_axes(u))
        v = (u * 2 + u).reshape(-1)[:2] @ s  # linear in u; s is invariant
        seen["v"] = shmap.unreduced_axes(v)
        r = shmap.psum(v, "i")
        seen["r"] = (shmap.vma(r), shmap.unreduced_axes(r))
        return r

    a = torch.randn(4 * 2, 3)
    s = torch.randn(2)
    out = sm(body, (P("i"), P()), P())(a, s)
    assert seen == {"u": (frozenset(), {"i"}), "v": {"i"}, "r": (frozenset(), frozenset())}
    total = sum(a.chunk(4))
    torch.testing.assert_close(out, 3 * total.reshape(-1)[:2] @ s)


def test_unreduced_output_returns_the_logical_value_and_its_gradient():
    a = torch.randn(8, 3, requires_grad=True)
    f = sm(lambda v: shmap.pcast(v * 2, "i", to="unreduced"), P("i"), P(None, unreduced={"i"}))
    with shmap.comm_log() as log:
        out = f(a)
    assert log.count() == 0  # nothing communicated inside the program
    torch.testing.assert_close(out, 2 * sum(a.chunk(4)))
    ct = torch.randn(2, 3)
    (g,) = torch.autograd.grad(out, a, ct)
    torch.testing.assert_close(g, 2 * ct.repeat(4, 1))


def test_unreduced_input_is_a_pending_sum_of_the_global_value():
    x = torch.randn(3)
    seen = []

    def body(v):
        seen.append(shmap.unreduced_axes(v))
        return shmap.psum(v, "i")

    out = sm(body, P(unreduced={"i"}), P())(x)
    assert seen == [{"i"}]
    torch.testing.assert_close(out, x)


@pytest.mark.parametrize("op,match", [
    (lambda u, a: torch.exp(u), "does not commute"),
    (lambda u, a: u + 1.0, "once per device"),
    (lambda u, a: u + a, "once per device"),
    (lambda u, a: u * a, "not linear in the pending sum"),
    (lambda u, a: a / u, "dividing by a value unreduced"),
    (lambda u, a: shmap.all_gather(u, "i"), "reduce it first"),
    # a number over a pending value (the number, not a tensor operand, is the numerator): it passed as linear
    (lambda u, a: torch.div(2.0, u), "dividing by a value unreduced"),
    (lambda u, a: torch.true_divide(2.0, u), "dividing by a value unreduced"),
    (lambda u, a: 2.0 / u, "does not commute"),
    # casts that do not commute with the sum (each term made 0 or 1, or truncated): they passed as views
    (lambda u, a: u.to(torch.bool), r"to bool does not commute with the sum \(each term would be made 0 or 1\)"),
    (lambda u, a: u.to(torch.int64), r"to int64 does not commute with the sum \(each term would be truncated\)"),
    (lambda u, a: u.to(dtype=torch.int32), "to int32 does not commute"),
    (lambda u, a: u.type(torch.int16), "to int16 does not commute"),
])
def test_nonlinear_uses_are_errors(op, match):
    def body(a):
        u = shmap.pcast(a, "i", to="unreduced")
        return shmap.psum(op(u, a), "i")

    with pytest.raises(shmap.VmaError, match=match):
        sm(body, P("i"), P())(torch.randn(8))


def test_casts_that_commute_with_the_sum_stay_pending():
    """Into a floating dtype (up to rounding), and between integer dtypes (exact, wrapping as the sum does)."""
    x = torch.arange(8.0, dtype=torch.float64)
    f = sm(lambda a: shmap.psum(shmap.pcast(a, "i", to="unreduced").to(torch.float32), "i"), P("i"), P())
    torch.testing.assert_close(f(x), x.reshape(4, 2).sum(0).float())
    n = torch.arange(8)
    g = sm(lambda a: shmap.psum(shmap.pcast(a, "i", to="unreduced").to(torch.int32), "i"), P("i"), P())
    assert torch.equal(g(n), n.reshape(4, 2).sum(0).int())


def test_boundary_errors():
    with pytest.raises(shmap.VmaError, match="does not say so"):
        sm(lambda a: shmap.pcast(a, "i", to="unreduced"), P("i"), P())(torch.randn(8))
    with pytest.raises(shmap.VmaError, match="says the output is unreduced"):
        sm(lambda a: shmap.psum(a, "i"), P("i"), P(unreduced={"i"}))(torch.randn(8))
    with pytest.raises(shmap.SpecError, match="both splits"):
        sm(lambda a: a, P("i", unreduced={"i"}), P("i"))(torch.randn(8))
    with pytest.raises(shmap.VmaError, match="invariant"):
        sm(lambda a: shmap.pcast(a, "i", to="unreduced"), P(), P(unreduced={"i"}))(torch.randn(8))
    with pytest.raises(shmap.CollectiveArgumentError, match="to must be"):
        sm(lambda a: shmap.pcast(a, "i", to="reduced"), P("i"), P("i"))(torch.randn(8))


def test_partition_spec_unreduced_identity():
    assert P("i", unreduced={"j"}) != P("i") and P(unreduced="j") == P(None, unreduced={"j"})
    assert repr(P("i", unreduced={"j"})) == "P('i', unreduced={'j'})"


def test_adding_zero_keeps_a_sum_pending():
    def body(a):
        u = shmap.pcast(a, "i", to="unreduced")
        return shmap.psum(sum([u, u]), "i")  # builtin sum starts from 0

    x = torch.randn(8)
    torch.testing.assert_close(sm(body, P("i"), P())(x), 2 * sum(x.chunk(4)))


def add(x, y):
    """A user function that takes part in __torch_function__ and is *named* like torch.add, but is not
    linear: the pending-sum rules are keyed by torch's callables, not by names."""
    from torch.overrides import handle_torch_function, has_torch_function

    if has_torch_function((x, y)):
        return handle_torch_function(add, (x, y), x, y)
    return x * x + y


def test_rules_are_keyed_by_callables_not_names():
    def body(a):
        u = shmap.pcast(a, "i", to="unreduced")
        return shmap.psum(add(u, u), "i")

    with pytest.raises(shmap.VmaError, match="does not commute"):
        sm(body, P("i"), P())(torch.randn(8))


def test_a_nested_out_spec_unreduced_along_a_varying_axis_makes_the_pending_sum():
    """As at the top level (and JAX): an inner shard_map's out_spec unreduced along an axis its value
    varies on is an implicit pcast, not a type error; the parent sees the sum, with its gradient."""
    mesh = shmap.make_mesh((2, 2), ("i", "j"))
    x = torch.arange(16.0).reshape(4, 4).requires_grad_()

    def outer(v):
        return shmap.shard_map(lambda t: t.sum(1) * t[:, 0], mesh=mesh, in_specs=P(None, "j"),
                               out_specs=P(unreduced={"j"}))(v)

    got = shmap.shard_map(outer, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})(x)
    flat = shmap.shard_map(lambda t: t.sum(1) * t[:, 0], mesh=mesh, in_specs=P("i", "j"),
                           out_specs=P("i", unreduced={"j"}))(x)
    torch.testing.assert_close(got, flat)
    (g,) = torch.autograd.grad((got ** 2).sum(), x)
    (want,) = torch.autograd.grad((flat ** 2).sum(), x)
    torch.testing.assert_close(g, want)
