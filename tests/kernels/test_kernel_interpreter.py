"""The verifying interpreter: seeded bugs are caught deterministically, with clear messages."""
import time

import pytest
import torch

from shmap import kernels as K

from . import kernel_cases as cases

pytestmark = pytest.mark.usefixtures("float32_default")

DMA, REGULAR = K.SemaphoreType.DMA, K.SemaphoreType.REGULAR


def blocks(n, shape=(4,)):
    return [[torch.full(shape, float(d))] for d in range(n)]


def run_permute_case(kernel, n=3, **kw):
    return K.interpret(kernel, blocks(n), K.Buffer((4,)), scratch=cases.PERMUTE_SCRATCH, **kw)


def test_correct_kernel_runs_and_is_deterministic():
    outs = run_permute_case(cases.ring_permute, n=4)
    assert [o.tolist() for o in outs] == [[3.0] * 4, [0.0] * 4, [1.0] * 4, [2.0] * 4]
    run_permute_case(cases.ring_permute, n=4, explore=20)


def test_missing_wait_leaves_semaphore_nonzero():
    with pytest.raises(K.SemaphoreLeakError) as info:
        run_permute_case(cases.missing_wait_send)
    msg = str(info.value)
    assert "semaphore 'send' (DMA) = 16" in msg
    assert "device 0" in msg and "device 2" in msg
    assert "kernel_cases.py" in msg and "copy.start()" in msg  # where the copy was started
    assert ".wait_send()" in msg  # the fix


def test_receive_without_sender_is_a_deadlock():
    with pytest.raises(K.DeadlockError) as info:
        run_permute_case(cases.receive_without_sender)
    msg = str(info.value)
    assert "device 2: blocked in wait_recv into 'o'[0:4]" in msg
    assert "needs 16, semaphore 'recv' (DMA) is 0" in msg
    assert "copy.wait_recv()" in msg  # the source line
    for d in (0, 1):
        assert f"device {d}: finished the kernel" in msg


def test_a_loop_polling_a_semaphore_nobody_signals_is_a_deadlock():
    """Every device polls `recv` after the others finished or while all poll: it ran forever."""
    for seed in (0, 1, 2):
        with pytest.raises(K.DeadlockError) as info:
            run_permute_case(cases.polls_forever, seed=seed)
        msg = str(info.value)
        assert "a loop polls a semaphore that nothing left can change" in msg, msg
        assert "polls semaphore_read of 'recv' in a loop" in msg and "which returns 0" in msg, msg
        assert "while K.semaphore_read(recv) == 0" in msg and "semaphore_wait" in msg, msg
        assert f"seed={seed}" in msg
    # A poll that another device ends (it signals after its own work) still runs to the end.
    outs = K.interpret(cases.poll_until_signalled, blocks(2), K.Buffer((4,)), scratch=[REGULAR], explore=6)
    assert [o.tolist() for o in outs] == [[1.0] * 4, [1.0] * 4]


def test_two_senders_into_one_buffer_is_a_race():
    with pytest.raises(K.DataRaceError) as info:
        run_permute_case(cases.two_senders)
    msg = str(info.value)
    assert "data race on device 2's buffer 'o', elements [0:4]" in msg
    assert "started by device 0" in msg and "started by device 1" in msg
    assert "copy.start()" in msg


def test_removed_capacity_wait_is_a_race_in_every_schedule():
    xs = [[torch.randn(4, 8)] for _ in range(4)]
    scratch = [K.Buffer((2, 4, 8)), DMA, DMA, DMA, REGULAR]
    for seed in range(5):
        with pytest.raises(K.DataRaceError) as info:
            K.interpret(cases.all_reduce_without_capacity_wait, xs, K.Buffer((4, 8)),
                        scratch=scratch, grid=(3,), seed=seed)
        msg = str(info.value)
        assert "buffer 'buf'" in msg and "remote_copy('buf'" in msg
        assert f"seed={seed}" in msg


def test_exception_on_one_device_stops_all_and_names_it():
    start = time.monotonic()
    with pytest.raises(K.DeviceError) as info:
        run_permute_case(cases.raises_on_device_1, n=4)
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert msg.startswith("device 1 raised ValueError: bad block on device 1")
    assert 'raise ValueError("bad block on device 1")' in msg
    assert "The other 3 device(s) were stopped" in msg
    assert isinstance(info.value.__cause__, ValueError)


def test_same_seed_same_report():
    def report(seed):
        with pytest.raises(K.KernelError) as info:
            run_permute_case(cases.two_senders, seed=seed)
        return str(info.value)

    assert report(3) == report(3)


def test_exploration_finds_a_race_one_schedule_hides():
    xs = blocks(3)
    outs = (K.Buffer((4,)), K.Buffer((4,)))

    def run(**kw):
        return K.interpret(cases.shared_receive_semaphore, xs, outs, scratch=[DMA, DMA], **kw)

    clean = []
    for seed in range(12):
        try:
            run(seed=seed)
            clean.append(seed)
        except K.DataRaceError:
            pass
    assert clean, "some schedule should hide the race"
    with pytest.raises(K.DataRaceError) as info:
        run(seed=clean[0], explore=12)
    assert "found exploring seeds" in str(info.value)


def test_exploration_compares_outputs_across_schedules():
    xs = blocks(2)
    with pytest.raises(K.ScheduleDependenceError):
        K.interpret(cases.result_depends_on_timing, xs, K.Buffer((4,)), scratch=[REGULAR],
                    explore=12)


def test_barrier_semaphore_and_scoped_semaphores():
    outs = K.interpret(cases.double_barrier, blocks(3), K.Buffer((4,)),
                       scratch=cases.PERMUTE_SCRATCH, explore=6)
    assert [o[0].item() for o in outs] == [2.0, 0.0, 1.0]


def test_scoped_buffers():
    outs = K.interpret(cases.scoped_staging, blocks(3), K.Buffer((4,)),
                       scratch=cases.PERMUTE_SCRATCH, explore=6)
    assert [o[0].item() for o in outs] == [2.0, 0.0, 1.0]


def test_scope_exit_with_copy_in_flight():
    with pytest.raises(K.DeviceError, match="exited on device .* while remote_copy"):
        K.interpret(cases.scoped_copy_left_in_flight, blocks(2), K.Buffer((4,)),
                    scratch=cases.PERMUTE_SCRATCH, seed=0)


def test_uninitialised_output_is_nan():
    def writes_nothing(x, o):
        pass

    outs = K.interpret(writes_nothing, blocks(2), K.Buffer((3,)))
    assert all(torch.isnan(o).all() for o in outs)


def test_multiple_outputs_and_grid():
    def kernel(x, o1, o2):
        i, j = K.program_id(0), K.program_id(1)
        o1[i, j] = x[0] + i * 10 + j
        if i == 0 and j == 0:
            o2[...] = torch.full(o2.shape, float(K.num_programs(0) * K.num_programs(1)))

    outs = K.interpret(kernel, blocks(2, (1,)), (K.Buffer((2, 3)), K.Buffer((1,))), grid=(2, 3))
    o1, o2 = outs[1]
    assert o1.tolist() == [[1, 2, 3], [11, 12, 13]] and o2.item() == 6


def test_regular_semaphore_deadlock_message():
    def kernel(x, o, sem):
        K.semaphore_wait(sem, 2)

    with pytest.raises(K.DeadlockError, match=r"semaphore_wait\('sem', 2\).*needs 2"):
        K.interpret(kernel, blocks(2), K.Buffer((4,)), scratch=[REGULAR])


def test_local_read_write_race_with_outgoing_copy():
    def kernel(x, o, stage, send, recv):
        me, n = K.device_id(), K.num_devices()
        stage[...] = x[...]
        hop = K.remote_copy(stage, o, send, recv, (me + 1) % n)
        hop.start()
        stage[...] = x[...] * 2  # overwrites the source before wait_send
        hop.wait()

    with pytest.raises(K.DataRaceError) as info:
        K.interpret(kernel, blocks(2), K.Buffer((4,)),
                    scratch=[K.Buffer((4,)), DMA, DMA])
    assert "stage[...] = x[...] * 2" in str(info.value)


def test_borrow_is_an_access_for_the_whole_block():
    def kernel(x, o, stage, send, recv):
        me, n = K.device_id(), K.num_devices()
        hop = K.remote_copy(x, stage, send, recv, (me + 1) % n)
        hop.start()
        with K.borrow(stage) as view:  # the neighbour's copy may land while we look
            o[...] = view * 2
        hop.wait()

    with pytest.raises(K.DataRaceError, match=r"\(borrow (start|end)\) of 'stage'\[0:4\]"):
        K.interpret(kernel, blocks(2), K.Buffer((4,)), scratch=[K.Buffer((4,)), DMA, DMA])


def test_borrow_zero_copy_and_write_through_check():
    def good(x, o):
        with K.borrow(x) as xs, K.borrow(o, write=True) as out:
            torch.mul(xs, 3, out=out)

    outs = K.interpret(good, blocks(2), K.Buffer((4,)))
    assert outs[1].tolist() == [3.0] * 4

    def bad(x, o):
        o[...] = x[...]
        with K.borrow(o) as view:
            view += 1

    with pytest.raises(K.DeviceError, match="written through, but it is a read borrow"):
        K.interpret(bad, blocks(2), K.Buffer((4,)))
    with pytest.raises(K.DeviceError, match="inputs are read-only"):
        K.interpret(lambda x, o: K.borrow(x, write=True), blocks(2), K.Buffer((4,)))


def test_scoped_buffers_allocated_differently_on_two_devices_are_named():
    """The copy cast the bytes into the other dtype, silently (shared memory reinterprets them)."""
    with pytest.raises(K.KernelUsageError, match=r"whose buffer 'scoped\[1\]' is int32\[4\] but the sender's is "
                                                 r"float32\[4\]: the devices allocated it differently"):
        K.interpret(cases.scoped_dtypes_differ, [[torch.ones(4)]] * 2, K.Buffer((4,)), scratch=[DMA, DMA])


def test_explore_and_grid_are_checked():
    for kw, words in ((dict(explore=0), "explore must be a positive int"), (dict(grid=(-2,)), "grid must be a tuple "
                                                                                       "of positive ints")):
        with pytest.raises(K.KernelUsageError, match=words):
            run_permute_case(cases.ring_permute, **kw)


def _send_wait_then_signal(x, o, out, ss, rs, ready):
    """Device 0 takes wait_send (its source was read) for delivery and signals; device 1 reads `o` before its
    wait_recv.  On hardware the copy may still be landing."""
    if K.device_id() == 0:
        c = K.remote_copy(x, o, ss, rs, 1)
        c.start()
        c.wait_send()
        K.semaphore_signal(ready, 1, device_id=1)
        out[...] = x[...]
    else:
        K.semaphore_wait(ready, 1)
        out[...] = o[...]  # read before wait_recv
        K.remote_copy(x, o, ss, rs, 1).wait_recv()


@pytest.mark.parametrize("seed", range(6))
def test_wait_send_does_not_order_the_landing(seed):
    """A copy's read and its landing shared one epoch of the copy's clock, so a sender's wait_send ordered
    everything after it (and a signal, the receiver's read) after the landing too: the missing wait_recv
    was reported on about a third of the seeds only."""
    xs = [[torch.arange(4.0)]] * 2
    with pytest.raises(K.DataRaceError):
        K.interpret(_send_wait_then_signal, xs, [K.Buffer((4,)), K.Buffer((4,))],
                    scratch=[K.SemaphoreType.DMA, K.SemaphoreType.DMA, K.SemaphoreType.REGULAR], seed=seed)


def _half_wait(x, o, ss, rs):
    """Waits for 16 of the 32 bytes a copy delivers, then reads the other 16."""
    me, n = K.device_id(), K.num_devices()
    c = K.remote_copy(x, o, ss, rs, (me + 1) % n)
    c.start()
    K.remote_copy(x.at[0:4], o.at[0:4], ss, rs, me).wait_recv()  # 16 bytes
    v = o[4:8]  # not waited for
    K.remote_copy(x.at[4:8], o.at[4:8], ss, rs, me).wait_recv()
    c.wait_send()
    o[0:4] = v


def test_a_wait_for_part_of_a_copy_orders_nothing_of_it():
    """A DMA semaphore counts bytes, landing in no promised order; a wait for half joined the copy's clock, so
    the read of the other half went unreported.  A wait for all of it in two halves stays race-free."""
    xs = [[torch.arange(8.0) + 10 * d] for d in range(2)]
    with pytest.raises(K.DataRaceError):
        K.interpret(_half_wait, xs, K.Buffer((8,)), scratch=[K.SemaphoreType.DMA] * 2, seed=0)

    def both_halves(x, o, ss, rs):
        me, n = K.device_id(), K.num_devices()
        c = K.remote_copy(x, o, ss, rs, (me + 1) % n)
        c.start()
        K.remote_copy(x.at[0:4], o.at[0:4], ss, rs, me).wait_recv()
        K.remote_copy(x.at[4:8], o.at[4:8], ss, rs, me).wait_recv()
        v = o[4:8] * 1
        c.wait_send()
        o[0:4] = v

    out = K.interpret(both_halves, xs, K.Buffer((8,)), scratch=[K.SemaphoreType.DMA] * 2, explore=4)
    assert torch.equal(out[0][0:4], xs[1][0][4:8])
