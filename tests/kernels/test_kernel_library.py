"""Each library kernel equals its collective, computed with plain torch over the
per-device list, on the interpreter (with schedule exploration) and on the
shared-memory runtime."""
import functools

import pytest
import torch

from shmap import kernels as K
from shmap.kernels import library as L
from shmap.kernels import transport as T

pytestmark = pytest.mark.usefixtures("float32_default")


def make(n, *shape, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + n)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def check_all_reduce(fn, n, shape):
    xs = make(n, *shape)
    want = torch.stack(xs).sum(0)
    for out in fn(xs):
        torch.testing.assert_close(out, want)


def check_all_gather(fn, n, shape):
    xs = make(n, *shape)
    for out in fn(xs):
        assert torch.equal(out, torch.stack(xs))


def check_reduce_scatter(fn, n, shape):
    xs = make(n, n, *shape)
    for d, out in enumerate(fn(xs)):
        torch.testing.assert_close(out, torch.stack([x[d] for x in xs]).sum(0))


def check_all_to_all(fn, n, shape):
    xs = make(n, n, *shape)
    for d, out in enumerate(fn(xs)):
        assert torch.equal(out, torch.stack([x[d] for x in xs]))


def check_permute(fn, n, shape):
    xs = make(n, *shape)
    perm = [(i, (i + 1) % n) for i in range(n)]
    if n > 2:
        perm = perm[:-1]  # device 0 receives nothing: zeros
    for d, out in enumerate(fn(xs, perm)):
        src = {dst: s for s, dst in perm}.get(d)
        assert torch.equal(out, xs[src] if src is not None else torch.zeros(shape))


def check_matmul(fn, n, shape):
    m, k = shape
    xs, ws = make(n, m, k), make(n, k, 3, seed=1)
    for d, out in enumerate(fn(xs, ws)):
        torch.testing.assert_close(out, torch.cat(xs) @ ws[d])


CASES = {
    "ppermute": (check_permute, L.ppermute, (5, 3)),
    "all_gather": (check_all_gather, L.all_gather, (3, 4)),
    "all_reduce": (check_all_reduce, L.all_reduce, (6, 5)),
    "reduce_scatter": (check_reduce_scatter, L.reduce_scatter, (4, 3)),
    "reduce_scatter_nested": (check_reduce_scatter, functools.partial(L.reduce_scatter,
                                                                      chunk_rows=2), (9, 2)),
    "all_to_all": (check_all_to_all, L.all_to_all, (2, 3)),
    "allgather_matmul": (check_matmul, L.allgather_matmul, (3, 4)),
    "direct_all_reduce": (check_all_reduce, T.all_reduce, (7, 3)),
    "one_shot_all_reduce": (check_all_reduce, T.one_shot_all_reduce, (2, 5)),
    "direct_all_gather": (check_all_gather, T.all_gather, (5,)),
    "direct_reduce_scatter": (check_reduce_scatter, T.reduce_scatter, (3, 2)),
}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter(name, n):
    check, fn, shape = CASES[name]
    check(functools.partial(fn, seed=n), n, shape)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_explored(name, n):
    """Several schedules (delayed, reordered copies; devices running ahead): no race,
    no leftover semaphore, no deadlock, same outputs."""
    check, fn, shape = CASES[name]
    check(functools.partial(fn, seed=1, explore=6), n, shape)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_shared_memory(name, n, shm_group):
    check, fn, shape = CASES[name]
    check(functools.partial(fn, run=shm_group.run), n, shape)


def test_shapes_and_dtypes(shm_group):
    """Other shapes: large blocks through a small working buffer, odd rows, integer data."""
    for run in (K.interpret, shm_group.run):
        check_reduce_scatter(functools.partial(L.reduce_scatter, chunk_rows=3, run=run), 3,
                             (17, 5))
        xs = [torch.arange(12, dtype=torch.int64).view(3, 4) * (d + 1) for d in range(3)]
        for out in L.all_reduce(xs, run=run):
            assert torch.equal(out, sum(xs))
        for out in T.all_reduce(xs, run=run):
            assert torch.equal(out, sum(xs))


def test_usage_errors():
    with pytest.raises(K.KernelUsageError, match="repeats a source"):
        L.ppermute(make(3, 2), [(0, 1), (0, 2)])
    with pytest.raises(K.KernelUsageError, match=r"must be \[n=2, R>=2"):
        L.reduce_scatter(make(2, 3, 1))
    with pytest.raises(K.KernelUsageError, match="need x \\[m, k\\]"):
        L.allgather_matmul(make(2, 3), make(2, 3))


def test_exploring_schedules_takes_nan_as_nan_in_complex_outputs():
    """`explore` compares the schedules' outputs bit for bit, NaN equal to NaN; complex outputs went through
    torch.equal, where NaN is not NaN: a false ScheduleDependenceError."""
    xs = [torch.tensor([complex("nan"), 1 + 1j])] * 2
    got = L.all_gather(xs, explore=2)[0]
    assert got.shape == (2, 2) and torch.isnan(got[:, 0].real).all() and torch.equal(got[:, 1], torch.tensor([1 + 1j, 1 + 1j]))


@pytest.mark.parametrize("bad, match", [
    (lambda: L.ppermute([torch.ones(2)] * 2, (0, 1)), r"perm must be \(source, destination\) pairs.*Fix"),
    (lambda: L.reduce_scatter([torch.ones(2, 4)] * 2, chunk_rows=0), r"chunk_rows must be a positive row count"),
    (lambda: K.Buffer((2,), "float32"), r"dtype must be a torch.dtype, got 'float32'"),
    (lambda: K.Buffer((-2,)), r"shape \(-2,\) has a negative size"),
])
def test_malformed_arguments_name_the_argument_and_the_fix(bad, match):
    """They raised torch's or Python's own errors (`cannot unpack non-iterable int object`, `empty(): argument
    'dtype' must be torch.dtype`), or (chunk_rows=0) were taken for 1."""
    with pytest.raises(K.KernelUsageError, match=match):
        bad()


def test_allgather_matmul_promotes_operands_of_two_dtypes():
    """The output was the promoted dtype, but the operands went to the kernel's matmul as they were: a
    DeviceError ("expected m1 and m2 to have the same dtype")."""
    xs = [torch.randn(2, 3) for _ in range(2)]
    ws = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    out = L.allgather_matmul(xs, ws)
    for d in range(2):
        assert out[d].dtype == torch.float64
        torch.testing.assert_close(out[d], torch.cat(xs).double() @ ws[d])
