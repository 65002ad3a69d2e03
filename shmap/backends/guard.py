"""The guard of one process in one torch.distributed world (`Watch`): signatures, checks, black boxes.

`Watch` counts each collective, writes the signature its payload carries (or,
in strict mode, exchanges one before it), checks what arrives, and keeps a
black box (the collective it is in) readable by its same-host peers.  Its
watched waits are `waits.WatchedWaits`; `watchdog.watch()` creates it.
"""
from __future__ import annotations

import os
import struct
import threading
import time
import zlib
from datetime import timedelta

import torch

from ..errors import CollectiveMismatchError
from .config import _OPTIONS
from .groups import _dist, _gather_into
from .signatures import Seal, _Pending, describe, signature16  # noqa: F401  (Seal: annotations)
from .waits import WatchedWaits, _ranks, _user_location


# --------------------------------------------------------------------------
# Per-process state over one torch.distributed world
# --------------------------------------------------------------------------
class Watch(WatchedWaits):
    """The guard of one process in one torch.distributed world."""

    def __init__(self):
        dist = _dist()
        self.world_pg = dist.group.WORLD
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        try:
            self.pg_timeout = self.store.timeout.total_seconds()
        except Exception:  # noqa: BLE001 - older stores: torch's default
            self.pg_timeout = 1800.0
        self.control = None
        if self.world > 1:
            # A gloo group of its own: signatures never queue behind data (and
            # stay on the CPU when the data goes through NCCL).
            self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.pg_timeout))
        self.counter = 0
        self.epoch = 0  # shard_map bodies completed (part of every signature)
        self._crc: dict = {}  # (kind, axes, shape, dtype, extra) -> (crc32 of its description, description)
        self.box = None  # this rank's black box: its current collective, readable by peers on its host
        self._box_key, self._box_len = None, 0
        self.boxes: dict = {}  # rank -> peer's black box (same host)
        self.pids: dict = {}  # rank -> peer's process id (same host and PID namespace: `peer_gone`)
        if self.world > 1:
            try:
                self._open_boxes()
            except Exception:  # noqa: BLE001 - diagnostics only (no /dev/shm, no mmap, ...)
                self.box = None
        self.lock = threading.Lock()
        self.current = None  # (counter, kind, axes, shape, dtype, extra) of the collective in progress
        self.last = None  # the same for the last collective that completed
        self.events: dict = {}  # rank -> (status, text, first seen)
        self.reported = False
        self.status = None  # what this rank reported: "exited", "failed", "failed-in-turn"
        self.poisoned = False

    def _open_boxes(self):
        """Black boxes: each rank writes the collective it enters into a small shared-memory map that
        its peers on the same host mapped at make_mesh; a rank that dies without a word (SIGKILL, or
        gloo aborting it on a size mismatch) still tells them where it was.  No file outlives this:
        each rank unlinks its own once every rank has mapped its peers'."""
        import mmap
        import socket
        import tempfile

        host = socket.gethostname()
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix=f"shmap-box-{self.rank}-", dir=where)
        try:
            os.ftruncate(fd, _BOX)
            self.box = mmap.mmap(fd, _BOX)
        finally:
            os.close(fd)
        try:
            ns = _pid_namespace()
            self.store.set(f"shmap/box/{self.rank}", f"{host}\t{ns}\t{os.getpid()}\t{path}")
            for r in range(self.world):
                if r == self.rank:
                    continue
                h, their_ns, pid, p = self.store.get(f"shmap/box/{r}").decode().split("\t", 3)
                if h == host and ns and their_ns == ns:  # (a container of its own may share the host name)
                    self.pids[r] = int(pid)
                    try:
                        with open(p, "rb") as f:
                            self.boxes[r] = mmap.mmap(f.fileno(), _BOX, access=mmap.ACCESS_READ)
                    except OSError:
                        pass
            self.store.add("shmap/boxes", 1)
            deadline = time.monotonic() + min(60.0, self.pg_timeout)
            while self.store.add("shmap/boxes", 0) < self.world and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            os.unlink(path)

    def peer_gone(self, r) -> bool:
        """Whether rank r (same host) has ended: its process is gone or a zombie.  A rank killed by a
        signal reports nothing, and the shared-memory transport has no connection that closes."""
        pid = self.pids.get(r)
        if pid is None:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[:1] == [b"Z"]
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def _box_write(self, n, kind, axes, shape, dtype, extra):
        """Layout: counter, epoch, description length (3 x u32), description (rewritten when it changes)."""
        key = (kind, axes, shape, dtype, extra)
        if key != self._box_key:
            self._static(kind, axes, shape, dtype, extra)
            got = self._crc.get(key)
            b = (got[1] if got is not None else describe(*key)).encode()[:_BOX - 12]
            self.box[12:12 + len(b)] = b
            self._box_key, self._box_len = key, len(b)
        _BOX_HEAD.pack_into(self.box, 0, n & 0xFFFFFFFF, self.epoch & 0xFFFFFFFF, self._box_len)

    def _box_record(self, r):
        """What rank r (same host) last entered: (counter, epoch, description, '') or None."""
        m = self.boxes.get(r)
        if m is None:
            return None
        try:
            n, epoch, k = _BOX_HEAD.unpack_from(m, 0)
            if not 0 < k <= _BOX - 12:
                return None
            return n, epoch, m[12:12 + k].decode(errors="replace"), ""
        except Exception:  # noqa: BLE001
            return None

    # ------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        return _OPTIONS["timeout"] or self.pg_timeout

    def begin(self, kind: str, axes: tuple, shape, dtype, extra: str = "", exchange: bool = False):
        """Count a collective and, in strict mode (or with `exchange`, when checks are on at all), launch
        its signature exchange (on its own group).

        `verify` waits for it and raises if the ranks disagree; the backend
        verifies before it launches the data exchange.  (Overlapping the two
        would hide the check's latency, but gloo collectives that disagree can
        crash a process instead of raising, so the data waits.)  In the
        default mode the signature travels inside the collective's payload
        instead (`seal` / `unseal`).
        """
        with self.lock:
            self.counter += 1
            n = self.counter
        self.current = (n, kind, axes, shape, dtype, extra)
        if self.box is not None:
            self._box_write(n, kind, axes, shape, dtype, extra)
        mode = _OPTIONS["check_collectives"]
        if self.control is None or not mode or (mode is True and not exchange):
            return None
        desc = describe(kind, axes, shape, dtype, extra)
        sig = torch.tensor([n, zlib.crc32(desc.encode())], dtype=torch.int64)
        out = torch.empty(self.world * 2, dtype=torch.int64)
        with torch.no_grad():
            work = _gather_into(out, sig, self.control)
        return _Pending(n, desc, sig, out, work)

    def sealing(self) -> bool:
        """Whether collectives carry their signature in their payload (the default mode)."""
        return _OPTIONS["check_collectives"] is True and self.control is not None

    def _static(self, kind, axes, shape, dtype, extra) -> int:
        key = (kind, axes, shape, dtype, extra)
        got = self._crc.get(key)
        if got is None:
            desc = describe(kind, axes, shape, dtype, extra)
            got = (zlib.crc32(desc.encode()), desc)
            if len(self._crc) < 4096:
                self._crc[key] = got
        return got[0]

    def next_signature16(self, kind, axes, shape, dtype, extra="") -> int:
        """The 16-bit signature the next collective (`begin` not yet called) will carry."""
        return signature16(self._static(kind, axes, shape, dtype, extra), self.counter + 1, self.epoch)

    def next_signature_bytes(self, kind, axes, shape, dtype, extra="") -> bytes:
        """The 8-byte signature the next collective (`begin` not yet called) will carry as moved data."""
        c = self._static(kind, axes, shape, dtype, extra)
        return struct.pack("<IHH", c, (self.counter + 1) & 0xFFFF, self.epoch & 0xFFFF)

    def seal(self, seal: "Seal"):
        """Write the current collective's signature into `seal`'s trailer (before it is launched)."""
        n, kind, axes, shape, dtype, extra = self.current
        seal.write(self._static(kind, axes, shape, dtype, extra), n, self.epoch)

    def unseal(self, seal: "Seal", ranks):
        """Check the trailer the collective delivered; `CollectiveMismatchError` if a rank's differs."""
        if not seal.ok():
            self.poisoned = True
            self._mismatch_found(ranks, "its payload's signature")

    def body_done(self):
        """A shard_map body ended: in strict mode exchange a signature; otherwise count it (signatures
        include the count, so a rank that ended a body early disagrees at its next collective)."""
        if _OPTIONS["check_collectives"] == "strict":
            return False
        self.epoch += 1
        return True

    def verify(self, pending, moved=False):
        """Wait for a signature exchange and raise `CollectiveMismatchError` if the ranks disagree
        (`moved`: it ran alongside the data exchange, which has completed)."""
        if pending is None:
            return
        self.wait(pending.work, None, None, gloo=True, signature=True)
        if not pending.matches():
            if moved:  # some ranks may still be stuck in the data exchange: compare through the store
                self.poisoned = True
                self._mismatch_found(None, "the signature exchange alongside it")
            self._mismatch(pending.n, pending.desc)

    def overlapping(self) -> bool:
        """Whether a collective without a payload signature may run its signature exchange alongside
        the data (default mode) rather than before it (strict)."""
        return _OPTIONS["check_collectives"] is True

    def check(self, kind: str, axes: tuple, shape, dtype, extra: str = ""):
        """A synchronous signature check (a collective with no data of its own, e.g. a body's end)."""
        self.verify(self.begin(kind, axes, shape, dtype, extra))
        self.done()

    def done(self):
        if self.current is not None:
            self.last = self.current
            self.current = None

    def describe_current(self) -> str:
        if self.current is None:
            return "a collective"
        n, *rest = self.current
        return f"collective #{n} ({describe(*rest)})"

    def _mismatch(self, n, desc):
        dist = _dist()
        mine = (n, desc, _user_location())
        got = [None] * self.world
        dist.all_gather_object(got, mine, group=self.control)
        groups: dict = {}
        for r, (cn, cd, loc) in enumerate(got):
            groups.setdefault((cn, cd), []).append((r, loc))
        lines = []
        for (cn, cd), members in sorted(groups.items(), key=lambda kv: kv[1][0][0]):
            ranks = [r for r, _ in members]
            locs = sorted({loc for _, loc in members if loc})
            where = f" at {', '.join(locs)}" if locs else ""
            lines.append(f"  {_ranks(ranks)}: collective #{cn}: {cd}{where}")
        raise CollectiveMismatchError(
            f"distributed mesh: the ranks called different collectives (rank {self.rank} is at collective "
            f"#{n}, {desc}):\n" + "\n".join(lines) + "\n"
            "Every rank must run the same collectives in the same order (on the simulated mesh all devices "
            "run one program). Usually a Python branch on a rank-dependent value, or an exception caught on "
            "some ranks only, sends ranks down different paths. Fix: branch per device with tensor ops "
            "(`torch.where`), or make the condition invariant first (`shmap.pmax(flag, axes)`). "
            "No data was exchanged: the process groups are still usable."
        )

    # ------------------------------------------------------------------
    def report(self, status: str, text: str):
        if self.reported:
            return
        self.reported = True
        self.status = status
        try:
            self.store.set(f"shmap/event/{self.rank}", f"{status}\n{text}")
            self.store.add("shmap/nevents", 1)
        except Exception:  # noqa: BLE001 - the store may already be gone at exit
            pass


def _pid_namespace() -> str:
    """This process's PID namespace ("" where /proc does not say): a peer's process id means the same
    process here only within the same one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


#: bytes of a black box (watch._open_boxes), and its header
_BOX = 512
_BOX_HEAD = struct.Struct("<III")

