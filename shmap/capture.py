"""How `shmap.jit` captures one call (jit.py keys, caches and replays the captures).

Without gradients: `make_fx` of the call on fake tensors, functionalized and
compiled by Inductor (or its FX graph replayed, `backend="eager"`).  With
gradients: AOT autograd's forward and backward graphs, traced through
autograd Functions, so a replay's gradients and `comm_log` events are
eager's.  `_check_graph` refuses what a replay would get wrong: a tensor
constant the function closes over.  (On the distributed mesh the graphs hold
torch's functional collectives and the guard's ops, `backends/traced.py`,
which run at every replay.)

The differentiable capture partitions forward and backward with AOT
autograd's min-cut partitioner, as `torch.compile` does: its default
partitioner recomputed `scaled_dot_product_attention`'s forward in the
backward graph (a Transformer's attention forward ran twice a step).
"""
from __future__ import annotations

import functools
import warnings

import torch

from . import ops, small_matmul
from .cow import storage_key

_Tensor = torch.Tensor


class JitError(RuntimeError):
    """`shmap.jit` cannot capture this function as written; the message names the fix."""


_LIFT_FRESH = torch.ops.aten.lift_fresh_copy.default


def _check_graph(gm, name):
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            val = getattr(gm, node.target, None)
            # A tensor made from Python data in `f` (`torch.tensor(...)`, a number passed to a
            # shard_map) is a constant copied afresh on every call: Python state, read at trace time.
            fresh = node.users and all(u.target is _LIFT_FRESH for u in node.users)
            if isinstance(val, _Tensor) and not fresh:
                raise JitError(
                    f"shmap.jit({name}): the captured program holds a tensor constant of shape "
                    f"{tuple(val.shape)} (a tensor the function closes over). A replay would keep using "
                    "that tensor even after it is rebound, and no gradient reaches it. Fix: pass it as an "
                    "argument (in a shard_map, with in_spec P() if replicated)."
                )


# ----------------------------------------------------------------------
# Capture: without gradients (make_fx, functionalized, Inductor or FX)
# ----------------------------------------------------------------------
def _no_value_reads(flat_fn, name):
    """`flat_fn`, refusing to read the value of a real tensor (one it closes over) while it is traced: make_fx
    ran `scale.item()` on it and froze the number in the program (a replay kept it after `scale.fill_(5)`,
    silently), where the differentiable capture refuses the closed-over tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Refuse(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], _Tensor)
                    and not isinstance(args[0], FakeTensor)):
                raise JitError(
                    f"shmap.jit({name}): the function reads the value of a tensor it closes over (`.item()`, "
                    f"`float()`, `.tolist()` of a tensor of shape {tuple(args[0].shape)}). A replay would keep "
                    "the value read at the capture. Fix: pass the tensor as an argument (in a shard_map, with "
                    "in_spec P()), or read the number outside and pass it as a Python number.")
            return func(*args, **(kwargs or {}))

    def checked(*args):
        with Refuse():
            return flat_fn(*args)
    return checked


def capture_inference(flat_fn, tensors, backend, name):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_no_value_reads(flat_fn, name), tracing_mode="fake")(*tensors)
    _check_graph(gm, name)
    ptrs = [storage_key(t) or id(t) for t in tensors]
    if backend == "eager" or len(set(ptrs)) < len(ptrs):  # (Inductor's inner compile takes distinct inputs)
        return _boxed(gm.forward)
    fx_forward = gm.forward
    # Inductor needs a functional graph.  Functionalize the captured aten graph (not `f`: its
    # autograd Functions, under torch.func transforms, have no functionalize rule).
    from torch._inductor.decomposition import select_decomp_table

    table = {**select_decomp_table(), **small_matmul.DECOMPOSITIONS}
    gm = make_fx(torch.func.functionalize(gm, remove="mutations"), decomposition_table=table,
                 tracing_mode="fake")(*tensors)
    events = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.shmap.record.default:
            events.append(ops.describe(node.args[1]))
            gm.graph.erase_node(node)
    gm.recompile()
    try:
        compiled = _inductor(gm, tensors)
    except Exception as e:  # a correct replay is still possible: the FX graph
        warnings.warn(f"shmap.jit({name}): Inductor could not compile the captured program "
                      f"({type(e).__name__}: {e}); replaying its FX graph instead.", stacklevel=4)
        return _boxed(fx_forward)
    events = tuple(events)
    call = getattr(compiled, "current_callable", None) or compiled  # skip the profiler bookkeeping
    call = functools.partial(call)  # (an attribute can be set on it)

    call.shmap_events = events  # reported by the entry (`_finish`) after each call
    return call  # takes the list of inputs (and clears it)


def _inductor(gm, tensors):
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode

    # The key pins every input's sizes and strides: the generated code need not assert them.
    with inductor_config.patch(size_asserts=False), FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in tensors]
        return compile_fx_inner(gm, fakes)


# ----------------------------------------------------------------------
# Capture: differentiable calls (AOT autograd: forward and backward graphs)
# ----------------------------------------------------------------------
def capture_grad(flat_fn, name, backend):
    from functorch.compile import min_cut_rematerialization_partition, nop
    from torch._functorch.aot_autograd import aot_function

    if backend == "eager":
        fw, bw, table = nop, nop, None
    else:
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table

        fw, table = compile_fx_inner, {**select_decomp_table(), **small_matmul.DECOMPOSITIONS}

        def bw(gm, example_inputs):
            return compile_fx_inner(gm, example_inputs, is_backward=True)

    def fw_compiler(gm, example_inputs):
        _check_graph(gm, name)
        return fw(gm, example_inputs)

    compiled = aot_function(flat_fn, fw_compiler=fw_compiler, bw_compiler=bw, decompositions=table,
                            partition_fn=min_cut_rematerialization_partition)

    def run(ts):
        outs = compiled(*ts)
        for o in outs if isinstance(outs, (tuple, list)) else (outs,):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(functools.partial(_first_order_only, name))
        return outs

    return run


def _first_order_only(name, grad):
    """A backward pass that records a graph (`create_graph=True`: a double backward) reaching a captured
    call's output: AOT autograd's backward is not differentiable, so the gradients would come back without
    a graph and the second `grad` fail far away ("appears to not have been used in the graph") or, with
    allow_unused, silently give None.  (A tensor hook runs in the pass's grad mode.)"""
    if torch.is_grad_enabled():
        raise JitError(
            f"shmap.jit({name}): a backward pass with create_graph=True (a double backward: a gradient "
            "penalty, a Hessian) through a captured call, whose captured backward is not differentiable. "
            "Fix: call the function itself, or jit(...).eager, where gradients of gradients work."
        )


def _boxed(fn):
    """Every replay takes one list of input tensors (which it may clear, as Inductor's code does)."""
    return lambda ts: fn(*ts)
