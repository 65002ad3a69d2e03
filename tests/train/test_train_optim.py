"""shmap/train/optim.py: the standard Adam (== torch.optim.Adam), the schedule, and a global
gradient norm that is right under sharding."""
import math

import optree
import pytest
import torch

import shmap
from shmap import P
from shmap.train import model, optim

from .tiny import tiny


def test_adam_equals_torch_optim_adam():
    cfg = tiny("none", lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6)
    torch.manual_seed(0)
    p0 = torch.randn(5, 3, dtype=torch.float64)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.Adam([ref], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    p, mu, nu = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for count in range(1, 8):
        g = torch.randn(5, 3, dtype=torch.float64)
        ref.grad = g.clone()
        opt.step()
        p, mu, nu = optim.adam_update(cfg, p, g, mu, nu, count, cfg.lr)
        assert torch.equal(p, ref.detach()), (p - ref).abs().max()  # the same ops: bitwise
    state = opt.state[ref]
    assert torch.equal(mu, state["exp_avg"])
    assert torch.equal(nu, state["exp_avg_sq"])


@pytest.mark.parametrize("foreach,dtype,tensor_scalars", [(False, torch.float64, False), (True, torch.float64, False),
                                                          (True, torch.float32, True), (True, torch.float64, True)])
def test_adam_over_lists_equals_torch_optim_adam(foreach, dtype, tensor_scalars):
    """The form `optim.update` uses: every parameter at once, one `torch._foreach_*` call per op.
    With `tensor_scalars`, the compiled recipe's form (`shmap-train --compile`): the step's scalars
    as 0-d float64 tensors (graph inputs, not constants) give the bits of the Python floats."""
    cfg = tiny("none", lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6)
    torch.manual_seed(0)
    p0 = [torch.randn(5, 3, dtype=dtype), torch.randn(7, dtype=dtype)]
    ref = [p.clone().requires_grad_() for p in p0]
    opt = torch.optim.Adam(ref, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=foreach)
    p, mu, nu = [x.clone() for x in p0], [torch.zeros_like(x) for x in p0], [torch.zeros_like(x) for x in p0]
    for count in range(1, 6):
        gs = [torch.randn_like(x) for x in p0]
        for r, g in zip(ref, gs):
            r.grad = g.clone()
        opt.step()
        if tensor_scalars:
            scalars = [torch.tensor(s, dtype=torch.float64) for s in optim.adam_scalars(cfg, count, cfg.lr)]
            p, mu, nu = optim.adam_apply(cfg, p, gs, mu, nu, *scalars)
        else:
            p, mu, nu = optim.adam_update(cfg, p, gs, mu, nu, count, cfg.lr)
        for a, r in zip(p, ref):
            assert torch.equal(a, r.detach()), (a - r).abs().max()


def test_learning_rate_warms_up_then_decays_by_cosine():
    cfg = tiny("none", steps=110, warmup=10, lr=1.0)
    lrs = [optim.learning_rate(cfg, s) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay after warmup
    assert lrs[60] == pytest.approx(cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lrs[-1] > cfg.min_lr_ratio * 0.999


@pytest.mark.parametrize("mesh", ["fsdp=4", "fsdp=2,tensor=2", "data=2,tensor=2"])
def test_global_norm_and_clipping_are_right_under_sharding(mesh):
    cfg = tiny(mesh, clip=0.5)
    layout = model.Layout(cfg.mesh)
    specs = model.param_specs(cfg, layout)
    torch.manual_seed(1)
    grads = optree.tree_map(lambda p: torch.randn_like(p), model.init_params(cfg))
    expect = torch.sqrt(sum(g.pow(2).sum() for g in optree.tree_leaves(grads)))
    norm = shmap.shard_map(lambda g: optim.global_norm(g, specs), mesh=layout.make_mesh(), in_specs=(specs,),
                           out_specs=P())
    with shmap.comm_log() as log:
        got = norm(grads)
    torch.testing.assert_close(got, expect)
    assert log.count("psum") <= 3  # one per group of sharded axes, not one per tensor

    params = model.init_params(cfg)
    opt = optim.adam_init(params)
    upd = shmap.shard_map(lambda p, g, o: optim.update(cfg, specs, p, g, o, *optim.adam_scalars(cfg, 1, 1e-2)), mesh=layout.make_mesh(),
                          in_specs=(specs, specs, {"mu": specs, "nu": specs}),
                          out_specs=(specs, {"mu": specs, "nu": specs}, P()))
    new, new_opt, n = upd(params, grads, opt)
    torch.testing.assert_close(n, expect)
    clipped = optree.tree_map(lambda g: g * (0.5 / (expect + 1e-6)), grads)
    ref_mu = optree.tree_map(lambda g: (1 - cfg.beta1) * g, clipped)
    for a, b in zip(optree.tree_leaves(new_opt["mu"]), optree.tree_leaves(ref_mu)):
        torch.testing.assert_close(a, b)
