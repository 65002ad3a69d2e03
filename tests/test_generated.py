"""Generated programs through shmap, checked against the reference and JAX.

Each hypothesis case is a random :class:`programs.Program` (mesh of up to 8
devices with 1-3 axes, tuple spec entries, unmentioned axes, every collective).

* shmap vs the numpy reference: outputs, plus every intermediate value's
  shape and varying axes against the typing rules (which test_reference ties
  to JAX's own types).  These programs may use ppermute/pshuffle over axis
  tuples in any order, which JAX linearises differently (see programs.py).
* shmap vs JAX: outputs, first-order gradients of ``sum(out * cotangent)``
  with respect to every input, the collectives of that backward pass (by
  kind), and for part of the cases second-order gradients (gradient of the
  squared gradient norm).  The backward communication is the point of vma
  typing, so it is compared exactly, not just the numbers it produces.

Budgets are fixed and derandomized so CI sees the same cases every run.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import programs as pg
from differential import assert_close, assert_matches_jax, tensors

SETTINGS = pg.HYPOTHESIS_SETTINGS
FOCUS = pg.COLLECTIVES + ("add_index", "matmul", "add")
GRAD_FOCUS = tuple(op for op in FOCUS if pg.OPS[op].differentiable)


# -- shmap vs reference ------------------------------------------------------
def check_against_reference(program, seed):
    args = pg.random_inputs(program, seed)
    want = pg.reference_fn(program)(*args)
    got = pg.shmap_fn(program, check_types=True)(*tensors(args))
    assert isinstance(got, tuple) and len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert type(g) is torch.Tensor, f"output {k} is {type(g).__name__}, not a plain tensor"
        assert_close(g, w, f"output {k} vs reference\n{program}")


@pytest.mark.parametrize("focus", FOCUS)
@settings(max_examples=10, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_outputs_and_types_match_reference(focus, data, seed):
    program = data.draw(pg.programs(focus=focus, jax_compatible=False), label="program")
    check_against_reference(program, seed)


@settings(max_examples=60, **SETTINGS)
@given(program=pg.programs(max_steps=6, jax_compatible=False), seed=st.integers(0, 2**16))
def test_outputs_and_types_match_reference_mixed(program, seed):
    check_against_reference(program, seed)


# -- shmap vs JAX: values, gradients, backward communication -----------------
def check_against_jax(program, seed, second_order):
    assert_matches_jax(pg.jax_fn(program, jit=False), pg.shmap_fn(program),
                       pg.random_inputs(program, seed), seed=seed,
                       second_order=second_order, context=repr(program))


@pytest.mark.parametrize("focus", GRAD_FOCUS)
@settings(max_examples=8, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16), second_order=st.booleans())
def test_values_gradients_and_backward_comm_match_jax(focus, data, seed, second_order):
    program = data.draw(pg.programs(differentiable=True, focus=focus), label="program")
    check_against_jax(program, seed, second_order)


@settings(max_examples=40, **SETTINGS)
@given(program=pg.programs(differentiable=True, max_steps=6), seed=st.integers(0, 2**16),
       second_order=st.booleans())
def test_values_gradients_and_backward_comm_match_jax_mixed(program, seed, second_order):
    check_against_jax(program, seed, second_order)


@settings(max_examples=30, **SETTINGS)
@given(program=pg.programs(), seed=st.integers(0, 2**16))
def test_values_match_jax_including_pmax_pmin(program, seed):
    """pmax/pmin have no JAX derivative: compare their values only."""
    args = pg.random_inputs(program, seed)
    got, want = pg.shmap_fn(program)(*tensors(args)), pg.jax_fn(program)(*args)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"output {k} vs jax\n{program}")
