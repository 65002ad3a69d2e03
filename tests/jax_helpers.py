"""JAX as the differential oracle: mesh construction and collective counting.

JAX 0.10.2 specifics this module encodes (checked against the installed jax):

* ``jax.shard_map(f, mesh=, in_specs=, out_specs=, check_vma=True)``; the mesh
  uses ``AxisType.Auto`` axes so that plain (unsharded) host arrays can be
  passed in: with ``Explicit`` axes shard_map insists that the argument already
  carries the in_spec's sharding.
* A mesh smaller than the 8 host devices takes the first ``prod(shape)`` devices.
* ``pvary`` is spelled ``lax.pcast(x, axes, to='varying')`` and
  ``all_gather_invariant`` is ``lax.all_gather(..., to='invarying')``.
* With ``check_vma=True`` a ``psum`` binds the primitive ``psum_invariant``,
  ``psum_scatter`` binds ``reduce_scatter``; ``pvary`` (no communication) and
  ``axis_index`` are not collectives.

Collective counts are reported in shmap's vocabulary (``comm_log`` kinds) so
tests compare ``Counter``s directly.
"""
from __future__ import annotations

import os
from collections import Counter

# Same defaults as tests/conftest.py, so this module also works when imported
# outside pytest (e.g. from a REPL while debugging a failing generated case).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_ENABLE_X64", "1")

import jax  # noqa: E402
import jax.extend.core  # noqa: E402  (not imported by `import jax`)
import numpy as np  # noqa: E402
from jax.sharding import AxisType, PartitionSpec  # noqa: E402

assert jax.config.jax_enable_x64, "tests compare float64 results; JAX_ENABLE_X64 must be set"

#: JAX primitive name -> shmap comm_log kind.  Async start halves count once
#: (the matching ``*_done`` is not a second collective).
JAX_PRIMITIVE_KIND = {
    "psum": "psum",
    "psum_invariant": "psum",
    "psum_start": "psum",
    "psum_invariant_start": "psum",
    "unreduced_psum": "psum",
    "unreduced_psum_start": "psum",
    "pmax": "pmax",
    "pmin": "pmin",
    "all_gather": "all_gather",
    "all_gather_start": "all_gather",
    "all_gather_invariant": "all_gather_invariant",
    "reduce_scatter": "psum_scatter",
    "reduce_scatter_start": "psum_scatter",
    "unreduced_reduce_scatter": "psum_scatter",
    "unreduced_reduce_scatter_start": "psum_scatter",
    "ppermute": "ppermute",
    "ppermute_start": "ppermute",
    "all_to_all": "all_to_all",
    "all_to_all_start": "all_to_all",
    "ragged_all_to_all": "all_to_all",
    "pbroadcast": "pbroadcast",
}

#: Primitives that look collective but move no data; listed so that an unknown
#: primitive with a collective-sounding name is flagged instead of ignored.
NON_COMMUNICATING = {"pvary", "axis_index", "pcast", "preduced", "vary_unreduced_cast_p",
                     "reduced_vary_cast", "psum_done", "all_gather_done", "ppermute_done",
                     "reduce_scatter_done", "all_to_all_done", "pbroadcast_done"}


def jax_mesh(shape, names):
    """A JAX mesh of ``prod(shape)`` CPU devices with manual-compatible axes."""
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape))
    devices = jax.devices()
    assert len(devices) >= n, f"need {n} JAX devices, have {len(devices)} (XLA_FLAGS?)"
    return jax.make_mesh(shape, tuple(names), axis_types=(AxisType.Auto,) * len(shape),
                         devices=devices[:n])


def jax_spec(spec) -> PartitionSpec:
    """A spec given as a tuple of entries (None / name / tuple) -> jax P."""
    return PartitionSpec(*spec)


def _sub_jaxprs(value):
    """Jaxprs nested in an equation parameter (shard_map body, pjit, cond...)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def count_collectives(jaxpr) -> Counter:
    """Collectives in a (closed) jaxpr and every sub-jaxpr, by shmap kind."""
    if hasattr(jaxpr, "jaxpr"):
        jaxpr = jaxpr.jaxpr
    counts: Counter = Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in JAX_PRIMITIVE_KIND:
            counts[JAX_PRIMITIVE_KIND[name]] += 1
        else:
            suspicious = any(k in name for k in ("psum", "gather", "scatter", "permute", "all_to"))
            assert not suspicious or name in NON_COMMUNICATING, (
                f"unclassified collective-like primitive {name!r}; add it to JAX_PRIMITIVE_KIND")
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                counts += count_collectives(sub)
    return counts


def backward_collectives(f, args, cotangents) -> Counter:
    """Collectives in the backward pass of ``f`` at ``args`` (by kind).

    ``jax.vjp`` linearises ``f`` once; the returned ``vjp_fn`` closes over the
    residuals, so its jaxpr contains only the transposed (backward) program.
    ``f`` is jitted first: linearising an eager shard_map runs it op by op,
    which is ~7x slower and yields the same transposed program.
    """
    _, vjp_fn = jax.vjp(jax.jit(f), *args)
    return count_collectives(jax.make_jaxpr(vjp_fn)(cotangents))


def forward_collectives(f, args) -> Counter:
    """Collectives in the forward program of ``f`` (by kind)."""
    return count_collectives(jax.make_jaxpr(f)(*args))
