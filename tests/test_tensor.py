"""Body values: typing of ordinary ops, automatic pvary, printing, autograd inside bodies, in-place rules."""
import pytest
import torch

import shmap
from shmap import P

torch.set_default_dtype(torch.float64)
MESH = shmap.make_mesh((4, 2), ("i", "j"))


def sm(f, i, o, **kw):
    return shmap.shard_map(f, mesh=MESH, in_specs=i, out_specs=o, **kw)


def test_ordinary_ops_take_the_union_and_shapes_are_logical():
    seen = {}

    def body(a, b, w):
        seen["a"] = (tuple(a.shape), a.dim(), a.numel(), len(a), a.dtype, a.device.type)
        y = a @ w + b.sum()  # {i} @ {} + {j}
        seen["y"] = (shmap.vma(y), tuple(y.shape))
        seen["cat"] = shmap.vma(torch.cat([a, a * 2], 0))
        seen["max"] = shmap.vma(torch.max(a, dim=1).values)
        seen["idx"] = shmap.vma(w[shmap.axis_index("j")])
        return shmap.psum(y, ("i", "j"))

    sm(body, (P("i"), P("j"), P()), P())(torch.randn(8, 3), torch.randn(4), torch.randn(3, 5))
    assert seen["a"] == ((2, 3), 2, 6, 2, torch.float64, "cpu")
    assert seen["y"] == ({"i", "j"}, (2, 5))
    assert seen["cat"] == {"i"} and seen["max"] == {"i"} and seen["idx"] == {"j"}


def test_auto_pvary_is_memoised_one_psum_per_parameter():
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(8, 3)

    def body(xb):
        h = torch.tanh(xb @ w)  # w closed over: used twice with varying data
        return shmap.psum((h @ w).sum(), "i")

    mesh = shmap.make_mesh((8,), ("i",))
    out = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    with shmap.comm_log() as log:
        (g,) = torch.autograd.grad(out, w)
    assert log.count("psum") == 1
    ref = (torch.tanh(x @ w) @ w).sum()
    torch.testing.assert_close(g, torch.autograd.grad(ref, w)[0])


def test_print_shows_every_device_block(capsys):
    def body(a, w):
        print(a)
        print(w)
        return a

    mesh = shmap.make_mesh((2,), ("i",))
    shmap.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))(
        torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([7.0]))
    out = capsys.readouterr().out
    assert "varying along {'i'}" in out
    assert "device (i=0): tensor([1., 2.]" in out and "device (i=1): tensor([3., 4.]" in out
    assert "invariant" in out and "every device: tensor([7.]" in out


def test_invariant_values_allow_python_scalars():
    got = []

    def body(a):
        total = shmap.psum(a.sum(), "i")
        got.append((total.item(), float(total), bool(total > 0)))
        with pytest.raises(shmap.VaryingControlFlowError):
            a.sum().item()
        return a

    x = torch.ones(8)
    sm(body, P("i"), P("i"))(x)
    assert got == [(8.0, 8.0, True)]


def test_autograd_inside_the_body_first_and_second_order():
    x = torch.randn(8, 3)
    w = torch.randn(3, requires_grad=True)
    mesh = shmap.make_mesh((8,), ("i",))

    def body(xb, wb):
        wb = wb.detach().requires_grad_()
        local = (torch.sin(xb @ wb)).sum()  # varying loss
        (g,) = torch.autograd.grad(local, wb, create_graph=True)  # invariant param: gradient psum'd
        assert shmap.vma(g) == frozenset()
        (h,) = torch.autograd.grad(g.sum(), wb)
        return g, h

    g, h = shmap.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=(P(), P()))(x, w)
    wr = w.detach().requires_grad_()
    (gr,) = torch.autograd.grad(torch.sin(x @ wr).sum(), wr, create_graph=True)
    (hr,) = torch.autograd.grad(gr.sum(), wr)
    torch.testing.assert_close(g, gr)
    torch.testing.assert_close(h, hr)


def test_backward_inside_body_accumulates_into_outer_leaves():
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(8, 3)
    mesh = shmap.make_mesh((8,), ("i",))

    def body(xb):
        loss = shmap.pmean((xb @ w).pow(2).mean(), "i")
        loss.backward()
        return loss

    shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    wr = w.detach().requires_grad_()
    (x @ wr).pow(2).mean().backward()
    torch.testing.assert_close(w.grad, wr.grad)


def test_gradient_from_outside_second_order():
    x = torch.randn(8, 3, requires_grad=True)
    mesh = shmap.make_mesh((8,), ("i",))
    f = shmap.shard_map(lambda v: shmap.psum(torch.sin(v).pow(2).sum(), "i"), mesh=mesh, in_specs=P("i"),
                        out_specs=P())
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(g, 2 * torch.sin(x) * torch.cos(x))
    torch.testing.assert_close(h, 2 * torch.cos(2 * x))


def test_inplace_rules():
    def ok(a, b):
        a = a * 1
        a += b  # {i} += {} is fine
        a.mul_(2)
        return a

    x, y = torch.randn(8), torch.randn(2)
    out = sm(ok, (P("i"), P()), P("i"))(x, y)
    torch.testing.assert_close(out, (x + y.repeat(4)) * 2)

    def bad(a, b):
        b = b * 1
        b += a  # {} += {i}: the target cannot become varying
        return b

    with pytest.raises(shmap.VmaError) as e:
        sm(bad, (P("i"), P()), P())(x, y)
    assert "in-place" in str(e.value) and "x = x + y" in str(e.value)

    def writes_pvaried(a, b):
        c = shmap.pvary(b, "i")  # stride-0 view: in-place gets its own storage
        c.add_(a)
        return c

    out = sm(writes_pvaried, (P("i"), P()), P("i"))(x, y)
    torch.testing.assert_close(out, x + y.repeat(4))


def test_body_values_do_not_escape():
    leaked = []

    def body(a):
        leaked.append(a)
        return a

    sm(body, P("i"), P("i"))(torch.randn(8))
    with pytest.raises(shmap.VmaError, match="already returned"):
        leaked[0] + 1


def test_nn_module_inside_body():
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(8, 3)
    mesh = shmap.make_mesh((8,), ("i",))
    out = shmap.shard_map(lambda v: shmap.psum(lin(v).sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    torch.testing.assert_close(out, lin(x).sum())
    with shmap.comm_log() as log:
        out.backward()
    assert log.count("psum") == 2  # weight and bias, one each


def test_mixed_variance_operands_on_three_axes_match_a_per_device_loop():
    """Batch levels are nested by how many operands vary along them; results must not depend on it."""
    mesh = shmap.make_mesh((2, 3, 2), ("a", "b", "c"))
    x = torch.randn(2 * 4, 5 * 2)   # P('a', 'c')  -> block [4, 5], varies {a, c}
    y = torch.randn(3 * 5, 6)       # P('b')       -> block [5, 6], varies {b}
    z = torch.randn(6)              # P()          -> invariant

    def body(xb, yb, zb):
        return xb @ yb + zb * shmap.axis_index("c")

    out = shmap.shard_map(body, mesh=mesh, in_specs=(P("a", "c"), P("b"), P()),
                          out_specs=P(("a", "b"), "c"))(x, y, z)
    rows = []
    for ia in range(2):
        for ib in range(3):
            cols = []
            for ic in range(2):
                xb = x[4 * ia:4 * ia + 4, 5 * ic:5 * ic + 5]
                yb = y[5 * ib:5 * ib + 5]
                cols.append(xb @ yb + z * ic)
            rows.append(torch.cat(cols, 1))
    torch.testing.assert_close(out, torch.cat(rows, 0))


def test_same_type_elementwise_fast_path_equals_the_general_dispatch(monkeypatch):
    """Elementwise ops on values of one type and rank skip `_dispatch`'s bookkeeping
    (`tensor._same_type_elementwise`); results, types and gradients are those of the general path."""
    from shmap import tensor

    def body(x, y, w):
        a = torch.addcmul(x * 0.5, x, y, value=-2) + 1
        b = (torch.lerp(a, y, 0.25).abs() + 0.1).sqrt() / 3 + (x > 0)
        c = torch.where(y > 0, b, a) - w      # w invariant: lifted, the general path
        d = c.to(torch.float32).double() ** 2 + True
        return shmap.psum(d.sum(-1) + torch.clamp(x, min=-0.5).sum(-1), "j"), shmap.vma(b), shmap.vma(c)

    f = sm(lambda x, y, w: body(x, y, w)[0], (P("i", "j"), P("i", "j"), P()), P("i"))
    x, y, w = (torch.randn(8, 4, requires_grad=True), torch.randn(8, 4), torch.randn(2, requires_grad=True))
    seen = []
    sm(lambda x, y, w: seen.extend(body(x, y, w)[1:]) or x, (P("i", "j"), P("i", "j"), P()), P("i", "j"))(x, y, w)
    assert seen == [{"i", "j"}, {"i", "j"}]
    calls = []
    original = tensor._same_type_elementwise
    monkeypatch.setattr(tensor, "_same_type_elementwise", lambda *a: calls.append(a[0]) or original(*a))
    out = f(x, y, w)
    grads = torch.autograd.grad(out.sum(), (x, w))
    assert len(calls) > 10
    monkeypatch.setattr(tensor, "_FAST", {})
    expect = f(x, y, w)
    for a, b in zip((out, *grads), (expect, *torch.autograd.grad(expect.sum(), (x, w)))):
        assert torch.equal(a, b)


def test_to_the_dtype_a_value_has_is_the_value_itself():
    """As torch: `x.to(x.dtype)` is `x` (no op, no autograd node); another dtype converts, with its
    gradient converted back."""
    seen = {}

    def body(x):
        seen["same"] = x.to(torch.float32) is x and x.to(dtype=torch.float32) is x
        y = x.to(torch.float64)
        seen["other"] = y is not x and y.dtype == torch.float64
        return shmap.psum((y * y).sum(), ("i", "j"))

    x = torch.randn(8, 2, dtype=torch.float32, requires_grad=True)
    out = shmap.shard_map(body, mesh=MESH, in_specs=P("i", "j"), out_specs=P())(x)
    (g,) = torch.autograd.grad(out, x)
    assert seen == {"same": True, "other": True}
    assert g.dtype == torch.float32 and torch.allclose(g, 2 * x.detach())


@pytest.mark.parametrize("op", ["resize_", "resize_as_", "as_strided_", "set_", "storage_offset", "offset"])
def test_storage_layout_ops_are_refused_on_body_values(op):
    """resize_ gave device 1 device 0's rows on the simulated mesh; as_strided_/resize_as_ kept the old
    per-device shape; set_ an internal error; storage_offset() and an explicit offset differed by mesh."""
    mesh = shmap.make_mesh((4,), ("i",))
    calls = {"resize_": lambda y: y.resize_(2, 3), "resize_as_": lambda y: y.resize_as_(torch.zeros(2, 3)),
             "as_strided_": lambda y: y.as_strided_((2, 3), (6, 2)), "set_": lambda y: y.set_(torch.zeros(2, 3)),
             "storage_offset": lambda y: y.storage_offset(), "offset": lambda y: y.as_strided((2, 3), (6, 1), 1)}

    def body(x):
        y = x * 1
        calls[op](y)
        return y

    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"on a shard_map body value: its storage is laid "
                                                                   r"out by the mesh.*Fix: build the value"):
        shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.arange(48.0).reshape(8, 6))


def test_as_strided_without_an_offset_is_per_device():
    mesh = shmap.make_mesh((4,), ("i",))
    x = torch.arange(48.0).reshape(8, 6)
    out = shmap.shard_map(lambda v: (v * 1).as_strided((2, 3), (6, 2)), mesh=mesh, in_specs=P("i"),
                          out_specs=P("i"))(x)
    assert torch.equal(out, torch.cat([(b * 1).as_strided((2, 3), (6, 2)) for b in x.chunk(4)]))


def test_assigning_grad_and_data_of_a_varying_value_sets_them():
    """`opt.zero_grad()` sets `p.grad = None`; `p.grad = g` and `p.data = t` were set on the wrapper and
    ignored on the simulated mesh, so the next backward accumulated onto the old gradient."""
    mesh = shmap.make_mesh((4,), ("i",))

    def body(w):
        with torch.enable_grad():
            p = (w * 1).detach().requires_grad_()
            (p * 2).sum().backward()
            p.grad = None
            (p * 1).sum().backward()
            first = p.grad.clone()
            p.grad = p.detach() * 0 + 6
            given = p.grad.clone()
            p.data = p.detach() * 0 + 7
            return first, given, p.detach() * 1

    first, given, data = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.zeros(8))
    assert torch.equal(first, torch.ones(8)) and torch.equal(given, torch.full((8,), 6.0))
    assert torch.equal(data, torch.full((8,), 7.0))


def test_a_lifted_weight_follows_updates_made_through_another_handle():
    """A weight's automatic pvary is memoised; an update through `.data`, a view, `detach()` or a foreach op
    on `.data` left it stale (a promoted float32 weight times float64 data kept its first value: manual SGD
    trained on the first step's weights), or, unpromoted, failed in torch's view+inplace check."""
    mesh = shmap.make_mesh((2,), ("i",))
    for update in (lambda p: p.data.add_(1), lambda p: p.view(-1).add_(1), lambda p: p.detach().add_(1),
                   lambda p: torch._foreach_add_([p.data], 1)):
        for dtype in (torch.float64, torch.float32):
            def body(w, x):
                p = w * 1
                first = x * p
                with torch.no_grad():
                    update(p)
                return first, x * p

            w = torch.ones(3, dtype=dtype).requires_grad_()
            first, second = shmap.shard_map(body, mesh=mesh, in_specs=(P(), P("i")), out_specs=(P("i"), P("i")))(
                w, torch.ones(4, 3, dtype=torch.float64))
            assert torch.equal(first, torch.ones(4, 3, dtype=torch.float64)), dtype
            assert torch.equal(second, torch.full((4, 3), 2.0, dtype=torch.float64)), dtype


@pytest.mark.parametrize("op", ["add", "mul", "maximum", "where"])
@pytest.mark.parametrize("wide, narrow", [(torch.float64, torch.float32), (torch.int64, torch.int32)])
def test_mixed_dtypes_promote_as_torch_does_on_the_per_device_values(op, wide, narrow):
    """An invariant 0-d value and a varying 0-d value of another dtype: torch's promotion of the per-device
    values (a 0-d tensor sets the dtype beside another 0-d one), as the distributed mesh and JAX do.  On the
    simulated mesh the varying value is physically 1-d and the invariant one 0-d, so the narrower dtype won."""
    mesh = shmap.make_mesh((4,), ("i",))
    fns = {"add": torch.add, "mul": torch.mul, "maximum": torch.maximum,
           "where": lambda a, b: torch.where(b > 1, a, b)}
    fn = fns[op]

    def body(v):
        s = shmap.psum(v.sum(), "i").to(wide)  # invariant, 0-d
        k = (shmap.axis_index("i") * 3 + 1).to(narrow)  # varying, 0-d
        assert s.dim() == k.dim() == 0
        return fn(s, k).reshape(1)

    got = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.arange(4.0))
    total = torch.tensor(6.0).to(wide)
    want = torch.stack([fn(total, torch.tensor(i * 3 + 1).to(narrow)) for i in range(4)])
    assert got.dtype == want.dtype == wide
    assert torch.equal(got, want)


def test_a_view_of_an_elementwise_result_works_as_on_each_device_and_aliases():
    """`(a * 2).view(-1)` for an argument split along dim 1: a device holds the product as a fresh
    contiguous block and views it; the simulated mesh's result interleaved the devices' rows, and torch
    refused the view.  The value gets device-major memory once; the view and the value then share it."""
    x = torch.arange(32.0).reshape(4, 8).requires_grad_()
    blocks = list(x.detach().chunk(4, 1))

    def body(a):
        b = torch.relu(a) * 2
        assert b.is_contiguous()
        v = b.view(-1)
        v.add_(1)  # through the view: b sees it, as on a device
        b.mul_(10)  # through the value: v sees it
        return v + 0 * b.view_as(v), b

    flat, whole = sm(body, (P(None, "i"),), (P("i"), P(None, "i")))(x)
    want_b = [(torch.relu(a) * 2 + 1) * 10 for a in blocks]
    assert torch.equal(flat, torch.cat([w.reshape(-1) for w in want_b]))
    assert torch.equal(whole, torch.cat(want_b, 1))
    y = x.detach().clone().requires_grad_()
    sm(lambda a: (torch.relu(a) * 2).view(-1), (P(None, "i"),), P("i"))(y).pow(2).sum().backward()
    assert torch.equal(y.grad, 8 * torch.relu(y.detach()))


def test_a_view_the_device_block_cannot_take_raises_as_torch_does():
    """A permuted result (`a.t() * 2`) and the argument itself (a slice with gaps on a device) have no
    per-device view: torch's error, on each device as here."""
    x = torch.arange(32.0).reshape(4, 8)
    for f in (lambda a: (a.t() * 2).view(-1), lambda a: a.view(-1)):
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            f(x[:, :2])  # one device's block
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            sm(f, (P(None, "i"),), P("i"))(x)


def test_a_format_spec_formats_an_invariant_value_as_torch_does():
    """`f"{loss:.2f}"` in a body gave the multi-line repr; torch formats a 0-d tensor's number."""
    mesh = shmap.make_mesh((4,), ("i",))
    seen = {}

    def body(a):
        s = shmap.psum(a.sum(), "i")
        seen["spec"], seen["plain"] = f"{s:.2f}", f"{s}"
        with pytest.raises(shmap.VaryingControlFlowError, match=r"`format\(x, '\.2f'\)`"):
            f"{a.sum():.2f}"
        with pytest.raises(TypeError, match="unsupported format string"):  # as torch for a 1-d tensor
            f"{shmap.psum(a, 'i'):.2f}"
        return s

    shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())(torch.arange(8.0))
    assert seen["spec"] == f"{torch.tensor(28.0):.2f}" == "28.00"
    assert seen["plain"].startswith("ShTensor(per-device shape (), float64, invariant")
