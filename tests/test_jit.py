"""shmap.jit (shmap/jit.py): capture once per key, replay; equal to eager in values, gradients
and comm_log events; retraces exactly when the key changes; clear errors where a replay would
be wrong.  Most captures use backend="eager" (FX replay, bit-identical to eager, no compile
time); a few use Inductor, the default."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as cp

import custom_functions
import shmap
from shmap import P
from shmap.jit import JitError

MESH = shmap.make_mesh((4, 2), ("i", "j"), distributed=False)  # (also imported by the spawned ranks)


def ejit(f, **kw):
    return shmap.jit(f, backend="eager", **kw)


@pytest.fixture(autouse=True)
def _seed():
    """A fixed seed, and float32 by default (other test modules set float64 when imported, and a test
    that retraces on a dtype change needs `.double()` to change it)."""
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(before)


def _matmuls():
    basic = shmap.shard_map(lambda a, b: shmap.psum(a @ b, "j"), mesh=MESH,
                            in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", None))
    rs = shmap.shard_map(lambda a, b: shmap.psum_scatter(a @ b, "j", scatter_dimension=1, tiled=True),
                         mesh=MESH, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", "j"))
    return basic, rs


def _events(fn, *args):
    with shmap.comm_log() as log:
        out = fn(*args)
    return out, log.events


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_seed_matmuls_equal_eager_and_plain(backend):
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    for f in _matmuls():
        want, want_ev = _events(f, a, b)
        j = shmap.jit(f, backend=backend)
        for _ in range(3):  # the capture's call, then replays: the same events every call
            got, ev = _events(j, a, b)
            assert ev == want_ev and len(ev) == 1
            if backend == "eager":
                assert torch.equal(got, want)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got, a @ b)
        assert j.traces == 1


def test_no_log_active_records_nothing_and_nested_logs_both_record():
    f, _ = _matmuls()
    j = shmap.jit(f)
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    j(a, b)
    with shmap.comm_log() as outer:
        with shmap.comm_log() as inner:
            j(a, b)
    assert outer.events == inner.events and len(inner.events) == 1


def _grads(fn, args, create_graph=False):
    args = [x.detach().requires_grad_() for x in args]
    with shmap.comm_log() as log:
        out = fn(*args)
        gs = torch.autograd.grad(out.sum() if out.dim() else out, args, create_graph=create_graph)
    return out.detach(), gs, log.events


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_gradients_equal_eager_and_plain(backend):
    """Inputs that require grad: AOT autograd's forward and backward (the backward's psum of the
    automatic pvary's transpose is recorded, as eagerly)."""
    for f in _matmuls():
        args = [torch.randn(8, 16), torch.randn(16, 32)]
        want = _grads(f, args)
        j = shmap.jit(f, backend=backend)
        for _ in range(2):
            got = _grads(j, args)
            torch.testing.assert_close(got[0], want[0])
            for x, y in zip(got[1], want[1]):
                torch.testing.assert_close(x, y)
            assert got[2] == want[2]
        plain = _grads(lambda a, b: a @ b, args)
        for x, y in zip(got[1], plain[1]):
            torch.testing.assert_close(x, y)


def _mlp():
    mesh = shmap.make_mesh((8,), ("batch",))

    @shmap.shard_map(mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P())
    def loss(ps, x, t):
        h = torch.tanh(x @ ps[0] + ps[1])
        return shmap.pmean(((h @ ps[2] - t) ** 2).mean(), "batch")

    ps = [torch.randn(4, 8), torch.randn(8), torch.randn(8, 2)]
    return loss, ps, torch.randn(16, 4), torch.randn(16, 2)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_functional_training_step(backend):
    """value and grad inside the captured function: one graph, forward and backward."""
    loss, ps, x, t = _mlp()

    def step(ps, x, t):
        grads, value = torch.func.grad_and_value(loss)(ps, x, t)
        return value, [p - 0.1 * g for p, g in zip(ps, grads)]

    want, want_ev = _events(step, ps, x, t)
    j = shmap.jit(step, backend=backend)
    for _ in range(2):
        got, ev = _events(j, ps, x, t)
        torch.testing.assert_close(got, want)
        assert ev == want_ev and len(ev) == 4  # the loss psum, one psum per parameter
    plain_loss = lambda ps, x, t: ((torch.tanh(x @ ps[0] + ps[1]) @ ps[2] - t) ** 2).mean()  # noqa: E731
    pg, pv = torch.func.grad_and_value(plain_loss)(ps, x, t)
    torch.testing.assert_close(got[0], pv)
    torch.testing.assert_close(got[1], [p - 0.1 * g for p, g in zip(ps, pg)])


def test_autograd_inside_the_function():
    """torch.autograd.grad inside, inputs requiring grad or not: captured (AOT autograd, make_fx)."""
    loss, ps0, x, t = _mlp()

    def step(ps, x, t):
        ps = [p if p.requires_grad else p.detach().requires_grad_() for p in ps]
        with torch.enable_grad():
            value = loss(ps, x, t)
            return value.detach(), torch.autograd.grad(value, ps)

    ps = [p.clone().requires_grad_() for p in ps0]
    want, want_ev = _events(step, ps, x, t)
    j = ejit(step)
    for args in [(ps0, x, t), (ps, x, t), (ps, x, t)]:
        got, ev = _events(j, *args)
        torch.testing.assert_close(got, want)
        assert ev == want_ev
    assert j.traces == 2


def test_uncapturable_call_runs_eagerly_with_a_warning():
    """AOT autograd cannot capture an output whose graph `f` already consumed (it would
    differentiate the freed graph again): the documented rule, that signature runs eagerly."""
    loss, ps0, x, t = _mlp()
    ps = [p.clone().requires_grad_() for p in ps0]

    def step(ps, x, t):
        value = loss(ps, x, t)
        return value, torch.autograd.grad(value, ps)

    want, want_ev = _events(step, ps, x, t)
    j = ejit(step)
    with pytest.warns(UserWarning, match="could not capture.*run the function eagerly"):
        got, ev = _events(j, ps, x, t)
    for _ in range(2):
        torch.testing.assert_close(got, want)
        assert ev == want_ev
        got, ev = _events(j, ps, x, t)
    assert j.traces == 1


class Cube(custom_functions.Cube):
    """A custom backward (3x too big): a replay must run it, not the derivative of forward."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 9 * x ** 2 * g


def test_custom_function_and_checkpoint_gradients_equal_eager():
    def body(w, x):
        h = cp.checkpoint(lambda u: shmap.psum(torch.tanh(u @ w), "j"), x, use_reentrant=False)
        return shmap.psum(Cube.apply(h).sum(), ("i", "j"))

    f = shmap.shard_map(body, mesh=MESH, in_specs=(P("j"), P("i", "j")), out_specs=P())
    args = [torch.randn(4, 3), torch.randn(8, 4)]
    want = _grads(f, args)
    got = _grads(ejit(f), args)
    torch.testing.assert_close(got[0], want[0])
    for x, y in zip(got[1], want[1]):
        torch.testing.assert_close(x, y)
    assert got[2] == want[2]


def test_double_backward_is_a_clear_error():
    """Refused at the create_graph pass (AOT autograd's own refusal came at the second grad, or, for some
    programs, never: see the next test)."""
    f, _ = _matmuls()
    args = [torch.randn(8, 16).requires_grad_(), torch.randn(16, 32).requires_grad_()]
    with pytest.raises(shmap.JitError, match="create_graph=True"):
        torch.autograd.grad(ejit(f)(*args).pow(2).sum(), args, create_graph=True)


def test_cache_hits_and_retraces():
    f, _ = _matmuls()
    j = ejit(f)
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    j(a, b), j(a.clone(), b.clone())
    assert j.traces == 1                                      # same key: a hit
    j(torch.randn(16, 16), b)
    assert j.traces == 2                                      # shape
    j(a.double(), b.double())
    assert j.traces == 3                                      # dtype
    out = j(a.requires_grad_(), b)
    assert j.traces == 4 and out.requires_grad                # requires_grad
    with torch.no_grad():
        out = j(a, b)
    assert j.traces == 5 and not out.requires_grad            # grad mode
    j(a.detach().t().contiguous().t(), b)
    assert j.traces == 6                                      # strides
    j(a.detach(), b), j(torch.randn(16, 16), b)
    assert j.traces == 6                                      # all cached
    torch.testing.assert_close(j(a.detach().t().contiguous().t(), b), f(a.detach(), b))
    sq = torch.randn(16, 16)
    j(sq, sq.clone())
    assert j.traces == 7
    torch.testing.assert_close(j(sq, sq), f(sq, sq))             # the same tensor twice: its own key
    assert j.traces == 8


def test_max_entries_and_clear():
    mesh = shmap.make_mesh((4,), ("i",))
    j = ejit(shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()),
             max_entries=2)
    for n in (4, 8, 12, 8, 4):  # 4 is forgotten when 12 arrives
        torch.testing.assert_close(j(torch.ones(n)), torch.full((n // 4,), 4.0))
    assert j.traces == 4
    j.clear()
    j(torch.ones(4))
    assert j.traces == 5


def test_a_capture_keeps_no_argument_alive():
    """The captured (AOT autograd) function closed over the first call's arguments: each cache entry
    kept its batch alive (8 batch sizes: 8 batches held) until `clear()`."""
    import gc
    import weakref

    mesh = shmap.make_mesh((2,), ("i",))
    loss = shmap.shard_map(lambda w, x: shmap.pmean((x @ w).sum(), "i"), mesh=mesh, in_specs=(P(), P("i")),
                           out_specs=P())
    step = shmap.jit(lambda w, x: loss(w, x), backend="eager")
    w = torch.randn(3, 2, requires_grad=True)
    refs = []
    for n in (2, 4):
        x = torch.randn(n, 3)
        step(w, x).backward()
        refs.append(weakref.ref(x))
        del x
    gc.collect()
    assert step.traces == 2 and [r() for r in refs] == [None, None]


def test_static_arguments_pytrees_and_constant_outputs():
    mesh = shmap.make_mesh((4,), ("i",))

    def g(d, scale, *, mode):
        f = shmap.shard_map(lambda x: shmap.psum(x * scale, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
        y = f(d["x"]) + d["y"]
        return {"y": y if mode == "plain" else -y, "mode": mode, "n": 3}

    j = ejit(g)
    d = {"x": torch.randn(8), "y": torch.randn(2)}
    for scale, mode in [(2, "plain"), (2, "plain"), (2.0, "plain"), (3, "neg"), (2, "plain")]:
        got = j(d, scale, mode=mode)
        want = g(d, scale, mode=mode)
        assert got["mode"] == mode and got["n"] == 3
        assert torch.equal(got["y"], want["y"])
    assert j.traces == 3  # 2 and 2.0 are different keys (types differ); 3/"neg" a third
    with pytest.raises(JitError, match="not hashable"):
        j(d, 2, mode={"a", "b"})


@pytest.mark.parametrize("requires_grad", [False, True])
def test_numbers_and_tensor_literals_are_static(requires_grad):
    """A number passed to a shard_map and a tensor made from Python data are fresh each call."""
    mesh = shmap.make_mesh((4,), ("i",))
    f = shmap.shard_map(lambda x, s: shmap.psum(x * s, "i"), mesh=mesh, in_specs=(P("i"), P()), out_specs=P())

    def g(x, s):
        return f(x, s) + torch.tensor([1.0, 2.0])

    x = torch.randn(8, requires_grad=requires_grad)
    j = ejit(g)
    for s in (2.0, 2.0, 3.0):
        torch.testing.assert_close(j(x, s), g(x, s))
    assert j.traces == 2


def test_closed_over_tensor_is_a_clear_error():
    mesh = shmap.make_mesh((4,), ("i",))
    w = torch.randn(3)
    f = shmap.shard_map(lambda v: shmap.psum(v @ w, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    with pytest.raises(JitError, match="closes over.*pass it as an argument"):
        ejit(f)(torch.randn(8, 3))
    g = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    with pytest.raises(JitError, match="closes over.*pass it as an argument"):
        ejit(lambda v: g(v) * w[:2])(torch.randn(8))
    with pytest.raises(JitError, match="closes over"):  # differentiable calls too
        ejit(lambda v: g(v) * w[:2])(torch.randn(8, requires_grad=True))


def test_value_dependent_python_is_a_clear_error():
    mesh = shmap.make_mesh((4,), ("i",))
    g = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())

    def f(v):
        s = g(v)
        return s * 2 if s.sum().item() > 0 else s

    with pytest.raises(JitError, match="depends on tensor values"):
        ejit(f)(torch.randn(8))


def test_inplace_update_of_an_input_outside_the_body():
    loss, ps0, x, t = _mlp()

    def sgd(ps, x, t):
        grads, value = torch.func.grad_and_value(loss)(ps, x, t)
        for p, g in zip(ps, grads):
            p.sub_(0.1 * g)
        return value

    for backend in ("eager", "inductor"):
        ps_e = [p.clone() for p in ps0]
        ps_j = [p.clone() for p in ps0]
        j = shmap.jit(sgd, backend=backend)
        for _ in range(3):
            torch.testing.assert_close(j(ps_j, x, t), sgd(ps_e, x, t))
        torch.testing.assert_close(ps_j, ps_e)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_views_of_one_tensor_mutated_replay_as_eager(backend):
    """Which arguments share a storage is part of the key, and Inductor's inner compile (which takes
    distinct inputs) is not used for such a call: `b` read after `a.add_(1)` wrote it gave zeros."""
    def f(a, b):
        a.add_(1)
        return b * 2

    j = shmap.jit(f, backend=backend)
    for aliased in (False, True, False, True):
        y, y2 = torch.zeros(3, 4), torch.zeros(3, 4)
        got = j(y, y[0] if aliased else torch.zeros(4))
        want = f(y2, y2[0] if aliased else torch.zeros(4))
        assert torch.equal(got, want) and torch.equal(y, y2), (aliased, got, want)
    assert j.traces == 2


def test_static_floats_are_keyed_by_their_bits():
    """0.0 == -0.0, but 1 / 0.0 and 1 / -0.0 differ: one trace served both."""
    mesh = shmap.make_mesh((4,), ("i",))
    f = shmap.shard_map(lambda a, s: shmap.psum(a / s, "i"), mesh=mesh, in_specs=(P("i"), None), out_specs=P())
    j = ejit(f)
    x = torch.ones(8)
    for s in (0.0, -0.0, 0.0, float("nan"), float("nan"), -0.0):
        assert torch.allclose(j(x, s), f(x, s), equal_nan=True)
    assert torch.equal(j(x, -0.0), torch.full((2,), -float("inf")))
    assert j.traces == 3  # 0.0, -0.0, nan (a nan key equals itself)


def test_inlined_under_transforms_traces_and_bodies():
    f, _ = _matmuls()
    j = ejit(f)
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    # torch.func transforms: run f itself
    torch.testing.assert_close(torch.func.grad(lambda a: j(a, b).sum())(a),
                               torch.func.grad(lambda a: f(a, b).sum())(a))
    torch.testing.assert_close(torch.func.vmap(j, in_dims=(None, 0))(a, torch.stack([b, b])),
                               torch.stack([f(a, b)] * 2))
    # torch.compile: Dynamo inlines f into its graph
    with shmap.comm_log() as log:
        got = torch.compile(j, fullgraph=True, backend="aot_eager")(a, b)
    assert torch.equal(got, f(a, b)) and log.summary() == {"psum": 1}
    # inside a running body: a nested shard_map, called eagerly
    outer = shmap.shard_map(lambda u: u * j(a, b).sum(), mesh=shmap.make_mesh((2,), ("k",)),
                            in_specs=P(), out_specs=P())
    torch.testing.assert_close(outer(torch.ones(())), f(a, b).sum())
    assert j.traces == 0


def test_random_ops_follow_the_global_generator_in_eager_backend():
    mesh = shmap.make_mesh((4,), ("i",))
    f = shmap.shard_map(lambda x: shmap.psum(x + torch.randn(x.shape), "i"), mesh=mesh,
                        in_specs=P("i"), out_specs=P())
    x = torch.randn(8)
    torch.manual_seed(1)
    want = [f(x) for _ in range(3)]
    j = ejit(f)
    torch.manual_seed(1)
    got = [j(x) for _ in range(3)]
    torch.testing.assert_close(got, want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        shmap.jit(lambda x: x, backend="xla")
    with pytest.raises(TypeError, match="callable"):
        shmap.jit(3)
    assert shmap.jit(backend="eager")(lambda x: x + 1)(torch.ones(2)).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_entries_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_entries must be a positive int"):
        shmap.jit(lambda x: x, max_entries=bad)


def test_a_double_backward_through_a_captured_call_is_refused_naming_the_fix():
    """create_graph=True through a differentiable capture: its gradient came back without a graph, so the
    second grad failed with torch's "appears to not have been used in the graph" (or, with allow_unused,
    gave None).  A first-order backward is unchanged."""
    mesh = shmap.make_mesh((2,), ("i",))
    loss = shmap.shard_map(lambda w, x: shmap.pmean((torch.tanh(x @ w) ** 2).sum(), "i"), mesh=mesh,
                           in_specs=(P(), P("i")), out_specs=P())
    f = shmap.jit(loss)
    w, x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True), torch.randn(4, 3, dtype=torch.float64)
    g, = torch.autograd.grad(f(w, x), w)
    torch.testing.assert_close(g, torch.autograd.grad(loss(w, x), w)[0])
    with pytest.raises(shmap.JitError, match=r"create_graph=True .* Fix: call the function itself, or "
                                             r"jit\(\.\.\.\)\.eager"):
        torch.autograd.grad(f(w, x), w, create_graph=True)
    g2, = torch.autograd.grad(f.eager(w, x), w, create_graph=True)  # (the fix)
    assert g2.requires_grad


def test_a_differentiable_capture_does_not_recompute_attention_in_its_backward():
    """AOT autograd's default partitioner put a second `scaled_dot_product_attention` forward in the
    backward graph (a Transformer step ran attention's forward twice); the min-cut partitioner, as
    torch.compile's, saves what the backward needs.  Counted over a replay's forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g, requires_grad=True) for _ in range(3))
    j = ejit(attend)
    torch.autograd.grad(j(q, k, v), (q, k, v))  # the capture
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        grads = torch.autograd.grad(j(q, k, v), (q, k, v))
    calls = {e.key: e.count for e in prof.key_averages() if "scaled_dot_product" in e.key and "backward" not in e.key
             and e.key.startswith("aten::_")}
    assert sum(calls.values()) == 1, calls
    want = torch.autograd.grad(attend(q, k, v), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(grads, want))


def test_reading_a_closed_over_tensor_s_value_is_refused():
    """`scale.item()` of a tensor the function closes over: the capture without gradients froze the number it
    read (a replay kept 2.0 after `scale.fill_(5.0)`, silently); the differentiable capture refused the
    tensor.  Both refuse now.  A number passed as an argument, or made in the function, is read per key."""
    mesh = shmap.make_mesh((2,), ("i",))
    scale = torch.tensor(2.0)
    f = shmap.shard_map(lambda x: shmap.psum(x * scale.item(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    with pytest.raises(shmap.JitError, match=r"reads the value of a tensor it closes over.*Fix: pass the tensor"):
        shmap.jit(f, backend="eager")(torch.ones(4))
    g = shmap.shard_map(lambda x, k: shmap.psum(x * k.item() * torch.tensor(3.0).item(), "i"), mesh=mesh,
                        in_specs=(P("i"), P()), out_specs=P())
    jg = shmap.jit(g, backend="eager")
    assert jg(torch.ones(4), 2.0).tolist() == [12.0, 12.0] and jg(torch.ones(4), 5.0).tolist() == [30.0, 30.0]
