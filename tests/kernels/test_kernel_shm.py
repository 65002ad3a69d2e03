"""The shared-memory runtime: real processes, failures that never hang, the per-rank transport."""
import time

import pytest
import torch
import torch.multiprocessing as mp

from shmap import kernels as K
from shmap.kernels.segments import new_group_name

from . import kernel_cases as cases

# Multi-process tests share one xdist worker: they compete for ports and both cores.
pytestmark = [pytest.mark.xdist_group("multiprocess"), pytest.mark.usefixtures("float32_default")]


def blocks(n, shape=(4,)):
    return [[torch.full(shape, float(d))] for d in range(n)]


def run_case(group, kernel, n=3, **kw):
    return group.run(kernel, blocks(n), K.Buffer((4,)), scratch=cases.PERMUTE_SCRATCH, **kw)


def assert_group_usable(group):
    outs = run_case(group, cases.ring_permute, n=4)
    assert [o[0].item() for o in outs] == [3.0, 0.0, 1.0, 2.0]


def test_runs_like_the_interpreter(shm_group):
    for kernel in (cases.ring_permute, cases.double_barrier, cases.scoped_staging):
        for n in (2, 3, 4):
            want = K.interpret(kernel, blocks(n), K.Buffer((4,)), scratch=cases.PERMUTE_SCRATCH)
            got = run_case(shm_group, kernel, n=n)
            for a, b in zip(want, got):
                assert torch.equal(a, b)


def test_exception_on_one_device_stops_all(shm_group):
    start = time.monotonic()
    with pytest.raises(K.DeviceError) as info:
        run_case(shm_group, cases.raises_on_device_1, n=4)
    assert time.monotonic() - start < 10  # peers were woken, not left to time out (20 s)
    msg = str(info.value)
    assert msg.startswith("device 1 raised ValueError: bad block on device 1")
    assert 'raise ValueError("bad block on device 1")' in msg
    assert_group_usable(shm_group)


def test_deadlock_times_out_with_the_waiting_line(shm_group):
    with pytest.raises(K.KernelTimeoutError) as info:
        run_case(shm_group, cases.receive_without_sender, timeout=1.0)
    msg = str(info.value)
    assert "device 2: wait_recv into 'o'[0:4]" in msg and "copy.wait_recv()" in msg
    assert "needs 16, semaphore 'recv' (DMA) is 0" in msg
    assert_group_usable(shm_group)


def test_a_loop_polling_a_semaphore_is_bounded_by_the_timeout(shm_group):
    """A poll (semaphore_read in a loop) is bounded as a blocking wait is: it ran forever."""
    start = time.monotonic()
    with pytest.raises(K.KernelTimeoutError, match=r"semaphore_read of 'recv' .* has returned 0 for longer than "
                                                   r"the timeout \(1.0 s\).*semaphore_wait"):
        run_case(shm_group, cases.polls_forever, timeout=1.0)
    assert time.monotonic() - start < 15
    assert_group_usable(shm_group)


def test_leftover_semaphore(shm_group):
    with pytest.raises(K.SemaphoreLeakError, match=r"semaphore 'send' \(DMA\) = 16"):
        run_case(shm_group, cases.missing_wait_send)
    assert_group_usable(shm_group)


def test_leftover_semaphores_of_every_device_are_reported(shm_group):
    """The parent checks every device once all have finished: every leak is reported, not only the first
    worker's (a worker raising on its own leak used to stop its peers before their check)."""
    with pytest.raises(K.SemaphoreLeakError) as info:
        run_case(shm_group, cases.missing_wait_send, n=3)
    msg = str(info.value)
    for d in range(3):
        assert f"device {d}: semaphore 'send' (DMA) = 16" in msg
    assert msg.startswith("the kernel ended with 3 semaphore(s) not at zero")
    with pytest.raises(K.SemaphoreLeakError) as info:
        run_case(shm_group, cases.leaks_on_odd_devices, n=4)
    msg = str(info.value)
    assert "device 1: semaphore 'send'" in msg and "device 3: semaphore 'send'" in msg
    assert "device 0:" not in msg and "device 2:" not in msg
    assert_group_usable(shm_group)


def test_kernel_must_be_importable(shm_group):
    def local_kernel(x, o, send, recv):
        pass

    with pytest.raises(K.KernelUsageError, match="module-level function"):
        run_case(shm_group, local_kernel)


def test_run_shm_with_explicit_group(shm_group):
    outs = K.run_shm(cases.ring_permute, blocks(2), K.Buffer((4,)),
                     scratch=cases.PERMUTE_SCRATCH, group=shm_group)
    assert [o[0].item() for o in outs] == [1.0, 0.0]


def test_dead_process_does_not_hang_its_peers():
    with K.ShmGroup(2, capacity=1 << 20, timeout=30.0) as group:
        start = time.monotonic()
        with pytest.raises(K.KernelError, match="device 1's process exited unexpectedly"):
            run_case(group, cases.dies_on_device_1, n=2)
        assert time.monotonic() - start < 15
        assert group.broken
        with pytest.raises(K.KernelError, match="unusable"):
            run_case(group, cases.ring_permute, n=2)


def test_transport_per_rank_processes():
    """Three independent rank processes join a group by name and run every collective;
    a 64 KiB arena forces chunking, a 1 MiB one does not."""
    world = 3
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(cases.transport_rank, args=(world, new_group_name(), [64 << 10, 1 << 20], results),
             nprocs=world, join=True)
    reports = dict(results.get() for _ in range(world))
    assert sorted(reports) == [0, 1, 2]
    for rank, report in reports.items():
        assert len(report) == 14
        for check, err in report:
            assert err < 1e-4, f"rank {rank}: {check}: max abs error {err}"


def test_a_copy_between_overlapping_slices_reads_the_source_first(shm_group):
    """As the interpreter does.  (torch's copy_ between overlapping views of one tensor smears or refuses;
    the runtime's views come from separate tensors over the shared arena, which torch cannot compare, and
    the result then depends on the copy loop: a helper saw a row smeared, silently.  This guards the
    agreement; it does not reproduce the smear on every machine.)"""
    xs = [[torch.arange(40.0).reshape(4, 10)]] * 2
    want = K.interpret(cases.strided_shift, xs, K.Buffer((4, 10)), scratch=[cases.DMA])
    got = shm_group.run(cases.strided_shift, xs, K.Buffer((4, 10)), scratch=[cases.DMA])
    assert torch.equal(got[0], want[0]) and torch.equal(got[0][0], torch.tensor([0.0] + list(range(9))))
    # Contiguous overlapping slices, shifted as the interpreter shifts them.
    xs = [[torch.arange(4.0)]] * 2
    got = shm_group.run(cases.contiguous_shift, xs, K.Buffer((4,)), scratch=[cases.DMA])
    assert torch.equal(got[0], torch.tensor([0.0, 0.0, 1.0, 2.0]))
