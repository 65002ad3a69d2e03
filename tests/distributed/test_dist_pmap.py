"""pmap and nested pmap on 4 gloo processes equal the simulated mesh (seed 003's 2x2 grid)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_pmap  # noqa: E402
import shmap  # noqa: E402

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = pytest.mark.xdist_group("multiprocess")


def _same(a, b, where):
    if isinstance(a, dict):
        assert set(a) <= set(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{k}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, msg=lambda m: f"{where}: {m}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def results():
    return dist_pmap.run_all(), shmap.spawn(dist_pmap.run_all, nprocs=4, timeout=120)


def test_pmap_and_nested_pmap_match_simulated(results):
    sim, ranks = results
    for r, got in enumerate(ranks):
        _same(sim["single"], got["single"], f"rank {r} single")
        _same(sim["nested"], got["nested"], f"rank {r} nested")


def test_seed003_numbers_on_four_processes(results):
    _, ranks = results
    for got in ranks:
        assert torch.equal(got["nested"]["small"], torch.full((2, 2), 6.0, dtype=torch.float64))
        assert torch.equal(got["nested"]["large"][0, 0],
                           torch.tensor([[24., 28.], [32., 36.]], dtype=torch.float64))


def test_dtensor_input_is_used_in_place(results):
    _, ranks = results
    for got in ranks:
        d = got["dtensor"]
        assert d["placements"] == ["S(0)"] and d["local_shape"] == (1, 3)
        torch.testing.assert_close(d["full"], d["plain"])
        torch.testing.assert_close(d["nested"], d["nested_plain"])


def test_pmap_compiles_as_one_graph_and_equals_eager(results):
    """torch.compile(fullgraph=True) of a pmap taking and returning dicts: values, gradients and
    comm_log equal eager's, on the simulated mesh and on 4 processes (where the node's DeviceMesh
    is a graph input); a pmap smaller than the world, with autograd, is refused there by name."""
    sim, ranks = results
    for got in [sim["compiled"]] + [r["compiled"] for r in ranks]:
        assert got["keys"] == ["a", "b"] and got["equal"], got
        assert got["comm"][0] == got["comm"][1], got["comm"]
        # compiled first: a pmap smaller than the world and a nested pmap build their meshes under tracing
        assert got["first"] == {"half": True, "nested": True}, got["first"]
    assert sim["compiled"]["half"] is None  # (simulated: any size compiles)
    for got in ranks:
        msg = got["compiled"]["half"]
        assert msg and "must map an axis of the world's size (4 processes; this one maps 2)" in msg, msg
        assert "Fix:" in msg


def test_sizes_that_do_not_fit_the_world(results):
    _, ranks = results
    for got in ranks:
        e = got["errors"]
        assert "size 8" in e["larger"] and "4 processes (a pmap larger than the world)" in e["larger"]
        assert "nested pmap of size 4 does not fit" in e["nested"] and "leave 2 processes" in e["nested"]


def test_pmap_and_nested_pmap_under_torchrun():
    """The documented example: a 2x2 nested pmap and a size-4 pmap on 4 torchrun processes equal
    the simulated mesh (values and gradients)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(root / "examples" / "nested_pmap.py")]
    p = subprocess.run(cmd, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "OK: pmap and nested pmap agree between the meshes" in p.stdout
    assert "[[24.0, 28.0], [32.0, 36.0]] on every device" in p.stdout
