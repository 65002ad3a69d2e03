"""`torch._foreach_*` on body values (shmap/foreach.py): each list position typed as its per-tensor op
would be, values and gradients equal to plain PyTorch, the fast path taken where it may be and
refused where a lift or a device-dim reduction makes the physical call wrong."""
from __future__ import annotations

import pytest
import torch

import shmap
import shmap.foreach as foreach
from shmap import P

MESH = shmap.make_mesh((2, 2), ("i", "j"))


def sm(body, in_specs, out_specs):
    return shmap.shard_map(body, mesh=MESH, in_specs=in_specs, out_specs=out_specs)


@pytest.fixture
def fast_calls(monkeypatch):
    """How many foreach calls took the physical fast path."""
    calls = []
    real = foreach._typed_positions

    def counting(args, kwargs, n):
        t = real(args, kwargs, n)
        calls.append(bool(t))
        return t

    monkeypatch.setattr(foreach, "_typed_positions", counting)
    return calls


def _adam_like(a, b, c):
    """Positions of different types (a varies along i, b along i and j, c is invariant)."""
    xs = [a, b, c]
    m = torch._foreach_lerp(xs, torch._foreach_mul(xs, 2.0), 0.25)
    v = torch._foreach_addcmul(torch._foreach_mul(xs, xs), xs, xs, value=0.1)
    d = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(v), 3.0), 1e-3)
    return tuple(torch._foreach_addcdiv(xs, m, d, value=-0.5))


def test_elementwise_foreach_matches_plain_pytorch_values_and_gradients(fast_calls):
    args = [torch.randn(4, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    f = sm(_adam_like, (P("i"), P("i", "j"), P()), (P("i"), P("i", "j"), P()))
    got = f(*args)
    want = _adam_like(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    cots = [torch.randn_like(w) for w in want]
    g1 = torch.autograd.grad(got, args, cots)
    g2 = torch.autograd.grad(want, args, cots)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    assert fast_calls and all(fast_calls)  # one typing per position, one physical call per op
    with torch.no_grad():
        out = f(*args)
    assert all(type(o) is torch.Tensor for o in out)


def test_each_position_keeps_its_own_type():
    seen = []

    def body(a, c):
        x, y = torch._foreach_mul([a, c], 3.0)
        seen.append((shmap.vma(x), shmap.vma(y)))
        return x, y

    a, c = torch.randn(4), torch.randn(3)
    x, y = sm(body, (P("i"), P()), (P("i"), P()))(a, c)
    torch.testing.assert_close(x, 3 * a)
    torch.testing.assert_close(y, 3 * c)
    assert seen == [(frozenset({"i"}), frozenset())]


def test_an_invariant_factor_multiplies_varying_values_and_its_gradient_is_summed(fast_calls):
    """Clipping's form: a 0-d invariant factor times varying gradients.  Outside autograd the fast
    path takes it as it is; when the factor needs a gradient, the per-tensor ops lift it (pvary), so
    its cotangent is psum'd over the devices, as plain PyTorch's is over the whole tensor."""
    a, b = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    s = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    f = sm(lambda a, b, s: tuple(torch._foreach_mul([a, b], s)), (P("i"), P("j"), P()), (P("i"), P("j")))
    x, y = f(a, b, s)
    torch.testing.assert_close(x, a * 0.7)
    torch.testing.assert_close(y, b * 0.7)
    assert fast_calls == [False]  # the factor needs a gradient: no fast path
    (gs,) = torch.autograd.grad((x * a).sum() + (y * b).sum(), s)
    torch.testing.assert_close(gs, (a * a).sum() + (b * b).sum())
    fast_calls.clear()
    with torch.no_grad():
        x, _ = f(a, b, s)
    torch.testing.assert_close(x, a * 0.7)
    assert fast_calls == [True]


def test_reductions_run_per_position_on_the_simulated_mesh(fast_calls):
    """`_foreach_norm` reduces over a tensor; the simulated mesh's physical tensor also holds the
    device dims, so it must not run as one physical call there."""
    a, b = torch.randn(4, 2), torch.randn(6)
    def body(a, b):
        na, nb = torch._foreach_norm([a, b])
        return na.reshape(1), nb
    f = sm(body, (P("i"), P()), (P("i"), P()))
    na, nb = f(a, b)
    torch.testing.assert_close(na, torch.stack([a[:2].norm(), a[2:].norm()]))
    torch.testing.assert_close(nb, b.norm())
    assert fast_calls == [True]  # typed, but `_direct` sends it per position


def test_in_place_foreach_takes_the_fast_path_after_the_in_place_checks(fast_calls):
    """torch.optim's form: in-place foreach updates of the body's own values, one physical call; an
    argument (or a view of it) is still refused, and a pvary of one gets its own copy first."""
    def body(a, b):
        t, u = a * 1.0, b * 2.0
        torch._foreach_add_([t, u], [t, u], alpha=0.5)
        torch._foreach_addcmul_([t, u], [t, u], [t, u], value=0.25)
        return t, u

    a, b = torch.randn(4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    t, u = sm(body, (P("i"), P()), (P("i"), P()))(a, b)
    for got, x in ((t, a), (u, 2 * b)):
        torch.testing.assert_close(got, 1.5 * x + 0.25 * (1.5 * x) ** 2)
    assert fast_calls == [True, True]
    with pytest.raises(shmap.InPlaceInputError, match="argument 0"):
        sm(lambda a: torch._foreach_add_([a], 1.0) or a, P("i"), P("i"))(a)
    with pytest.raises(shmap.InPlaceInputError, match="argument 0"):
        sm(lambda a: torch._foreach_add_([a[:2]], 1.0) or a, P("i"), P("i"))(a)
    c = torch.randn(3)
    before = c.clone()
    def lifted(c):
        v = shmap.pvary(c, "i")
        torch._foreach_mul_([v], 3.0)
        return v
    torch.testing.assert_close(sm(lifted, P(), P("i"))(c), (3 * before).repeat(2))
    assert torch.equal(c, before)  # the caller's tensor is untouched


def test_in_place_foreach_gradients_match_plain_pytorch():
    def f(a, b):
        t, u = a * 1.0, b * 1.0
        torch._foreach_mul_([t, u], 3.0)
        torch._foreach_addcmul_([t, u], [a, b], [a, b], value=0.5)
        return t, u

    a = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    got = sm(f, (P("i"), P()), (P("i"), P()))(a, b)
    want = f(a, b)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    cots = [torch.randn_like(w) for w in want]
    for g, w in zip(torch.autograd.grad(got, (a, b), cots), torch.autograd.grad(want, (a, b), cots)):
        torch.testing.assert_close(g, w)


def test_a_closed_over_tensor_in_a_list_is_typed_as_invariant():
    c = torch.randn(2)
    f = sm(lambda a: tuple(torch._foreach_add([a, c], [c, c])), P("i"), (P("i"), P()))
    x, y = f(torch.zeros(4))
    torch.testing.assert_close(x, c.repeat(2))
    torch.testing.assert_close(y, 2 * c)


def test_a_positional_scalar_reaches_the_per_tensor_op_as_its_keyword():
    """torch.optim's foreach Adam passes addcmul_'s scalar positionally; `Tensor.addcmul_`'s `value` is
    keyword-only.  Lists mixing body values and tensors made in the body take the per-position path."""
    def body(a):
        made = torch.ones(2)  # a plain tensor made in the body
        xs = [a * 1, made]
        torch._foreach_addcmul_(xs, xs, xs, 0.5)
        torch._foreach_addcdiv_(xs, xs, [a + 2, made + 1], torch.tensor([2.0, 4.0]))  # a tensor of scalars
        return xs[0]

    a = torch.randn(4)
    y = a + 0.5 * a * a
    torch.testing.assert_close(sm(body, P("i"), P("i"))(a), y + 2 * y / (a + 2))


def test_foreach_adam_in_a_body_over_a_parameter_made_there():
    def body(w, x):
        with torch.enable_grad():
            p, q = w.detach().clone().requires_grad_(), torch.zeros(2).requires_grad_()
            opt = torch.optim.Adam([p, q], lr=0.1, foreach=True)
            shmap.psum(((x @ p) + q).pow(2).sum(), ("i", "j")).backward()
            opt.step()
        return p.detach()

    w, x = torch.randn(3, 2), torch.randn(8, 3)
    p, q = w.clone().requires_grad_(), torch.zeros(2).requires_grad_()
    opt = torch.optim.Adam([p, q], lr=0.1, foreach=False)
    ((x @ p) + q).pow(2).sum().backward()
    opt.step()
    torch.testing.assert_close(sm(body, (P(), P(("i", "j"))), P())(w, x), p.detach())


def test_foreach_on_plain_tensors_is_untouched():
    xs = [torch.randn(3), torch.randn(2)]
    torch.testing.assert_close(torch._foreach_mul(xs, 2.0), [x * 2 for x in xs])


@pytest.mark.parametrize("make, error, words", [
    (lambda p: torch.optim.AdamW([p], fused=True), shmap.VmaError, "Fix: use the optimizer's foreach=True form"),
    (lambda p: torch.optim.Adam([p], amsgrad=True, foreach=False), TypeError, "use its foreach=True form"),
])
def test_optimizer_forms_a_body_cannot_run_name_the_one_it_can(make, error, words):
    """A fused step updates its step counts (invariant) in the call that updates varying parameters, and the
    single-tensor amsgrad step uses `out=`: both were refused with a fix the user could not apply."""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(w):
        with torch.enable_grad():
            p = (w * 1).detach().requires_grad_()
            opt = make(p)
            (p * p).sum().backward()
            opt.step()
            return p.detach()

    with pytest.raises(error, match=words):
        shmap.shard_map(body, mesh=mesh, in_specs=P(None, "i"), out_specs=P(None, "i"))(torch.ones(2, 4))
