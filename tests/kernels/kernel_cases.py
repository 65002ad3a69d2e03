"""Kernels with seeded bugs, shared by the interpreter and shared-memory tests.

They live in an importable module (not inside test functions) because the
shared-memory runtime sends kernels to worker processes by reference.
"""
import os

import torch

from shmap import kernels as K

DMA, REGULAR = K.SemaphoreType.DMA, K.SemaphoreType.REGULAR
PERMUTE_SCRATCH = [DMA, DMA]


def ring_permute(x, o, send, recv):
    me, n = K.device_id(), K.num_devices()
    copy = K.remote_copy(x, o, send, recv, (me + 1) % n)
    copy.start()
    copy.wait()


def missing_wait_send(x, o, send, recv):
    """Bug: the sender never waits for its send semaphore."""
    me, n = K.device_id(), K.num_devices()
    copy = K.remote_copy(x, o, send, recv, (me + 1) % n)
    copy.start()
    copy.wait_recv()


def receive_without_sender(x, o, send, recv):
    """Bug: device 1 never sends, so device 2 waits forever."""
    me, n = K.device_id(), K.num_devices()
    copy = K.remote_copy(x, o, send, recv, (me + 1) % n)
    if me != 1:
        copy.start()
        copy.wait_send()
    copy.wait_recv()


def two_senders(x, o, send, recv):
    """Bug: devices 0 and 1 both copy into device 2's whole output."""
    me = K.device_id()
    copy = K.remote_copy(x, o, send, recv, 2)
    if me in (0, 1):
        copy.start()
        copy.wait_send()
    if me == 2:
        copy.wait_recv()
        copy.wait_recv()


def raises_on_device_1(x, o, send, recv):
    """Bug: device 1 raises before sending; its neighbour would wait for it forever."""
    me, n = K.device_id(), K.num_devices()
    copy = K.remote_copy(x, o, send, recv, (me + 1) % n)
    if me == 1:
        raise ValueError("bad block on device 1")
    copy.start()
    copy.wait()


def dies_on_device_1(x, o, send, recv):
    """Device 1's process exits abruptly (only meaningful on the shared-memory runtime)."""
    if K.device_id() == 1:
        os._exit(3)
    ring_permute(x, o, send, recv)


def all_reduce_without_capacity_wait(x_ref, o_ref, buf, local_sem, send_sem, recv_sem, cap_sem):
    """library.all_reduce_kernel with the capacity handshake's wait removed."""
    step, n, me = K.program_id(0), K.num_devices(), K.device_id()
    right, left = (me + 1) % n, (me - 1) % n
    slot = step % 2
    if step == 0:
        o_ref[...] = x_ref[...]
        c = K.local_copy(x_ref, buf.at[0], local_sem)
        c.start()
        c.wait()
    # (missing: if step >= 1: K.semaphore_wait(cap_sem, 1))
    hop = K.remote_copy(buf.at[slot], buf.at[1 - slot], send_sem, recv_sem, right)
    hop.start()
    if step >= 1:
        o_ref[...] += buf[slot]
    hop.wait()
    if step <= n - 3:
        K.semaphore_signal(cap_sem, 1, device_id=left)
    if step == n - 2:
        o_ref[...] += buf[1 - slot]


def shared_receive_semaphore(x, a, b, send, recv):
    """Bug: two copies into device 2 share one receive semaphore; whichever lands first
    satisfies the wait meant for `a`, so reading `a` races in some schedules only."""
    me = K.device_id()
    to_a = K.remote_copy(x, a, send, recv, 2)
    to_b = K.remote_copy(x, b, send, recv, 2)
    if me == 0:
        to_a.start()
        to_a.wait_send()
    elif me == 1:
        to_b.start()
        to_b.wait_send()
    if me != 2:
        a[...] = torch.zeros(a.shape)
        b[...] = torch.zeros(b.shape)
    else:
        to_a.wait_recv()
        a[...] = a[...] * 2
        to_b.wait_recv()


def result_depends_on_timing(x, o, sem):
    """No race, but the output is a semaphore's value at a timing-dependent moment."""
    me = K.device_id()
    if me == 1:
        K.semaphore_signal(sem, 1, device_id=0)
    if me == 0:
        o[...] = torch.full(o.shape, float(K.semaphore_read(sem)))
        K.semaphore_wait(sem, 1)
    else:
        o[...] = torch.zeros(o.shape)


def double_barrier(x, o, send, recv):
    """The seed's neighbour barrier on the barrier semaphore, then a scoped second barrier."""
    me, n = K.device_id(), K.num_devices()
    left, right = (me - 1) % n, (me + 1) % n
    barrier = K.get_barrier_semaphore()
    for peer in (left, right):
        K.semaphore_signal(barrier, 1, device_id=peer)
    K.semaphore_wait(barrier, 2)

    def second(sem):
        for peer in (left, right):
            K.semaphore_signal(sem, 1, device_id=peer)
        K.semaphore_wait(sem, 2)

    K.run_scoped(second, REGULAR)
    ring_permute(x, o, send, recv)


def scoped_staging(x, o, send, recv):
    """Copy through a run_scoped staging buffer on both ends."""
    me, n = K.device_id(), K.num_devices()

    def body(stage, sem):
        c = K.local_copy(x, stage, sem)
        c.start()
        c.wait()
        hop = K.remote_copy(stage, o, send, recv, (me + 1) % n)
        hop.start()
        hop.wait()

    K.run_scoped(body, K.Buffer(x.shape, x.dtype), DMA)


def scoped_copy_left_in_flight(x, o, send, recv):
    """Bug: the scope ends while a copy out of its buffer is still in flight."""
    me, n = K.device_id(), K.num_devices()
    holder = {}

    def body(stage):
        stage[...] = x[...]
        holder["copy"] = K.remote_copy(stage, o, send, recv, (me + 1) % n)
        holder["copy"].start()

    K.run_scoped(body, K.Buffer(x.shape, x.dtype))
    holder["copy"].wait()


def transport_rank(rank, world, name, capacities, results):
    """One rank of the ShmTransport test: run every collective (once per arena capacity; a
    small arena forces chunking) and report (check, max abs error) as plain floats."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    every = [torch.randn(world, 3, 700, generator=g) for _ in range(world)]
    mine = every[rank]
    report = []
    for i, capacity in enumerate(capacities):
        tr = K.ShmTransport(f"{name}-{i}", rank, world, capacity=capacity, timeout=30)
        out = torch.empty_like(mine)
        tr.all_reduce(mine, out=out)
        inplace = mine.clone()
        tr.all_reduce(inplace, out=inplace)  # out may be the input itself
        checks = [
            ("all_reduce", tr.all_reduce(mine), sum(every)),
            ("all_reduce_out", out, sum(every)),
            ("all_reduce_inplace", inplace, sum(every)),
            ("all_gather", tr.all_gather(mine[0]), torch.stack([e[0] for e in every])),
            ("reduce_scatter", tr.reduce_scatter(mine), sum(e[rank] for e in every)),
            ("all_to_all", tr.all_to_all(mine), torch.stack([e[rank] for e in every])),
            ("ppermute", tr.ppermute(mine[0], [(j, (j + 1) % world) for j in range(world)]),
             every[(rank - 1) % world][0]),
        ]
        tr.barrier()
        for check, got, want in checks:
            err = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
            report.append((f"capacity={capacity} {check}", err))
        tr.close()
    results.put((rank, report))


def leaks_on_odd_devices(x, o, send, recv):
    """Bug on devices 1 and 3 only: they never wait for their send semaphore."""
    me, n = K.device_id(), K.num_devices()
    copy = K.remote_copy(x, o, send, recv, (me + 1) % n)
    copy.start()
    if me % 2 == 0:
        copy.wait_send()
    copy.wait_recv()


def poll_until_signalled(x, o, flag):
    """Device 1 writes its output many times over (each write a scheduling point), then signals device 0,
    which polls its REGULAR semaphore `flag` until it does: a poll that ends."""
    if K.device_id() == 1:
        for _ in range(50):
            o[...] = x[...]
        K.semaphore_signal(flag, 1, device_id=0)
    else:
        while K.semaphore_read(flag) == 0:
            pass
        K.semaphore_wait(flag, 1)
    o[...] = torch.ones(o.shape)


def polls_forever(x, o, send, recv):
    """Copies its block, then polls a semaphore no device signals (a wait written as a loop)."""
    o[...] = x[...]
    while K.semaphore_read(recv) == 0:
        pass


def scoped_dtypes_differ(x, o, send, recv):
    """Device 0 allocates its scoped buffers as int32, the others as float32; each copies its `src` into
    the next device's `dst` (same name and shape, another dtype)."""
    me, n = K.device_id(), K.num_devices()

    def body(src, dst):
        src[...] = x[...] + 0.5
        bar = K.get_barrier_semaphore()
        K.semaphore_signal(bar, 1, device_id=(me + 1) % n)
        K.semaphore_wait(bar, 1)
        h = K.remote_copy(src, dst, send, recv, (me + 1) % n)
        h.start()
        h.wait()
        o[...] = dst[...]
        K.semaphore_signal(bar, 1, device_id=(me + 1) % n)
        K.semaphore_wait(bar, 1)

    dt = torch.int32 if me == 0 else torch.float32
    K.run_scoped(body, K.Buffer((4,), dt), K.Buffer((4,), dt))


def strided_shift(x, o, sem):
    """o[:, 1:] = o[:, :-1] with one local copy between overlapping (strided) slices of one buffer."""
    o[...] = x[...]
    c = K.local_copy(o.at[:, 0:9], o.at[:, 1:10], sem)
    c.start()
    c.wait()


def contiguous_shift(x, o, sem):
    """o[1:4] = o[0:3] with one local copy between overlapping contiguous slices of one buffer."""
    o[...] = x[...]
    c = K.local_copy(o.at[0:3], o.at[1:4], sem)
    c.start()
    c.wait()
