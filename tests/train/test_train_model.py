"""shmap/train/model.py: one per-device program, every mesh equal to plain PyTorch, and the
communication the cookbook describes for each parallelism."""
import ast
from pathlib import Path

import optree
import pytest
import torch

import shmap
from shmap.train import loop, model

from .tiny import MESHES, tiny


def _loss_and_grads(cfg):
    run = loop.Run(cfg)
    params, _ = run.fresh_state()
    leaves, treedef = optree.tree_flatten(params)
    leaves = [p.requires_grad_() for p in leaves]
    with shmap.comm_log() as fwd:
        loss = run.loss(optree.tree_unflatten(treedef, leaves), run.batch(0))
    with shmap.comm_log() as bwd:
        grads = torch.autograd.grad(loss, leaves)
    return loss, grads, fwd, bwd


_REF = {}


@pytest.mark.parametrize("mesh, block", [(m, "prenorm") for m in MESHES + ["data=2,tensor=2", "data=1,tensor=1"]]
                         + [("fsdp=2,tensor=4", "cookbook")])
def test_every_mesh_gives_the_loss_and_gradients_of_plain_pytorch(mesh, block):
    if block not in _REF:
        _REF[block] = _loss_and_grads(tiny("none", block=block))
    ref_loss, ref_grads, _, _ = _REF[block]
    loss, grads, _, _ = _loss_and_grads(tiny(mesh, block=block))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)


L = 2                      # layers of the tiny model
MATMUL_WEIGHTS = 4 * L + 3  # qkv, attention out, MLP in and out per layer; embedding, positions, output
NORMS = 2 * L + 1           # the pre-norm scales (sharded over fsdp, replicated over data and tensor)
WEIGHTS = MATMUL_WEIGHTS + NORMS


@pytest.mark.parametrize("mesh, fwd, bwd", [
    # DP: one all-reduce per gradient (and the loss's pmean)
    ("data=4", {"psum": 1}, {"psum": MATMUL_WEIGHTS + NORMS}),
    # FSDP: an all-gather per weight forward, a reduce-scatter per weight backward (norm scales too)
    ("fsdp=4", {"all_gather": WEIGHTS, "psum": 1}, {"psum_scatter": WEIGHTS}),
    # TP: the psums after the row-parallel projections, and their Megatron partners in the backward
    ("tensor=4", {"psum": 2 * L}, {"psum": 2 * L}),
    ("fsdp=2,tensor=2", {"all_gather": WEIGHTS, "psum": 2 * L + 1},
     {"psum_scatter": WEIGHTS, "psum": 2 * L}),
])
def test_per_step_communication_is_what_the_cookbook_describes(mesh, fwd, bwd):
    _, _, f, b = _loss_and_grads(tiny(mesh))
    assert f.summary() == fwd
    assert b.summary() == bwd
    assert {e.axes for e in b.events if e.kind == "psum_scatter"} <= {("fsdp",)}


def test_fsdp_holds_one_nth_of_every_weight():
    layout = model.Layout({"fsdp": 4})
    specs = model.param_specs(tiny("fsdp=4"), layout)
    sharded = [s for s in optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, shmap.PartitionSpec))
               if "fsdp" in str(s)]
    assert len(sharded) == WEIGHTS


def test_initialisation_is_deterministic_and_independent_of_the_mesh():
    a = model.init_params(tiny("none"))
    b = model.init_params(tiny("fsdp=8"))
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert torch.equal(x, y)
    c = model.init_params(tiny("none", seed=1))
    assert not torch.equal(a["embedding"], c["embedding"])


def test_the_recipe_uses_only_shmaps_public_api():
    """shmap/train is a user of shmap: `import shmap` / `from shmap import <public name>` only."""
    root = Path(model.__file__).parent
    public = set(shmap.__all__)
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("shmap"):
                assert node.module == "shmap", f"{path.name}: from {node.module} import ..."
                assert {a.name for a in node.names} <= public, f"{path.name}: {[a.name for a in node.names]}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    assert not a.name.startswith("shmap.") or a.name == "shmap", f"{path.name}: import {a.name}"


def test_the_readme_spec_table_is_the_code():
    """Every parameter row of the README's table equals `param_specs` on that mesh."""
    import re

    text = (Path(model.__file__).parents[2] / "README.md").read_text()
    rows = {m.group(1): [c.strip().strip("`") for c in m.group(2).split("|")[0:4]]
            for m in re.finditer(r"^\| ([a-zA-Z_ ]+) \| \([^)]*\) \|(.*)\|$", text, flags=re.M)}
    where = {"embedding": ("embedding",), "pos_embed": ("pos_embed",),
             "attention qkv": ("layers", "0", "attention", "qkv"), "attention out": ("layers", "0", "attention", "out"),
             "MLP in": ("layers", "0", "mlp", "in_kernel"), "MLP out": ("layers", "0", "mlp", "out_kernel"),
             "output kernel": ("linear_out", "kernel"), "norm scales": ("final_norm",)}
    meshes = ["data=2", "fsdp=2", "tensor=2", "data=2,fsdp=2,tensor=2"]
    for name, path in where.items():
        for mesh, cell in zip(meshes, rows[name]):
            spec = model.param_specs(tiny(mesh), model.Layout(tiny(mesh).mesh))
            for k in path:
                spec = spec[k]
            assert repr(spec) == cell, (name, mesh)
