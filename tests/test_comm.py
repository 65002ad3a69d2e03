"""comm_log: what is recorded, nesting, bytes."""
import torch

import shmap
from shmap import P
from shmap.comm import COMMUNICATING


def test_records_kind_axes_bytes_and_nests():
    mesh = shmap.make_mesh((4, 2), ("i", "j"))
    x = torch.randn(8, 6, dtype=torch.float32)

    def body(v):
        return shmap.all_gather_invariant(shmap.psum(v, "j"), "i", tiled=True)

    f = shmap.shard_map(body, mesh=mesh, in_specs=P("i", "j"), out_specs=P(None, None))
    with shmap.comm_log() as outer:
        with shmap.comm_log() as inner:
            f(x)
        f(x)
    assert [(e.kind, e.axes, e.bytes, e.shape) for e in inner.events] == [
        ("psum", ("j",), 2 * 3 * 4, (2, 3)), ("all_gather_invariant", ("i",), 2 * 3 * 4, (2, 3))]
    assert outer.count() == 4 and inner.count("psum") == 1
    assert inner.total_bytes == 48 and inner.summary() == {"psum": 1, "all_gather_invariant": 1}
    with shmap.comm_log() as after:
        pass
    assert len(after) == 0


def test_pvary_is_not_communication():
    assert "pvary" not in COMMUNICATING
    mesh = shmap.make_mesh((2,), ("i",))
    with shmap.comm_log() as log:
        shmap.shard_map(lambda w: shmap.pvary(w, "i"), mesh=mesh, in_specs=P(), out_specs=P("i"))(torch.ones(2))
    assert log.count() == 0


def test_count_refuses_a_kind_it_never_records():
    """A misspelt kind (or pmean, recorded as its psum) counted 0, so `assert log.count('pmeann') == 0` passed."""
    import pytest

    mesh = shmap.make_mesh((4,), ("i",))
    with shmap.comm_log() as log:
        shmap.shard_map(lambda v: shmap.pmean(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(torch.ones(4))
    assert log.count("psum") == 1 and log.count("ppermute") == 0
    with pytest.raises(ValueError, match=r"kind 'pusm' is not a collective comm_log records.*'psum'"):
        log.count("pusm")
    with pytest.raises(ValueError, match=r"pmean is recorded as the psum it performs: count\('psum'\)"):
        log.count("pmean")
