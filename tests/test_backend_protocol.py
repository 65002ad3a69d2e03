"""The backend protocol (`shmap/backends/protocol.py`): both backends implement it, and the front
end asks a backend only what the protocol declares, never which backend it is."""
from __future__ import annotations

import ast
import inspect
import pathlib

from shmap.backends.distributed import Distributed
from shmap.backends.protocol import Backend
from shmap.backends.simulated import SIMULATED, Simulated

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "shmap"

#: the attributes the protocol declares (methods and the two properties)
DECLARED = {n for n in vars(Backend) if not n.startswith("_")}


def _params(fn):
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_both_backends_implement_every_method_with_its_signature():
    assert Backend.__abstractmethods__, "the protocol declares no methods"
    for cls in (Simulated, Distributed):
        assert issubclass(cls, Backend)
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} out"
        assert isinstance(cls.device_dims, bool) and cls.name
        for name in Backend.__abstractmethods__:
            assert _params(getattr(cls, name)) == _params(getattr(Backend, name)), (cls.__name__, name)
    assert isinstance(SIMULATED, Backend)
    assert Simulated.device_dims and not Distributed.device_dims


def _backend_attributes(path):
    """(line, attribute) for every `<...>.backend.<attr>` and `backend.<attr>` in the module."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Attribute):
            v = n.value
            if (isinstance(v, ast.Attribute) and v.attr == "backend") or (isinstance(v, ast.Name) and v.id == "backend"):
                out.append((n.lineno, n.attr))
    return out


#: the front end proper: typing, dispatch, collectives, the boundary, nesting (dtensor.py, the
#: DTensor layer of the distributed mesh, may use that backend's helpers)
FRONT = ("tensor.py", "special.py", "recording.py", "batching.py", "collectives.py", "operands.py",
         "shard_map.py", "spec_tree.py", "nesting.py", "pmap.py", "interop.py", "custom_function.py", "per_device.py",
         "context.py")


def test_the_front_end_asks_a_backend_only_what_the_protocol_declares():
    """Modules outside `shmap/backends/` call protocol members only (no `backend.batched`, no
    private helpers), and the front end imports no backend implementation to ask which one it has."""
    undeclared, imports = [], []
    for p in sorted(PKG.glob("*.py")) + [PKG / "kernels" / "bridge.py"]:
        for line, attr in _backend_attributes(p):
            if attr not in DECLARED:
                undeclared.append(f"{p.relative_to(ROOT)}:{line}: backend.{attr}")
    for name in FRONT:
        p = PKG / name
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[-1] in ("simulated", "distributed"):
                imports.append(f"{p.relative_to(ROOT)}:{n.lineno}")
    assert not undeclared, f"front end uses backend attributes the protocol does not declare: {undeclared}"
    assert not imports, f"front-end modules import a backend implementation: {imports}"
