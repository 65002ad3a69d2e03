"""torch.compile of shard_mapped functions and training steps (shmap/compile.py, shmap/ops.py).

Compiled (`fullgraph=True` where Dynamo can: everything but a `.backward()`
call) must equal eager: values, gradients, and the `comm_log` events of every
call, forward and backward.  Programs are tiny: compilation dominates, so
Inductor compiles two of them and the rest stop after AOT autograd
(`aot_eager`, which already traces through the body and the record ops).
"""
from __future__ import annotations

import collections
import typing

import optree
import pytest
import torch
import torch.utils.checkpoint as cp

import shmap
from custom_functions import Cube
from shmap import P

MESH = shmap.make_mesh((4, 2), ("i", "j"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _run(f, args, cot):
    """(outputs, grads, comm events) of one forward + backward."""
    args = [a.detach().requires_grad_() for a in args]
    with shmap.comm_log() as log:
        out = f(*args)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, cot(outs))
    return [o.detach() for o in outs], [a.grad for a in args], log.events


def _assert_compiled_equals_eager(f, args, calls=2, backend="inductor"):
    cot = lambda outs: [torch.ones_like(o) for o in outs]  # noqa: E731
    want = _run(f, args, cot)
    cf = torch.compile(f, fullgraph=True, backend=backend)
    for _ in range(calls):  # the second call runs the cached graph: same events again
        got = _run(cf, args, cot)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(a, b)
        assert got[2] == want[2]
    return want[2]


def _collectives(x, y):
    a = shmap.all_gather_invariant(x, "i", tiled=True)                       # [8, 4]
    b = shmap.psum_scatter(a * y.sum(), "j", scatter_dimension=0, tiled=True)  # [4, 4]
    c = shmap.ppermute(b, "i", [(k, (k + 1) % 4) for k in range(4)]) * shmap.axis_index("i")
    d = shmap.all_to_all(c, "i", 1, 0, tiled=True)                          # [16, 1]
    return shmap.pmean(torch.sin(d).sum(), ("i", "j")), shmap.pmax(x, "j")


def test_compiled_collectives_equal_eager():
    f = shmap.shard_map(_collectives, mesh=MESH, in_specs=(P("i", "j"), P("i")),
                        out_specs=(P(), P("i")))
    g = torch.Generator().manual_seed(0)  # float64: Inductor's reduction order differs from eager's
    args = [torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)]
    events = _assert_compiled_equals_eager(f, args)
    kinds = {e.kind for e in events}
    assert {"all_gather_invariant", "psum_scatter", "all_gather", "ppermute", "all_to_all", "psum",
            "pmax"} <= kinds


def test_compiled_custom_function_and_checkpoint_equal_eager():
    def body(w, x):
        h = cp.checkpoint(lambda u: shmap.psum(torch.tanh(u @ w), "j"), x, use_reentrant=False)
        return shmap.psum(Cube.apply(h).sum(), ("i", "j"))

    f = shmap.shard_map(body, mesh=MESH, in_specs=(P("j"), P("i", "j")), out_specs=P())
    _assert_compiled_equals_eager(f, [torch.randn(4, 3), torch.randn(8, 4)], backend="aot_eager")


def _mlp_loss():
    mesh = shmap.make_mesh((8,), ("batch",))

    @shmap.shard_map(mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P())
    def loss(ps, x, t):
        h = torch.tanh(x @ ps[0] + ps[1])
        return shmap.pmean(((h @ ps[2] - t) ** 2).mean(), "batch")

    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(4, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, 2, generator=g)]
    return loss, ps, torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def test_compiled_training_step_with_optimizer_equals_eager():
    """forward, backward, optimizer update (Dynamo splits the graph at .backward())."""
    loss, ps0, x, t = _mlp_loss()
    results = []
    for compiled in (False, True):
        ps = [p.clone().requires_grad_() for p in ps0]
        opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)

        def step():
            opt.zero_grad()
            value = loss(ps, x, t)
            value.backward()
            opt.step()
            return value.detach()

        step_fn = torch.compile(step) if compiled else step
        with shmap.comm_log() as log:
            values = [step_fn() for _ in range(3)]
        results.append((values, [p.detach() for p in ps], log.events))
    (v0, p0, e0), (v1, p1, e1) = results
    for a, b in zip(v0 + p0, v1 + p1):
        torch.testing.assert_close(a, b)
    assert e0 == e1 and len(e0) == 3 * 4  # per step: the loss psum, one psum per parameter


def test_compiled_functional_training_step_is_one_graph():
    loss, ps, x, t = _mlp_loss()

    def step(ps, x, t):
        grads, value = torch.func.grad_and_value(loss)(ps, x, t)
        return value, [p - 0.1 * g for p, g in zip(ps, grads)]

    with shmap.comm_log() as want_log:
        want = step(ps, x, t)
    cstep = torch.compile(step, fullgraph=True, backend="aot_eager")
    with shmap.comm_log() as got_log:
        got = cstep(ps, x, t)
    torch.testing.assert_close(got, want)
    assert got_log.events == want_log.events


def test_distinct_shard_maps_get_distinct_graphs():
    """Two shard_maps share the code of their wrappers; a graph compiled for one must not
    be reused for the other."""
    mesh = shmap.make_mesh((4,), ("i",))
    f = shmap.shard_map(lambda v: shmap.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    g = shmap.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x = torch.randn(8)
    assert torch.compile(f, fullgraph=True, backend="eager")(x).shape == (2,)
    assert torch.compile(g, fullgraph=True, backend="eager")(x).shape == (8,)


class Pair(typing.NamedTuple):
    total: torch.Tensor
    blocks: list


def _pytree_io(mesh):
    """Dicts in and out, a namedtuple holding a list, and a dict subclass: every container the
    specs may describe (a graph node itself may return only tensors, tuples and lists)."""
    @shmap.shard_map(mesh=mesh, in_specs=({"w": P(), "b": P("i")}, P("i")),
                     out_specs=({"y": P("i"), "s": P()}, Pair(P(), [P("i"), P()]), collections.OrderedDict(z=P())))
    def f(p, x):
        y = torch.tanh(x * p["w"] + p["b"])
        s = shmap.psum(y.sum(), "i")
        return {"y": y, "s": s}, Pair(s * 2, [y + 1, s + 3]), collections.OrderedDict(z=s.exp())
    return f


def _leaves(tree):
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def test_compiled_pytree_outputs_are_one_graph_and_equal_eager():
    """A dict output used to be a graph break (Dynamo's node may not return one), and on the
    distributed mesh then failed; now the node returns the leaves and the containers are
    rebuilt in the graph: fullgraph=True, values, gradients and output types equal eager's,
    with and without autograd, and a second call does not recompile."""
    f = _pytree_io(shmap.make_mesh((4,), ("i",)))
    p = {"w": torch.randn(()), "b": torch.randn(8)}
    x = torch.randn(8)
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want, got = f(p, x), cf(p, x)
    assert type(got[0]) is dict and type(got[1]) is Pair and type(got[1].blocks) is list
    assert type(got[2]) is collections.OrderedDict and list(got[0]) == ["y", "s"]
    torch.testing.assert_close(_leaves(got), _leaves(want))

    def grads(fn):
        ps = {k: v.detach().requires_grad_() for k, v in p.items()}
        out = fn(ps, x)
        sum(t.sum() for t in _leaves(out)).backward()
        return [ps["w"].grad, ps["b"].grad]

    torch.testing.assert_close(grads(cf), grads(f))  # grad mode on: a second graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(grads(cf), grads(f))


def test_closed_over_tensor_under_compile_is_a_clear_error():
    mesh = shmap.make_mesh((4,), ("i",))
    w = torch.randn(3)
    f = shmap.shard_map(lambda v: shmap.psum(v @ w, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    with pytest.raises(Exception, match="closes over.*pass the tensor as an argument"):
        torch.compile(f, fullgraph=True)(torch.randn(8, 3))
    # a module's parameter, the common case (it was "Please convert all Tensors to FakeTensors first")
    lin = torch.nn.Linear(3, 4)
    g = shmap.shard_map(lambda v: shmap.psum(lin(v).sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    torch._dynamo.reset()
    with pytest.raises(Exception, match="closes over.*pass the tensor as an argument"):
        torch.compile(g, fullgraph=True)(torch.randn(8, 3))


def test_a_compiled_body_is_refused_with_the_fix():
    """Dynamo traced a body's values wrongly (`psum(a.square().sum())` came back as psum(a ** 4)): a
    torch.compile'd body (function or module) is refused where the shard_map is built."""
    mesh = shmap.make_mesh((2,), ("i",))
    for body in (torch.compile(lambda a: shmap.psum(a.square().sum(), "i"), backend="eager"),
                 torch.compile(torch.nn.Identity(), backend="eager")):
        with pytest.raises(TypeError, match=r"torch.compile'd function.*Fix: .*torch.compile\(shard_map\(f"):
            shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())


def test_a_compiled_helper_called_on_body_values_runs_uncompiled_or_says_why():
    """A torch.compile'd function called in a body: Dynamo gives up on body values and runs it as it is,
    except where its guards read them with __torch_function__ off (`x.T`), which gave "shmap internal
    error ... please report"; it is a TypeError with the fix now."""
    mesh = shmap.make_mesh((4,), ("i",))
    x, w = torch.randn(8, 3), torch.randn(3, 3)
    torch._dynamo.reset()
    h = torch.compile(lambda v: v @ w, backend="eager")
    got = shmap.shard_map(lambda v: h(v), mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
    torch.testing.assert_close(got, x @ w)
    h = torch.compile(lambda v: v.T.contiguous(), backend="eager")
    f = shmap.shard_map(lambda v: h(v), mesh=mesh, in_specs=P("i"), out_specs=P(None, "i"))
    with pytest.raises(Exception, match=r"__torch_function__ disabled.*torch.compile'd function called on body "
                                        r"values.*Fix: .*torch.compile\(shard_map\(f"):
        f(x)


def test_compiled_with_dynamic_shapes():
    """A recompile for a new batch size makes Dynamo's sizes symbolic; shmap's caches skip them."""
    mesh = shmap.make_mesh((4,), ("i",))
    loss = shmap.shard_map(lambda w, x: shmap.pmean(torch.tanh(x @ w).sum(), "i"), mesh=mesh,
                           in_specs=(P(), P("i")), out_specs=P())
    step = torch.compile(lambda w, x: torch.func.grad_and_value(loss)(w, x), fullgraph=True,
                         backend="aot_eager")
    for n in (8, 16, 24):
        w, x = torch.randn(3, 2), torch.randn(n, 3)
        with shmap.comm_log() as log:
            got = step(w, x)
        torch.testing.assert_close(got, torch.func.grad_and_value(loss)(w, x))
        assert log.summary() == {"psum": 2}


# Python state a body reads: Dynamo does not look inside the call, so the call hands it the values a
# body most often reads (compile.python_state), which it guards.  Each used to be frozen at the first trace.
SCALE = 2.0


def _lr_of_step():
    return SCALE * 0.5  # (read one call deep: a helper the body calls)


def test_python_values_the_body_reads_recompile_when_they_change():
    global SCALE
    scale = 2
    drop = torch.nn.Dropout(0.5)

    def closure(x):
        return x * scale

    def through_a_helper(x):
        return x * _lr_of_step()

    settings = {"scale": 2.0, "name": "x"}
    nested = collections.OrderedDict(opt={"lr": 2.0})  # (a nested settings dict, a dict subclass: frozen once)
    table = [2.0] * 100  # (a schedule's table longer than 64: frozen once)
    bodies = {"closure": closure, "global via a helper": through_a_helper, "module flag": lambda x: drop(x),
              "a dict's value": lambda x: x * settings["scale"],
              "a nested dict's value": lambda x: x * nested["opt"]["lr"], "a long table": lambda x: x * table[0],
              "partial": __import__("functools").partial(lambda k, x: x * scale * k, 3)}
    x = torch.ones(8)
    compiled = {k: torch.compile(shmap.shard_map(b, mesh=MESH, in_specs=P("i"), out_specs=P("i")),
                                 fullgraph=True, backend="aot_eager") for k, b in bodies.items()}
    for k in ("closure", "global via a helper", "partial", "a dict's value", "a nested dict's value", "a long table"):
        compiled[k](x)
    assert (compiled["module flag"](x) == 0).any()  # training: drops
    scale, SCALE = 5, 7.0
    settings["scale"] = 4.0
    nested["opt"]["lr"], table[0] = 6.0, 3.0
    drop.eval()
    try:
        assert torch.equal(compiled["closure"](x), x * 5)
        assert torch.equal(compiled["global via a helper"](x), x * 3.5)
        assert torch.equal(compiled["partial"](x), x * 15)
        assert torch.equal(compiled["a dict's value"](x), x * 4)
        assert torch.equal(compiled["a nested dict's value"](x), x * 6)
        assert torch.equal(compiled["a long table"](x), x * 3)
        assert torch.equal(compiled["module flag"](x), x)  # eval: the identity
    finally:
        SCALE = 2.0


def test_python_state_reads_what_a_trace_freezes():
    from shmap.compile import python_state

    later = None

    def body(x):
        return x * later if later else x  # `later`: a cell still empty when read below

    del later
    assert python_state(body) == ()  # (an empty cell is skipped)
    lin = torch.nn.Linear(2, 2)
    assert python_state(lin)[0] is True
    lin.eval()
    assert python_state(lin)[0] is False


def test_arguments_stay_read_only_when_the_body_is_traced():
    """torch.compile, shmap.jit and torch.func.vmap trace the body on tensors without data (fake, functional,
    batched); the read-only check found no storage there and let an in-place update write the caller's
    tensor (cow.storage_key now reads the traced tensor's storage, or the wrapped one's)."""
    f = shmap.shard_map(lambda v: v.mul_(2), mesh=MESH, in_specs=P("i"), out_specs=P("i"))
    for name, traced in (("compile", torch.compile(f, backend="aot_eager")), ("jit", shmap.jit(f)),
                         ("vmap", torch.func.vmap(f))):
        x = torch.ones(2, 8) if name == "vmap" else torch.ones(8)
        with pytest.raises(Exception, match=r"in-place update of argument 0 \('v'\)"):
            traced(x)
        assert torch.equal(x, torch.ones_like(x)), name
    # An argument returned as it is comes back a new tensor, as eagerly: writing it leaves the caller's alone.
    x = torch.ones(8)
    out = torch.compile(shmap.shard_map(lambda v: v, mesh=MESH, in_specs=P("i"), out_specs=P("i")),
                        backend="aot_eager")(x)
    out.add_(1)
    assert torch.equal(x, torch.ones(8))


def test_jacrev_and_hessian_of_a_shard_mapped_function_compile():
    """They batch the backward's collectives with vmap, whose rule for the comm_log op (`shmap::record`)
    was missing under torch.compile ("Batching rule not implemented"); the events are eager's."""
    mesh = shmap.make_mesh((2,), ("i",))
    vec = shmap.shard_map(lambda w, x: torch.tanh(x @ w), mesh=mesh, in_specs=(P(), P("i")), out_specs=P("i"))
    loss = shmap.shard_map(lambda w, x: shmap.pmean((torch.tanh(x @ w) ** 2).sum(), "i"), mesh=mesh,
                           in_specs=(P(), P("i")), out_specs=P())
    w, x = torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for f in (lambda w, x: torch.func.jacrev(vec)(w, x), lambda w, x: torch.func.hessian(loss)(w, x)):
        with shmap.comm_log() as want_log:
            want = f(w, x)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        compiled(w, x)
        with shmap.comm_log() as got_log:
            got = compiled(w, x)
        torch.testing.assert_close(got, want)
        assert got_log.summary() == want_log.summary() and got_log.summary()


def test_an_indivisible_symbolic_size_is_named_by_its_value():
    """Under dynamic shapes the spec check sees a symbolic size: the message gives its value (it said `s33`)."""
    mesh = shmap.make_mesh((4,), ("i",))
    f = torch.compile(shmap.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("i"), out_specs=P("i")),
                      backend="eager", dynamic=True)
    f(torch.randn(8))
    with pytest.raises(Exception, match=r"has size 10 \(symbolic s\d+ under torch.compile\), which is not "
                                        r"divisible by 4"):  # (Dynamo wraps the SpecError it met)
        f(torch.randn(10))


@pytest.mark.parametrize("read", ["item", "int"])
def test_a_body_that_reads_an_invariant_value_runs_eagerly_under_compile(read):
    """`.item()` / `int()` of an invariant value: the node's fake run cannot read it, so Dynamo breaks the
    graph at the shard_map and runs it; it then compiled the body's frames on body values: `.item()` gave a
    wrong answer of another shape ([92., 282.] for 40.), `int()` a RecursionError."""
    mesh = shmap.make_mesh((2,), ("i",))

    def body(a):
        s = shmap.psum(a.sum(), "i")
        k = s.item() if read == "item" else int(s)
        return shmap.psum(a.square().sum(), "i") + k

    f = shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    want = f(a)
    torch._dynamo.reset()
    with shmap.comm_log() as log:
        got = torch.compile(f, backend="aot_eager")(a)
    assert got.shape == () and torch.equal(got, want) and want.item() == 40.0
    assert log.summary() == {"psum": 2}


def test_inductor_reports_a_forward_s_collectives_in_program_order():
    """pmax's event was recorded on its result, which Inductor's scheduler was free to order after the
    pmean's psum that reduces it: comm_log said psum, pmax.  It is recorded on the operand now, before the
    reduction, as on processes."""
    mesh = shmap.make_mesh((2, 2), ("i", "j"))

    def body(x):
        h = shmap.pmean(shmap.pmax(x, "j"), "j")
        return shmap.psum((h * h).sum(), ("i", "j")), shmap.all_gather_invariant(h, ("i", "j"), tiled=True)

    f = shmap.shard_map(body, mesh=mesh, in_specs=P(("i", "j")), out_specs=(P(), P()))
    x = torch.randn(8, 4)

    def events(fn):
        with shmap.comm_log() as log:
            fn(x.clone().requires_grad_())
        return [(e.kind, e.axes) for e in log.events]

    torch._dynamo.reset()
    assert events(torch.compile(f, fullgraph=True)) == events(f) == [
        ("pmax", ("j",)), ("psum", ("j",)), ("psum", ("i", "j")), ("all_gather_invariant", ("i", "j"))]
