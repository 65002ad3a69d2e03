"""Refs, indexing, the race detector's boxes, and API misuse messages."""
import pytest
import torch

from shmap import kernels as K
from shmap.kernels import races
from shmap.kernels.refs import BufferInfo, Ref, format_box

pytestmark = pytest.mark.usefixtures("float32_default")

DMA, REGULAR = K.SemaphoreType.DMA, K.SemaphoreType.REGULAR


def ref(shape):
    return Ref(BufferInfo(("out", 0), "buf", tuple(shape), torch.float32, "output"))


def test_views_compose_in_base_coordinates():
    r = ref((4, 8, 6))
    sub = r.at[1].at[K.ds(2, 4), ::2]
    assert sub.shape == (4, 3)
    assert format_box(sub.box()) == "[1, 2:6, 0:6:2]"
    assert sub.describe() == "'buf'[1, 2:6, 0:6:2]"
    assert r.at[..., 1].shape == (4, 8)
    assert r.at[-1].box()[0] == range(3, 4)
    base = torch.arange(4 * 8 * 6).view(4, 8, 6)
    assert torch.equal(base[sub.torch_index()], base[1, 2:6, ::2])
    assert sub.nbytes == 4 * 3 * 4


@pytest.mark.parametrize("bad, match", [
    (lambda r: r.at[4], "index 4 is out of bounds"),
    (lambda r: r.at[K.ds(3, 2)], r"ds\(3, 2\) is out of bounds"),
    (lambda r: r.at[0, 0, 0], "too many indices"),
    (lambda r: r.at[[0, 1]], "no advanced indexing"),
    (lambda r: r.at[::-1], "steps must be positive"),
    (lambda r: r.at[None], "new axis"),
    (lambda r: r.at[2:6], r"slice 2:6 is out of bounds for a dimension of size 4"),  # (Python clamped it)
    (lambda r: r.at[:, -7:], r"slice -7:None is out of bounds for a dimension of size 5"),
])
def test_bad_indices(bad, match):
    with pytest.raises(K.KernelUsageError, match=match):
        bad(ref((4, 5)))


def test_box_overlap_and_cover():
    a = (range(0, 4), range(0, 8))
    b = (range(2, 6), range(4, 12))
    assert races.box_overlap(a, b) == (range(2, 4), range(4, 8))
    assert races.box_overlap(a, (range(4, 6), range(0, 8))) is None
    assert races.box_overlap((range(0, 8, 2),), (range(1, 8, 2),)) is None  # interleaved
    assert races.box_covers(a, (range(1, 3), range(0, 8)))
    assert not races.box_covers(a, b)


def test_history_orders_by_vector_clock():
    h = races.History()
    box = (range(0, 4),)
    assert h.check(races.Access(0, 1, True, box, "w0"), {0: 1}) is None
    # device 1 has not synchronised with device 0: race
    hit = h.check(races.Access(1, 1, False, box, "r1"), {1: 1})
    assert hit is not None and hit[0].who == "w0"
    # after joining device 0's clock it is ordered
    h2 = races.History()
    h2.check(races.Access(0, 1, True, box, "w0"), {0: 1})
    assert h2.check(races.Access(1, 1, False, box, "r1"), {0: 1, 1: 1}) is None


def test_api_outside_a_kernel():
    with pytest.raises(K.KernelUsageError, match="outside a kernel"):
        K.device_id()
    with pytest.raises(K.KernelUsageError, match="outside a kernel"):
        ref((2,))[...]


def run_misuse(kernel, scratch=(DMA, DMA)):
    xs = [[torch.zeros(4)], [torch.zeros(4)]]
    return K.interpret(kernel, xs, K.Buffer((4,)), scratch=list(scratch))


@pytest.mark.parametrize("kernel, match", [
    (lambda x, o, s, r: K.remote_copy(x, o.at[K.ds(0, 2)], s, r, 1),
     r"src 'x'\[0:4\] is \(4,\) torch.float32 but dst 'o'\[0:2\] is \(2,\)"),
    (lambda x, o, s, r: K.remote_copy(x, o, s, r, 2), "device_id=2 is out of range for 2"),
    (lambda x, o, s, r: K.remote_copy(o, x, s, r, 1), "inputs are read-only"),
    (lambda x, o, s, r: K.semaphore_wait(s), "is a DMA semaphore; it must be REGULAR"),
    (lambda x, o, s, r: x.__setitem__(..., 1.0), "kernel inputs are read-only"),
    (lambda x, o, s, r: o.__setitem__(..., torch.zeros(3)), r"value of shape \(3,\) does not fit"),
    (lambda x, o, s, r: K.program_id(0), r"grid is \(\) \(0 axes\)"),
])
def test_misuse_is_reported_with_the_device(kernel, match):
    with pytest.raises(K.DeviceError, match=match):
        run_misuse(kernel)


def test_semaphore_arrays_need_an_index():
    def kernel(x, o, sems):
        K.semaphore_signal(sems)

    with pytest.raises(K.DeviceError, match=r"array of semaphores with shape \(3,\); pick one"):
        run_misuse(kernel, scratch=[REGULAR((3,))])


def test_kernel_signature_is_checked():
    def kernel(x, o):
        pass

    with pytest.raises(K.KernelUsageError, match=r"called with 4 refs \(1 inputs, 1 outputs, "
                                                  r"2 scratch\)"):
        run_misuse(kernel)


def test_inputs_must_agree_across_devices():
    with pytest.raises(K.KernelUsageError, match="every device's block must have the same shape"):
        K.interpret(lambda x, o: None, [[torch.zeros(2)], [torch.zeros(3)]], K.Buffer((2,)))


def test_local_buffers_are_never_remote_destinations():
    def kernel(x, o, send, recv):
        K.remote_copy(x, o, send, recv, 0)

    with pytest.raises(K.DeviceError, match=r"'o'\[0:4\] is a local buffer"):
        K.interpret(kernel, [[torch.zeros(4)], [torch.zeros(4)]], K.Buffer((4,), local=True),
                    scratch=[DMA, DMA])


def test_local_outputs_on_shared_memory(shm_group):
    """A worker pool hands local outputs back like any other (ShmTransport's use of them,
    writing straight into the caller's tensor, is covered by test_kernel_shm)."""
    xs = [[torch.full((4,), float(d))] for d in range(2)]
    outs = shm_group.run(_double, xs, K.Buffer((4,), local=True))
    assert [o.tolist() for o in outs] == [[0.0] * 4, [2.0] * 4]


def _double(x, o):
    with K.borrow(x) as xs, K.borrow(o, write=True) as out:
        torch.mul(xs, 2, out=out)
