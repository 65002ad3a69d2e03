"""The simulated mesh on a GPU: `make_mesh(..., device='cuda')` and `shmap-train --device cuda`.

Every simulated device's block lives on the one GPU (stacked, as on the CPU),
so a body's ops are the same batched kernels on another device.  Each test
runs the same program on the CPU and on CUDA and compares values (float64:
to 1e-12; integer and bool collectives: exactly), the device of every result
(nothing silently comes back to the CPU), gradients to second order and
`comm_log`.  CI has no GPU: these run where one is, `pytest tests/test_cuda.py`.
"""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch

import shmap
from shmap import P

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run on a GPU host: pytest tests/test_cuda.py)")


def _both(build, *args):
    """`build(device)` -> a function; run it on the CPU and on CUDA with `args` -> (cpu, cuda) results and logs."""
    out = {}
    for dev in ("cpu", "cuda"):
        f = build(dev)
        with shmap.comm_log() as log:
            res = f(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args])
        out[dev] = (res, [(e.kind, e.axes, e.bytes, e.shape, e.dtype) for e in log.events])
    return out["cpu"], out["cuda"]


def _same(cpu, cuda, *, exact=False):
    assert cuda.device.type == "cuda", f"a result came back on {cuda.device}"
    assert cuda.dtype == cpu.dtype and cuda.shape == cpu.shape
    if exact:
        assert torch.equal(cuda.cpu(), cpu)
    else:
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-12, atol=1e-12)


def test_readme_matmul_on_cuda():
    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)

    def build(dev):
        mesh = shmap.make_mesh((4, 2), ("i", "j"), device=dev)

        @partial(shmap.shard_map, mesh=mesh, in_specs=(P("i", "j"), P("j", None)), out_specs=P("i", None))
        def matmul(a_block, b_block):
            return shmap.psum(a_block @ b_block, "j")
        return matmul

    (c0, log0), (c1, log1) = _both(build, a, b)
    _same(c0, c1)
    torch.testing.assert_close(c1.cpu(), a @ b, rtol=1e-12, atol=1e-12)
    assert log0 == log1 == [("psum", ("j",), 8 * 4 * 8 // 4, (2, 4), "torch.float64")]


BODIES = {
    "psum": lambda x: shmap.psum(x, "i"),
    "pmean": lambda x: shmap.pmean(x, ("i", "j")),
    "pmax": lambda x: shmap.pmax(x, "j"),
    "pmin": lambda x: shmap.pmin(x, "i"),
    "all_gather": lambda x: shmap.all_gather(x, "i", axis=1, tiled=True),
    "all_gather_untiled": lambda x: shmap.all_gather(x, "j"),
    "psum_scatter": lambda x: shmap.psum_scatter(x, "i", scatter_dimension=1, tiled=True),
    "ppermute": lambda x: shmap.ppermute(x, "i", [(k, (k + 1) % 4) for k in range(4)]),
    "all_to_all": lambda x: shmap.all_to_all(x, "i", 1, 0, tiled=True),
    "axis_index": lambda x: x * shmap.axis_index("i") + shmap.axis_index("j"),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_collectives_on_cuda_equal_the_cpu(name):
    x = torch.randn(8, 8, dtype=torch.float64)

    def build(dev):
        mesh = shmap.make_mesh((4, 2), ("i", "j"), device=dev)
        return shmap.shard_map(BODIES[name], mesh=mesh, in_specs=P("i", "j"), out_specs=P("i", "j"))

    (y0, log0), (y1, log1) = _both(build, x)
    _same(y0, y1)
    assert log0 == log1


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.bool, torch.float16])
def test_psum_and_pmax_keep_the_cpu_semantics_for_every_dtype(dtype):
    """int8 wraps, bool psum counts, bool pmax is any: the same bits as on the CPU."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 120, (8, 4), generator=g).to(dtype)

    def build(dev):
        mesh = shmap.make_mesh((8,), ("i",), device=dev)
        return shmap.shard_map(lambda v: (shmap.psum(v, "i"), shmap.pmax(v, "i")), mesh=mesh,
                               in_specs=P("i"), out_specs=(P(), P()))

    ((s0, m0), log0), ((s1, m1), log1) = _both(build, x)
    _same(s0, s1, exact=True)
    _same(m0, m1, exact=True)
    assert log0 == log1


def test_gradients_to_second_order_on_cuda_equal_the_cpu():
    w = torch.randn(6, 4, dtype=torch.float64)
    x = torch.randn(8, 6, dtype=torch.float64)

    def build(dev):
        mesh = shmap.make_mesh((4, 2), ("i", "j"), device=dev)

        @partial(shmap.shard_map, mesh=mesh, in_specs=(P("j"), P("i")), out_specs=P())
        def loss(w_block, x_block):
            wf = shmap.all_gather_invariant(w_block, "j", tiled=True)
            return shmap.psum((torch.tanh(x_block @ wf) ** 2).sum(), "i")

        def grads(w, x):
            w = w.detach().requires_grad_()
            (g,) = torch.autograd.grad(loss(w, x), w, create_graph=True)
            (gg,) = torch.autograd.grad((g ** 2).sum(), w)
            return g.detach(), gg
        return grads

    ((g0, gg0), log0), ((g1, gg1), log1) = _both(build, w, x)
    _same(g0, g1)
    _same(gg0, gg1)
    assert log0 == log1


def test_jit_and_torch_compile_on_cuda_equal_eager():
    x = torch.randn(8, 16, device="cuda")
    w = torch.randn(16, 16, device="cuda")
    mesh = shmap.make_mesh((4, 2), ("i", "j"), device="cuda")

    @partial(shmap.shard_map, mesh=mesh, in_specs=(P("i"), P(None, "j")), out_specs=P("i", "j"))
    def f(x, w):
        return torch.relu(shmap.all_gather(x, "i", tiled=True)[:2] @ w) + shmap.psum(x.sum(), "i")

    eager = f(x, w)
    jitted = shmap.jit(f)
    assert eager.device.type == "cuda"
    for _ in range(2):  # the capture, then a replay
        torch.testing.assert_close(jitted(x, w), eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.compile(f)(x, w), eager, rtol=1e-5, atol=1e-5)


def test_pmap_on_cuda_equals_the_cpu():
    x = torch.randn(4, 3, 5, dtype=torch.float64)

    def build(dev):
        @partial(shmap.pmap, axis_name="i", devices=dev)
        def f(v):
            return v - shmap.pmean(v, "i") + shmap.axis_index("i")
        return f

    (y0, log0), (y1, log1) = _both(build, x)
    _same(y0, y1)
    assert log0 == log1


# --- the recipe ---------------------------------------------------------------------------------
def _losses(mesh, device, steps=4, **kw):
    from shmap.train.loop import Run, _value

    from train.tiny import tiny

    run = Run(tiny(mesh, device=device, steps=steps, **kw))
    params, opt = run.fresh_state()
    out = []
    for k in range(steps):
        params, opt, m = run.step(params, opt, k)
        out.append(_value(m["train_loss"]))
    leaf = next(iter(params["layers"]["0"]["mlp"].values()))
    return out, leaf


@pytest.mark.parametrize("mesh", ["fsdp=2,tensor=4", "data=2,fsdp=2,tensor=2"])
def test_recipe_on_cuda_equals_plain_pytorch_and_the_cpu(mesh):
    """float64, 4 steps: the simulated mesh on CUDA gives --mesh none's losses (on CUDA) and the CPU's."""
    cuda, leaf = _losses(mesh, "cuda")
    plain, _ = _losses("none", "cuda")
    cpu, _ = _losses(mesh, "cpu")
    assert leaf.device.type == "cuda"
    torch.testing.assert_close(torch.tensor(cuda), torch.tensor(plain), rtol=1e-7, atol=0)
    torch.testing.assert_close(torch.tensor(cuda), torch.tensor(cpu), rtol=1e-10, atol=0)


def test_shmap_train_device_cuda_end_to_end(tmp_path):
    """The command: --device cuda trains, evaluates, samples, plots, checkpoints and resumes exactly."""
    from shmap.train.loop import main

    from train.tiny import TINY_FLAGS

    out, ck = tmp_path / "out", tmp_path / "ck"
    flags = TINY_FLAGS + ["--mesh", "fsdp=2,tensor=4", "--device", "cuda", "--sample-len", "20",
                          "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--out", str(out)]
    assert main(flags + ["--steps", "4"]) == 0
    whole = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (out / "loss.png").is_file() and len((out / "sample.txt").read_text()) >= 20
    assert main(flags + ["--steps", "6", "--resume"]) == 0
    import shutil

    shutil.rmtree(ck)
    assert main(flags + ["--steps", "6", "--out", str(tmp_path / "straight")]) == 0
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    losses = lambda rows: [r["train_loss"] for r in rows if "train_loss" in r]  # noqa: E731
    assert losses(resumed) == losses(straight) and len(losses(straight)) == 6
    assert losses(whole) == losses(straight)[:4]


# --- the distributed backend over NCCL ---------------------------------------------------------
def test_distributed_mesh_over_nccl_equals_the_simulated_mesh_on_the_gpu():
    """One NCCL process (one GPU runs no two NCCL ranks): the distributed backend's boundary,
    collectives' call paths, guard and jit replay on CUDA give the simulated mesh's values,
    gradients and comm_log (tests/distributed/dist_nccl.py)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed"))
    import dist_nccl

    (log,) = shmap.spawn(dist_nccl.one_process_nccl, nprocs=1, backend="nccl", timeout=120)
    assert log == {"psum": 4, "all_gather": 2, "psum_scatter": 2, "ppermute": 2, "all_to_all": 2, "pmax": 1}
