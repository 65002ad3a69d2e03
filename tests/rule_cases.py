"""Every collective's registered type rule (`collectives.COLLECTIVES[name].rule`) against what a
backend produces: run each collective in a body on a mesh (simulated or distributed) and compare
the result's vma and per-device shape with the rule's prediction, computed without running."""
from __future__ import annotations

import torch

import shmap
from shmap import P
from shmap.collectives import COLLECTIVES

#: (collective, axes, call(x, axes), rule params, operand spec, operand per-device shape): mesh (i=2, j=2)
CASES = [
    ("psum", ("i", "j"), lambda x, a: shmap.psum(x, a), {}, P("i", "j"), (3, 4)),
    ("pmean", ("i", "j"), lambda x, a: shmap.pmean(x, a), {}, P("i", "j"), (3, 4)),
    ("pmax", ("i", "j"), lambda x, a: shmap.pmax(x, a), {}, P("i", "j"), (3, 4)),
    ("pmin", ("i",), lambda x, a: shmap.pmin(x, a), {}, P("i"), (3, 4)),
    ("pvary", ("i",), lambda x, a: shmap.pvary(x, a), {}, P("j"), (3, 4)),
    ("pcast", ("j",), lambda x, a: shmap.pcast(x, a, to="unreduced"), {}, P("i", "j"), (3, 4)),
    ("all_gather", ("j",), lambda x, a: shmap.all_gather(x, a, axis=1, tiled=True), dict(axis=1, tiled=True),
     P("i", "j"), (3, 4)),
    ("all_gather", ("j",), lambda x, a: shmap.all_gather(x, a, axis=2), dict(axis=2, tiled=False), P("i"), (3, 4)),
    ("all_gather_invariant", ("j",), lambda x, a: shmap.all_gather_invariant(x, a), dict(axis=0, tiled=False),
     P("i", "j"), (3, 4)),
    ("psum_scatter", ("j",), lambda x, a: shmap.psum_scatter(x, a, scatter_dimension=1, tiled=True),
     dict(scatter_dimension=1, tiled=True), P("i", "j"), (3, 4)),
    ("psum_scatter", ("j",), lambda x, a: shmap.psum_scatter(x, a), dict(scatter_dimension=0, tiled=False),
     P(None, "j"), (2, 5)),
    ("ppermute", ("j",), lambda x, a: shmap.ppermute(x, a, [(0, 1), (1, 0)]), {}, P("i", "j"), (3, 4)),
    ("pshuffle", ("j",), lambda x, a: shmap.pshuffle(x, a, [1, 0]), {}, P("j"), (3, 4)),
    ("all_to_all", ("j",), lambda x, a: shmap.all_to_all(x, a, 0, 1, tiled=True),
     dict(split_axis=0, concat_axis=1, tiled=True), P("i", "j"), (4, 4)),
    ("all_to_all", ("j",), lambda x, a: shmap.all_to_all(x, a, 0, 1), dict(split_axis=0, concat_axis=1, tiled=False),
     P("i", "j"), (2, 4)),
    ("axis_index", ("i",), lambda x, a: shmap.axis_index(a), {}, P("i"), (3, 4)),
]


def rule_mismatches(mesh) -> list:
    """Messages for every case whose result differs from its rule's prediction (empty: all agree)."""
    bad = []
    for name, axes, call, params, spec, block in CASES:
        n = 2 ** len(axes)
        seen = {}

        def body(x, call=call, axes=axes, seen=seen):
            out = call(x, axes if len(axes) > 1 else axes[0])
            seen["in"] = (shmap.vma(x), tuple(x.shape))
            seen["out"] = (shmap.vma(out), tuple(out.shape))
            left = shmap.vma(out) | shmap.unreduced_axes(out)
            return shmap.psum(out.sum() * 0, tuple(a for a in ("i", "j") if a in left)) if left else out.sum() * 0

        glob = [s * (2 if e is not None else 1) for s, e in zip(block, list(spec) + [None] * 4)]
        x = torch.arange(float(torch.Size(glob).numel())).reshape(glob)
        shmap.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P())(shmap.device_put(x, mesh, spec))
        want = COLLECTIVES[name].rule(seen["in"][0], seen["in"][1], axes, n, **params)
        if (frozenset(want[0]), tuple(want[1])) != (frozenset(seen["out"][0]), seen["out"][1]):
            bad.append(f"{name}{params}: the rule says vma {sorted(want[0])}, shape {want[1]}; the backend gave "
                       f"vma {sorted(seen['out'][0])}, shape {seen['out'][1]}")
    return bad
