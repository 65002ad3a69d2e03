"""Ops vmap cannot batch run device by device on the simulated mesh (shmap/per_device.py), as on processes.

Each case is compared with plain PyTorch on each device's block: values and gradients.
"""
import pytest
import torch
import torch.nn.functional as F

import shmap
from shmap import P

MESH = shmap.make_mesh((4,), ("i",))


def per_block(f, *xs):
    """f on each device's block of `xs` (split on dim 0), concatenated: what the processes compute."""
    return torch.cat([f(*bs) for bs in zip(*(x.chunk(4) for x in xs))])


def test_an_op_without_a_batching_rule_runs_per_device_with_gradients():
    """nn.GRU: 'Batching rule not implemented for aten::gru.input'."""
    torch.manual_seed(0)
    gru = torch.nn.GRU(3, 5, batch_first=True).double()
    x = torch.randn(8, 6, 3, dtype=torch.float64, requires_grad=True)
    f = shmap.shard_map(lambda v: gru(v)[0], mesh=MESH, in_specs=P("i"), out_specs=P("i"))
    out = f(x)
    want = per_block(lambda v: gru(v)[0], x)
    torch.testing.assert_close(out, want)
    ct = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *gru.parameters()], ct)
    ref = torch.autograd.grad(want, [x, *gru.parameters()], ct)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_cross_entropy_with_weights_and_label_smoothing():
    """Its decomposition did in-place arithmetic vmap refuses."""
    torch.manual_seed(1)
    logits = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 5, (8,))
    w = torch.rand(5, dtype=torch.float64)

    def loss(z, t):
        return F.cross_entropy(z, t, weight=w, label_smoothing=0.1).reshape(1)

    out = shmap.shard_map(loss, mesh=MESH, in_specs=(P("i"), P("i")), out_specs=P("i"))(logits, target)
    want = per_block(loss, logits, target)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), logits)[0], torch.autograd.grad(want.sum(), logits)[0])


def test_boolean_mask_assignment_on_a_body_value():
    x = torch.randn(8, 3, dtype=torch.float64)

    def body(v):
        y = v * 1
        y[y > 0] = 0
        return y

    out = shmap.shard_map(body, mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x)
    assert torch.equal(out, x.clamp(max=0))


def test_a_result_whose_shape_differs_by_device_is_refused_naming_the_shapes():
    x = torch.tensor([[1.0, 1.0], [1.0, 2.0], [3.0, 3.0], [4.0, 5.0]] * 2)
    with pytest.raises(shmap.VmaError, match=r": its result has a different shape on different devices "
                                             r"\(device \(i=0\): \(2,\); device \(i=1\): \(3,\); mesh") as info:
        shmap.shard_map(lambda v: torch.unique(v)[None], mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x)
    assert str(info.value).startswith("torch.unique: ")  # (not the closure torch builds it with)


def test_which_calls_make_a_result_shaped_by_the_values():
    """`value_shaped`: the calls whose result's shape the distributed mesh compares across ranks (each rank
    runs them alone; here the per-device runs compare the shapes themselves)."""
    from shmap.per_device import value_shaped

    x, mask, idx = torch.ones(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 2])
    shaped = [(torch.nonzero, [x]), (torch.unique, [x]), (torch.Tensor.__getitem__, [x, mask]),
              (torch.Tensor.__getitem__, [x, mask.to(torch.uint8)]), (torch.where, [mask]),
              (torch.repeat_interleave, [idx]), (torch.Tensor.repeat_interleave, [x, idx]),
              (torch.masked_select, [x, mask]), (torch.bincount, [idx])]
    fixed = [(torch.exp, [x]), (torch.Tensor.__getitem__, [x, idx]), (torch.Tensor.__getitem__, [x, 1]),
             (torch.where, [mask, x, x]), (torch.Tensor.repeat_interleave, [x, 2]), (lambda v: v, [x])]
    assert [f for f, leaves in shaped if not value_shaped(f, leaves)] == []
    assert [f for f, leaves in fixed if value_shaped(f, leaves)] == []


def test_writing_shared_state_from_varying_values_is_refused_and_undone():
    """Training-mode BatchNorm updates its running statistics, the same tensors on every device."""
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    with pytest.raises(shmap.VmaError, match=r"batch_norm: updates a tensor of shape \(3,\) that is the same on every "
                                             r"device .* Fix: keep such state per device"):
        shmap.shard_map(lambda v: bn(v), mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x)
    assert torch.equal(bn.running_mean, torch.zeros(3)) and torch.equal(bn.running_var, torch.ones(3))
    bn.eval()  # (reading them is fine)
    out = shmap.shard_map(lambda v: bn(v), mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x)
    torch.testing.assert_close(out, bn(x))


def test_an_error_is_the_devices_own_with_per_device_shapes():
    """A reshape that does not fit a block: the per-device shapes, as a process reports them (it showed
    the all-device tensor's)."""
    x = torch.randn(8, 6)
    with pytest.raises(RuntimeError, match=r"shape '\[5, 3\]' is invalid for input of size 12") as info:
        shmap.shard_map(lambda v: (v * 1).reshape(5, 3), mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x)
    assert "on device (i=0) of mesh (i=4), run device by device" in "".join(getattr(info.value, "__notes__", []))


def test_embedding_max_norm_and_instance_norm_statistics_are_refused_before_writing():
    """`max_norm` renormalises the closed-over weight's rows in place from each device's indices; it gave
    torch's view+inplace error after writing the weight.  Refused before the op (special.py), weight intact;
    with a varying weight (each device's own) it runs."""
    emb = torch.nn.Embedding(10, 4, max_norm=1.0)
    w0 = emb.weight.detach().clone()
    idx = torch.arange(8).reshape(4, 2)
    with pytest.raises(shmap.VmaError, match=r"embedding: updates a tensor of shape \(10, 4\) that is the same on "
                                             r"every device .*max_norm.* Fix: renormalise the weight before"):
        shmap.shard_map(lambda v: emb(v), mesh=MESH, in_specs=P("i"), out_specs=P("i"))(idx)
    assert torch.equal(emb.weight.detach(), w0)
    inorm = torch.nn.InstanceNorm1d(3, track_running_stats=True)
    with pytest.raises(shmap.VmaError, match=r"instance_norm: updates a tensor of shape \(3,\)"):
        shmap.shard_map(lambda v: inorm(v), mesh=MESH, in_specs=P("i"), out_specs=P("i"))(torch.randn(8, 3, 5))
    assert torch.equal(inorm.running_mean, torch.zeros(3))
    # A weight of each device's own (varying, made in the body): renormalised per device, as on a process.
    w = torch.randn(4 * 10, 4) * 3
    f = shmap.shard_map(lambda v, ww: torch.nn.functional.embedding(v, ww * 1, max_norm=1.0),
                        mesh=MESH, in_specs=(P("i"), P("i")), out_specs=P("i"))
    ref = torch.cat([torch.nn.functional.embedding(idx[d:d + 1], w[10 * d:10 * d + 10].clone(), max_norm=1.0)
                     for d in range(4)])
    torch.testing.assert_close(f(idx, w), ref)


def test_running_statistics_of_each_device_own_as_the_message_says():
    """The fix the message gives: statistics passed in with a sharded spec are read-only (an argument), a
    copy made in the body is each device's own and comes back updated."""
    x = torch.randn(16, 3)
    rm, rv = torch.zeros(4 * 3), torch.ones(4 * 3)

    def in_place_on_argument(v, m, s):
        return torch.nn.functional.batch_norm(v, m, s, training=True)

    with pytest.raises(shmap.InPlaceInputError):
        shmap.shard_map(in_place_on_argument, mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x, rm, rv)
    assert torch.equal(rm, torch.zeros(12))

    def own_copy(v, m, s):
        m, s = m.clone(), s.clone()
        return torch.nn.functional.batch_norm(v, m, s, training=True), m, s

    out, m, s = shmap.shard_map(own_copy, mesh=MESH, in_specs=P("i"), out_specs=P("i"))(x, rm, rv)
    for d in range(4):
        bm, bs = torch.zeros(3), torch.ones(3)
        torch.testing.assert_close(out[4 * d:4 * d + 4],
                                   torch.nn.functional.batch_norm(x[4 * d:4 * d + 4], bm, bs, training=True))
        torch.testing.assert_close((m[3 * d:3 * d + 3], s[3 * d:3 * d + 3]), (bm, bs))
