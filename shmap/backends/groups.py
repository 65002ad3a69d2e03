"""Process groups over axis tuples of a distributed mesh: `Group`."""
from __future__ import annotations

from .config import _OPTIONS, _TRANSPORTS

_DIST = None


def _dist():
    """torch.distributed, imported on first use (a simulated mesh never needs it)."""
    global _DIST
    if _DIST is None:
        import torch.distributed

        _DIST = torch.distributed
    return _DIST


def _gather_into(out, x, group):
    """The all_gather of `x` into `out` ([n, *x.shape] flat) on `group`, async: torch's current name for it
    (`all_gather_into_tensor` is deprecated where `all_gather_single` exists)."""
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=True)


# --------------------------------------------------------------------------
# Process groups over axis tuples
# --------------------------------------------------------------------------
class Group:
    """The devices that differ from this one only along `axes` (in the given order).

    `index` is this device's position along `axes` (major-to-minor in the
    tuple's order); `ranks[t]` the global rank at position `t`; `g2t` maps the
    process group's own rank order (mesh order) to positions, or is None when
    the two agree.
    """

    __slots__ = ("axes", "n", "index", "ranks", "g2t", "t2g", "_backend", "_pg", "gloo", "_shm")

    def __init__(self, axes, n, index, ranks, g2t, backend):
        self.axes, self.n, self.index, self.ranks, self._backend = axes, n, index, ranks, backend
        self.g2t = g2t
        self.t2g = None if g2t is None else [g2t.index(t) for t in range(n)]
        self._pg = None
        self.gloo = True
        self._shm = None

    def pg(self):
        """The process group, created on first use.

        Creating one is collective over the world, so it happens only after
        the signature check has confirmed every rank is at this collective.
        """
        if self._pg is None:
            self._pg = self._backend._pg(self.axes)
            self.gloo = "gloo" in str(_dist().get_backend(self._pg)).lower()
        return self._pg

    def shm(self, x):
        """This group's configured CPU transport (e.g. shared memory) when `x` is on the CPU, else None.

        Its ranks are the process group's, so the same position permutations apply.
        """
        name = _OPTIONS["transport"]
        if name == "torch" or x.device.type != "cpu":
            return None
        if self._shm is None or self._shm[0] != name:
            factory = _TRANSPORTS.get(name)
            if factory is None:
                raise ValueError(f"shmap transport {name!r} (SHMAP_TRANSPORT) is not registered; known: "
                                 f"{['torch', *_TRANSPORTS]}. Fix: import the module that provides it "
                                 "(shmap.kernels.transport for 'shm'), or use 'torch'.")
            self._shm = (name, factory(self.pg()))  # registered by the transport's module
        return self._shm[1]

    def torch_ranks(self, positions):
        """Process-group ranks of tuple positions."""
        return list(positions) if self.t2g is None else [self.t2g[p] for p in positions]
