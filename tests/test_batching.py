"""Decompositions used when an op without a functorch batching rule runs over devices."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import shmap
from shmap import P

MESH = shmap.make_mesh((4,), ("i",))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
def test_losses_match_torch_without_the_slow_fallback(fn, reduction):
    x = torch.randn(8, 5, requires_grad=True)
    t = torch.randint(0, 5, (8,))
    t[3] = -100  # ignored
    if fn == "nll_loss":
        inp_fn = lambda v: F.log_softmax(v, -1)  # noqa: E731
    else:
        inp_fn = lambda v: v  # noqa: E731
    loss = getattr(F, fn)

    def body(v, tt):
        return loss(inp_fn(v), tt, reduction=reduction)

    out_spec = P("i") if reduction == "none" else P()
    wrap = (lambda y: y) if reduction == "none" else (lambda y: shmap.psum(y, "i"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # functorch's fallback warns; the decomposition must not
        out = shmap.shard_map(lambda v, tt: wrap(body(v, tt)), mesh=MESH, in_specs=(P("i"), P("i")),
                              out_specs=out_spec)(x, t)
    blocks = [loss(inp_fn(a), b, reduction=reduction) for a, b in zip(x.chunk(4), t.chunk(4))]
    expect = torch.cat(blocks) if reduction == "none" else sum(blocks)
    torch.testing.assert_close(out, expect)
    (g,) = torch.autograd.grad(out.sum(), x)
    (ge,) = torch.autograd.grad(expect.sum(), x)
    torch.testing.assert_close(g, ge)


@pytest.mark.parametrize("case", [
    "vec+mat", "mat+vec", "mat*scalar", "where", "vec@mat", "mat@vec", "mat@mat", "inv@var", "var@var",
    "linear", "gelu",
])
def test_direct_path_matches_a_per_device_loop(case, monkeypatch):
    """Ops run straight on the physical tensors when broadcasting lines the device dims up;
    operand ranks that would misalign them must take the batched path. Both must equal a loop."""
    torch.manual_seed(0)
    n = 4
    mesh = shmap.make_mesh((n,), ("i",))
    a_vec, a_mat = torch.randn(n * 3), torch.randn(n * 2, 3)
    w_mat, w_vec = torch.randn(3, 5), torch.randn(3)
    inv_mat = torch.randn(2, 3)
    cases = {
        "vec+mat": ((a_vec, inv_mat), (P("i"), P()), lambda x, y: x + y),
        "mat+vec": ((a_mat, w_vec), (P("i"), P()), lambda x, y: x + y),
        "mat*scalar": ((a_mat,), (P("i"),), lambda x: x * 3.0 - 1),
        "where": ((a_mat, w_vec), (P("i"), P()), lambda x, y: torch.where(x > 0, x, y)),
        "vec@mat": ((a_vec, w_mat), (P("i"), P()), lambda x, y: x @ y),
        "mat@vec": ((a_mat, w_vec), (P("i"), P()), lambda x, y: x @ y),
        "mat@mat": ((a_mat, w_mat), (P("i"), P()), lambda x, y: torch.matmul(x, y)),
        "inv@var": ((inv_mat, torch.randn(n * 3, 4)), (P(), P("i")), lambda x, y: x @ y),
        "var@var": ((a_mat, torch.randn(n * 3, 4)), (P("i"), P("i")), lambda x, y: x @ y),
        "linear": ((a_mat, torch.randn(5, 3), torch.randn(5)), (P("i"), P(), P()), F.linear),
        "gelu": ((a_mat,), (P("i"),), lambda x: F.gelu(x, approximate="tanh")),
    }
    args, specs, fn = cases[case]
    batched = []
    original = shmap.batching.run_batched
    monkeypatch.setattr(shmap.batching, "run_batched", lambda func, leaves, treedef, b, out_paxes, body: (
        batched.append(func) if out_paxes else None) or original(func, leaves, treedef, b, out_paxes, body))
    out = shmap.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("i"))(*args)
    per_dev = []
    for d in range(n):
        blk = [a.chunk(n)[d] if s == P("i") else a for a, s in zip(args, specs)]
        per_dev.append(fn(*blk))
    torch.testing.assert_close(out, torch.cat(per_dev))
    # Misaligning ranks (a vector plus a matrix) must run batched over the devices (vmap); the
    # aligned cases straight on the physical tensors.
    assert bool(batched) == (case == "vec+mat"), batched


# Batched matmuls whose per-device batch size equals the device count: a direct
# (vmap-free) call would broadcast the device dim against a batch dim and give a
# silently wrong answer, so these must take the batched path (regression).
@pytest.mark.parametrize("case", ["both_vary_ranks_differ", "invariant_left_batched"])
def test_direct_matmul_never_pairs_a_device_dim_with_a_batch_dim(case):
    mesh = shmap.make_mesh((4,), ("t",))
    h = torch.randn(4, 3, 8, dtype=torch.float64)        # per-device batch 4 == the axis size
    w = torch.randn(4, 8, 5, dtype=torch.float64)        # one (8, 5) block per device along 't'
    if case == "both_vary_ranks_differ":
        in_specs = (P("t"), P("t"))                      # h varies too: block (1, 3, 8)
        h = torch.randn(16, 3, 8, dtype=torch.float64)
        expect = torch.cat([hb @ wb for hb, wb in zip(h.chunk(4), w)])
    else:
        in_specs = (P(), P("t"))                          # h invariant (the TP column-parallel case)
        expect = torch.cat([h @ wb for wb in w])
    f = shmap.shard_map(lambda a, b: a @ b[0], mesh=mesh, in_specs=in_specs, out_specs=P("t"))
    torch.testing.assert_close(f(h, w), expect)


def test_attention_runs_direct_over_device_dims():
    """scaled_dot_product_attention folds the device dims into its batch (the fused kernel, no fallback)."""
    mesh = shmap.make_mesh((2, 2), ("b", "h"))
    q, k, v = (torch.randn(4, 4, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    body = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = shmap.shard_map(body, mesh=mesh, in_specs=(P("b", "h"),) * 3, out_specs=P("b", "h"))(q, k, v)
    expect = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expect)
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    ge = torch.autograd.grad(expect.square().sum(), (q, k, v))
    for a, b in zip(g, ge):
        torch.testing.assert_close(a, b)


# Projections whose operands vary along different axes (the tensor-parallel x @ w_column with x
# invariant along 'T') run as one einsum over the physical blocks: values and gradients as plain torch.
@pytest.mark.parametrize("form", ["matmul", "einsum"])
@pytest.mark.parametrize("xs, ws, outs", [
    (P("F"), P(None, "T"), P("F", None, "T")),
    (P(), P(None, "T"), P(None, None, "T")),
    (P("F"), P(), P("F")),
    (P(("F", "T")), P(), P(("F", "T"))),
    (P("T"), P(None, "F"), P("T", None, "F")),
])
def test_projection_of_operands_varying_along_different_axes(form, xs, ws, outs):
    mesh = shmap.make_mesh((2, 4), ("F", "T"))
    x = torch.randn(8, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    body = (lambda a, b: a @ b) if form == "matmul" else (lambda a, b: torch.einsum("bsd,dh->bsh", a, b))
    with shmap.comm_log() as log:
        out = shmap.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=outs)(x, w)
        torch.testing.assert_close(out, x @ w)
        gx, gw = torch.autograd.grad(out.square().sum(), (x, w))
    ex, ew = torch.autograd.grad((x @ w).square().sum(), (x, w))
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
    # the automatic pvary's transposes: a psum for each operand along the axes the other varies along
    expect = int(bool(set(str(ws)) & {"T", "F"} - set(str(xs)))) + int(bool(set(str(xs)) & {"T", "F"} - set(str(ws))))
    assert log.count("psum") == expect


# Reductions and dtype conversions run straight on the physical tensor over the per-device dims
# (no vmap): the same values, bit for bit, as the batched path, for every way of naming the dims.
@pytest.mark.parametrize("call", [
    lambda x: x.sum(), lambda x: x.mean(), lambda x: x.sum(-1), lambda x: x.sum(0, keepdim=True),
    lambda x: x.mean((0, -1)), lambda x: torch.sum(x, dim=[1], keepdim=True), lambda x: x.sum(dim=()),
    lambda x: torch.mean(x, -2, True), lambda x: x.sum(1, dtype=torch.float64), lambda x: x.to(torch.float64),
    lambda x: x.to(dtype=torch.float16).float(),
], ids=["sum()", "mean()", "sum(-1)", "sum(0,keepdim)", "mean((0,-1))", "sum(dim=[1],keepdim)", "sum(dim=())",
        "mean(-2,True)", "sum(1,dtype)", "to(f64)", "to(dtype=f16)"])
def test_reductions_and_conversions_run_direct_with_the_batched_values(call, monkeypatch):
    mesh = shmap.make_mesh((2, 2), ("a", "b"))
    x = torch.randn(4, 6, 5, requires_grad=True)
    f = shmap.shard_map(lambda v: call(v)[None], mesh=mesh, in_specs=(P(("a", "b")),), out_specs=P(("a", "b")))
    batched = []
    original = shmap.batching.run_batched
    monkeypatch.setattr(shmap.batching, "run_batched", lambda func, *a: batched.append(func) or original(func, *a))
    out = f(x)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    assert not [fn for fn in batched if fn.__name__ in ("sum", "mean", "to")], batched
    monkeypatch.setattr(shmap.batching, "DIRECT", {})
    monkeypatch.setattr(shmap.batching, "direct_ok", lambda *a: False)
    expect = f(x)
    (ge,) = torch.autograd.grad(expect.square().sum(), x)
    assert torch.equal(out, expect) and torch.equal(g, ge)
    torch.testing.assert_close(out, torch.cat([call(b)[None] for b in x.chunk(4)]))


def test_a_reduction_out_of_range_takes_the_batched_path_and_its_message():
    with pytest.raises(IndexError, match=r"range of \[-2, 1\]"):
        shmap.shard_map(lambda v: v.sum(2), mesh=MESH, in_specs=(P("i"),), out_specs=P("i"))(torch.randn(8, 3))


def test_attention_on_q_k_v_sliced_from_one_projection_folds_the_batch_into_the_heads(monkeypatch):
    """q, k, v from `qkv.unbind(0)` cannot merge the device dims with the batch without a copy; the
    batch folds into the heads as a view instead, with the same bits (values and gradients)."""
    mesh = shmap.make_mesh((2, 2), ("F", "T"))
    torch.manual_seed(3)
    x = torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)          # (b, s, d), split over F
    w = torch.randn(3, 16, 4, 8, dtype=torch.float64, requires_grad=True)       # (t, d, heads, k), over T

    def body(x, w):
        q, k, v = torch.einsum("bsd,tdhk->tbhsk", x, w).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    f = shmap.shard_map(body, mesh=mesh, in_specs=(P("F"), P(None, None, "T")), out_specs=P("F", "T"))
    copies = []
    original = shmap.batching._sdpa_4d
    monkeypatch.setattr(shmap.batching, "_sdpa_4d", lambda qkv: copies.append(
        [r._base is None for r in original(qkv)]) or original(qkv))
    out = f(x, w)
    got = (out, *torch.autograd.grad(out.sin().sum(), (x, w)))
    assert copies == [[False, False, False]]  # views of the projection
    monkeypatch.setattr(shmap.batching, "_sdpa_4d", lambda qkv: [t.reshape((-1,) + t.shape[-3:]) for t in qkv])
    out = f(x, w)
    expect = (out, *torch.autograd.grad(out.sin().sum(), (x, w)))
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


def _both(body, x, spec=P("i")):
    """(shard_mapped body on MESH, the same per-device computation in plain torch, stacked)."""
    got = shmap.shard_map(body, mesh=MESH, in_specs=spec, out_specs=P("i"))(x)
    want = torch.cat([body(b) for b in x.chunk(4)])
    return got, want


def test_mm_of_a_varying_block():
    """`torch.mm` on a block with device dims (3-d) failed ("self must be a matrix"): not direct."""
    w = torch.randn(3, 5)
    got, want = _both(lambda v: torch.mm(v, w), torch.randn(8, 3))
    torch.testing.assert_close(got, want)


def test_zero_d_varying_operands_promote_as_plain_torch():
    """vmap promoted a batched 0-d operand as a full tensor: where / clamp / addcmul of float16 and a
    varying float64 scalar came back float64 (plain torch and processes: float16)."""
    def body(v):
        h, s = v.half(), v.sum().double()
        outs = (torch.where(v > 0, h, s), torch.clamp(h, min=s), torch.addcmul(h, h, s), torch.addcdiv(h, h, s + 9))
        return torch.stack([o.float() for o in outs]) if all(o.dtype == torch.float16 for o in outs) else None

    got, want = _both(lambda v: body(v).reshape(1, -1), torch.randn(8, 3))
    torch.testing.assert_close(got, want)


def test_autocast_casts_as_on_one_device():
    """Under torch.autocast ops vmap batched lost autocast's casts (addmm, conv1d came back float32,
    cross_entropy's decomposition bfloat16), and an einsum's backward crashed on mixed dtypes."""
    f32 = dict(dtype=torch.float32)  # (autocast casts float32; other test modules make float64 the default)
    w, b = torch.randn(6, 5, **f32), torch.randn(5, **f32)
    cw = torch.randn(4, 1, 3, **f32)
    t = torch.tensor([0, 1])

    def body(v):
        return (torch.addmm(b, v, w).dtype, F.conv1d(v.unsqueeze(1), cw).dtype,
                F.cross_entropy(v[:, :5], t).dtype)

    x = torch.randn(8, 6, **f32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = body(x[:2])
        seen = []
        shmap.shard_map(lambda v: seen.append(body(v)) or v, mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x)
    assert seen == [want] == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    wp = torch.randn(8, 5, **f32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (a row-parallel projection: the tensor=N layout)
        out = shmap.shard_map(lambda v, w: shmap.psum(torch.einsum("ab,bc->ac", v, w), "i"), mesh=MESH,
                              in_specs=(P(None, "i"), P("i")), out_specs=P())(torch.randn(6, 8, **f32), wp)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and wp.grad.dtype == torch.float32


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_region_ending_in_a_per_device_op_recomputes(use_reentrant):
    """Dropout runs device by device; as the last op of a non-reentrant checkpoint's region, its recomputation
    ends with torch's early-stop exception, which the vmap attempt took for a failure and re-ran device by
    device: "target_frame.early_stop is set" in the backward.  The gradient is the unchecked one's."""
    import torch.utils.checkpoint as cp

    mesh = shmap.make_mesh((2,), ("i",))
    drop = torch.nn.Dropout(0.5)

    def region(u):
        return drop(u * 2)

    def f(remat):
        def body(x):
            h = cp.checkpoint(region, x, use_reentrant=use_reentrant) if remat else region(x)
            return shmap.psum((h ** 2).sum(), "i")
        return shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())

    grads = []
    for remat in (False, True):
        x = torch.linspace(-1, 1, 8, dtype=torch.float64).requires_grad_()
        torch.manual_seed(0)
        f(remat)(x).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]) and (grads[0] != 0).any()
