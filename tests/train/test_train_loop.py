"""shmap/train/loop.py: every mesh trains to the losses of plain PyTorch; the run's outputs; a
non-finite loss and Ctrl-C stop cleanly and lose nothing."""
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shmap.train import checkpoint, loop
from shmap.train.config import ConfigError

from .tiny import MESHES, TINY_FLAGS, tiny

ROOT = Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda *a, **k: None)


def _losses(result):
    return [r["train_loss"] for r in result["history"] if "train_loss" in r]


@pytest.fixture(scope="module")
def reference():
    return _losses(loop.train(tiny("none"), **QUIET))


@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_trains_to_the_losses_of_plain_pytorch(mesh, reference):
    got = _losses(loop.train(tiny(mesh), **QUIET))
    assert len(got) == len(reference) == 4
    assert got == pytest.approx(reference, rel=1e-7)


def test_the_run_writes_metrics_a_plot_and_a_sample(tmp_path):
    out = tmp_path / "out"
    res = loop.train(tiny("fsdp=2,tensor=2", steps=4, eval_every=2, out=str(out), sample_len=12, top_k=5),
                     **QUIET)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "train_loss" in r]
    val = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    assert set(train[0]) == {"step", "train_loss", "lr", "grad_norm", "tokens_per_s"}
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in train)
    assert [r["step"] for r in val] == [2, 4]  # after 2 and 4 updates and val[-1]["val_loss"] == res["final_val_loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sample = (out / "sample.txt").read_text()
    assert sample.startswith("ROMEO:\n") and len(sample.encode()) >= len("ROMEO:\n") + 1


@pytest.mark.parametrize("mesh", ["none", "fsdp=2,tensor=2"])
def test_a_step_reads_its_state_and_never_writes_it(mesh):
    """The step differentiates the state's own tensors (it marks them requires_grad, as a Module's
    parameters are): their values stay, and a step taken again from the same state repeats itself."""
    import optree

    run = loop.Run(tiny(mesh))
    params, opt = run.fresh_state()
    before = [x.detach().clone() for x in optree.tree_leaves((params, opt))]
    p1, o1, m1 = run.step(params, opt, 0)
    p2, o2, m2 = run.step(params, opt, 0)
    after = optree.tree_leaves((params, opt))
    assert all(torch.equal(a.detach(), b) for a, b in zip(after, before))
    assert all(a is not b for a, b in zip(optree.tree_leaves(p1), optree.tree_leaves(params)))
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((p1, o1)), optree.tree_leaves((p2, o2))))
    assert not any(torch.equal(a, b) for a, b in zip(optree.tree_leaves(p1), optree.tree_leaves(params)))
    assert float(m1["train_loss"]) == float(m2["train_loss"])


def _poison(monkeypatch, key, at):
    """Make step `at` report a NaN `key` metric (a loss or gradient norm gone non-finite)."""
    step = loop.Run.step

    def poisoned(self, params, opt, k):
        params, opt, m = step(self, params, opt, k)
        if k == at:
            m[key] = m[key] * float("nan")
        return params, opt, m

    monkeypatch.setattr(loop.Run, "step", poisoned)


def test_a_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    _poison(monkeypatch, "train_loss", 4)
    ck = tmp_path / "ck"
    with pytest.raises(loop.NonFiniteLossError, match=r"step 4: the training loss is nan.*last good checkpoint is .*step_00000004"):
        loop.train(tiny("data=2", steps=8, checkpoint_dir=str(ck), checkpoint_every=2, out=str(tmp_path / "o")),
                   **QUIET)
    assert checkpoint.latest(ck).name == "step_00000004"  # saved after step 3's loss was read as finite...
    assert checkpoint.read_meta(checkpoint.latest(ck))["step"] == 4
    assert (tmp_path / "o" / "metrics.jsonl").exists()     # ...and the metrics written so far are kept


def test_ctrl_c_saves_a_checkpoint_to_resume_from(tmp_path, monkeypatch):
    step = loop.Run.step

    def interrupted(self, params, opt, k):
        if k == 3:
            raise KeyboardInterrupt
        return step(self, params, opt, k)

    monkeypatch.setattr(loop.Run, "step", interrupted)
    ck = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        loop.train(tiny("fsdp=2", steps=6, checkpoint_dir=str(ck)), **QUIET)
    assert checkpoint.read_meta(checkpoint.latest(ck))["step"] == 3
    monkeypatch.setattr(loop.Run, "step", step)
    resumed = loop.train(tiny("fsdp=2", steps=6, checkpoint_dir=str(ck), resume=True), **QUIET)
    full = loop.train(tiny("fsdp=2", steps=6), **QUIET)
    assert _losses(resumed) == _losses(full)[3:]


def _interrupt_at(monkeypatch, cls, name, call, exc=KeyboardInterrupt):
    """Make the `call`-th call of `cls.name` raise `exc` (a Ctrl-C landing there)."""
    real, calls = getattr(cls, name), [0]

    def hit(*a, **k):
        calls[0] += 1
        if calls[0] == call:
            raise exc()
        return real(*a, **k)

    monkeypatch.setattr(cls, name, hit)
    return real


@pytest.mark.parametrize("where", ["evaluate", "save"])
def test_ctrl_c_after_a_step_saves_that_step_under_its_own_number(tmp_path, monkeypatch, where):
    """Landing in an evaluation or a periodic save, after step 3 (the 4th) has updated the state: the
    checkpoint says 4 steps, resuming continues exactly, and the good checkpoint of step 2 is kept."""
    ck = tmp_path / "ck"
    kw = dict(steps=6, checkpoint_dir=str(ck), checkpoint_every=2, eval_every=2)
    if where == "evaluate":
        real = _interrupt_at(monkeypatch, loop.Run, "evaluate", 2)  # after 4 steps
    else:
        real = _interrupt_at(monkeypatch, checkpoint, "save", 2)    # saving the state after 4 steps
    with pytest.raises(KeyboardInterrupt):
        loop.train(tiny("fsdp=2", **kw), **QUIET)
    monkeypatch.setattr(loop.Run if where == "evaluate" else checkpoint, where, real)
    assert [checkpoint.read_meta(p)["step"] for p in sorted(ck.glob("step_0*"))] == [2, 4]
    resumed = loop.train(tiny("fsdp=2", **kw, resume=True), **QUIET)
    full = loop.train(tiny("fsdp=2", **{**kw, "checkpoint_dir": str(tmp_path / "full")}), **QUIET)
    assert _losses(resumed) == _losses(full)[4:]


def test_ctrl_c_while_plotting_says_what_is_kept(tmp_path, monkeypatch):
    """Training is done and saved when the plot is drawn: the message says where (it was a bare traceback)."""
    ck, out, said = tmp_path / "ck", tmp_path / "o", []
    _interrupt_at(monkeypatch, loop, "plot", 1)
    with pytest.raises(KeyboardInterrupt):
        loop.train(tiny("none", steps=2, checkpoint_dir=str(ck), out=str(out)), log=said.append)
    assert re.search(r"interrupted after training: the final state is saved in .*step_00000002; .*metrics.jsonl "
                     r"holds every step's metrics \(final validation loss \d\.\d{4}", said[-1]), said[-1]
    assert checkpoint.read_meta(checkpoint.latest(ck))["step"] == 2


def test_sigterm_is_met_as_ctrl_c(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    _interrupt_at(monkeypatch, loop.Run, "step", 4, loop.Terminated)
    code = loop.main([*TINY_FLAGS, "--mesh", "data=2", "--steps", "6", "--checkpoint-dir", str(ck),
                      "--out", str(tmp_path / "out")])
    assert code == 143 and checkpoint.read_meta(checkpoint.latest(ck))["step"] == 3


def test_a_non_finite_gradient_norm_is_never_saved(tmp_path, monkeypatch):
    _poison(monkeypatch, "grad_norm", 2)
    ck = tmp_path / "ck"
    with pytest.raises(loop.NonFiniteLossError, match=r"step 2: the gradient norm is nan.*step_00000002"):
        loop.train(tiny("data=2", steps=8, checkpoint_dir=str(ck), checkpoint_every=2), **QUIET)
    assert checkpoint.latest(ck).name == "step_00000002"


def test_a_new_run_refuses_another_runs_checkpoints_and_bad_output_paths(tmp_path):
    ck = tmp_path / "ck"
    loop.train(tiny("none", steps=2, checkpoint_dir=str(ck)), **QUIET)
    with pytest.raises(ConfigError, match=r"holds an earlier run's checkpoints \(the latest: step_00000002\)\. "
                                          r"Fix: --resume"):
        loop.train(tiny("none", steps=2, seed=7, checkpoint_dir=str(ck)), **QUIET)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for flag, kw in (("--out", dict(out=str(a_file))), ("--checkpoint-dir", dict(checkpoint_dir=str(a_file)))):
        with pytest.raises(ConfigError, match=f"{flag} {a_file}: is a file, not a directory"):
            loop.train(tiny("none", steps=2, **kw), **QUIET)


def test_output_dirs_must_be_writable_and_a_new_run_keeps_an_earlier_runs_metrics(tmp_path):
    """An existing read-only --checkpoint-dir trained, then crashed at the first save; a new run into an --out
    holding metrics replaced them silently."""
    with pytest.raises(ConfigError, match=r"--checkpoint-dir /sys/kernel: cannot be made a writable directory"):
        loop.train(tiny("none", steps=2, checkpoint_dir="/sys/kernel"), **QUIET)
    out = tmp_path / "o"
    loop.train(tiny("none", steps=2, out=str(out)), **QUIET)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"--out .* holds an earlier run.s metrics.jsonl.*Fix: another --out"
                                          r".*--resume with the --checkpoint-dir"):
        loop.train(tiny("none", steps=3, out=str(out)), **QUIET)
    assert (out / "metrics.jsonl").read_text() == before


def test_a_resumed_runs_metrics_equal_the_uninterrupted_runs(tmp_path):
    """The validation line of the step a run resumes from was dropped (it evaluates the state the resumed
    run starts from); a partial last line (a crash mid-write) stopped the resume with a JSONDecodeError."""
    ck, out, ref = tmp_path / "ck", tmp_path / "o", tmp_path / "ref"
    loop.train(tiny("none", steps=3, checkpoint_dir=str(ck), out=str(out), eval_every=3), **QUIET)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train_lo')  # a crash mid-write
    said = []
    loop.train(tiny("none", steps=6, checkpoint_dir=str(ck), out=str(out), eval_every=3, resume=True,
                    dtype="float32", lr=2e-3), log=said.append)
    loop.train(tiny("none", steps=6, out=str(ref), eval_every=3, dtype="float32", lr=2e-3), **QUIET)

    def lines(d):
        return [{k: v for k, v in json.loads(t).items() if k != "tokens_per_s"}
                for t in (d / "metrics.jsonl").read_text().splitlines()]

    got, want = lines(out), lines(ref)
    assert [r["step"] for r in got if "val_loss" in r] == [3, 6] == [r["step"] for r in want if "val_loss" in r]
    assert [r["step"] for r in got if "train_loss" in r] == list(range(6))
    # (resuming a float64 state in float32 is allowed, and said)
    assert any("note: this run changes --dtype float32 (the checkpoint's run: float64), --lr 0.002 (the "
               "checkpoint's run: 0.003), --steps 6 (the checkpoint's run: 3)" in line for line in said), said


def test_resuming_a_finished_run_writes_its_final_validation_once(tmp_path):
    """It evaluates the final state again: the earlier run's final line was kept too (a copy per resume)."""
    ck, out = tmp_path / "ck", tmp_path / "o"
    loop.train(tiny("none", steps=2, checkpoint_dir=str(ck), out=str(out)), **QUIET)
    for _ in range(2):
        loop.train(tiny("none", steps=2, checkpoint_dir=str(ck), out=str(out), resume=True), **QUIET)
    rows = [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2]
    assert [r["step"] for r in rows if "train_loss" in r] == [0, 1]


def test_a_resumed_runs_metrics_continue_without_repeats(tmp_path, monkeypatch):
    ck, out = tmp_path / "ck", tmp_path / "o"
    real = _interrupt_at(monkeypatch, loop.Run, "step", 4)
    with pytest.raises(KeyboardInterrupt):
        loop.train(tiny("none", steps=6, checkpoint_dir=str(ck), out=str(out), eval_every=2), **QUIET)
    monkeypatch.setattr(loop.Run, "step", real)
    loop.train(tiny("none", steps=6, checkpoint_dir=str(ck), out=str(out), eval_every=2, resume=True), **QUIET)
    lines = [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train_loss" in r] == list(range(6))
    assert [r["step"] for r in lines if "val_loss" in r] == [2, 4, 6]


def test_the_command_runs_and_reports_bad_flags(tmp_path):
    cmd = [sys.executable, "-m", "shmap.train", *TINY_FLAGS, "--mesh", "data=2", "--steps", "2",
           "--out", str(tmp_path), "--sample-len", "5"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "final validation loss" in p.stdout and (tmp_path / "loss.png").exists()
    p = subprocess.run([sys.executable, "-m", "shmap.train", "--data", str(tmp_path / "missing.txt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--data" in p.stderr and "no such file" in p.stderr


def test_activation_checkpointing_trains_to_the_same_losses_and_regathers_in_the_backward():
    import optree
    import shmap

    plain = _losses(loop.train(tiny("fsdp=2,tensor=2"), **QUIET))
    remat = _losses(loop.train(tiny("fsdp=2,tensor=2", remat=True), **QUIET))
    assert remat == pytest.approx(plain, rel=1e-12)
    counts = {}
    for flag in (False, True):
        run = loop.Run(tiny("fsdp=2", remat=flag))
        params, _ = run.fresh_state()
        leaves, treedef = optree.tree_flatten(params)
        leaves = [p.requires_grad_() for p in leaves]
        loss = run.loss(optree.tree_unflatten(treedef, leaves), run.batch(0))
        with shmap.comm_log() as log:
            torch.autograd.grad(loss, leaves)
        counts[flag] = log.summary()
    assert counts[False].get("all_gather", 0) == 0
    assert counts[True]["all_gather"] == 6 * 2  # each layer's four matmul weights and two norm scales, again
    assert counts[True]["psum_scatter"] == counts[False]["psum_scatter"]


def test_a_compiled_loss_trains_to_the_eager_losses():
    eager = _losses(loop.train(tiny("fsdp=2,tensor=2", steps=3), **QUIET))
    compiled = _losses(loop.train(tiny("fsdp=2,tensor=2", steps=3, compile=True), **QUIET))
    assert compiled == pytest.approx(eager, rel=1e-10)


@pytest.mark.parametrize("mesh", ["none", "data=2,tensor=2"])
def test_the_compiled_step_compiles_once_and_equals_eager(mesh, monkeypatch):
    """`--compile` compiles the loss and the update (clipping and Adam); the learning rate changes
    every step, and a new step is no recompile (the update's scalars are graph inputs).  With AOT
    autograd and eager kernels the parameters equal the eager step's bit for bit."""
    import functools

    import optree
    import torch._dynamo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    runs = [loop.Run(tiny(mesh, steps=6, warmup=2, compile=c)) for c in (False, True)]
    states = [r.fresh_state() for r in runs]
    for k in range(4):
        with torch._dynamo.config.patch(error_on_recompile=k > 0):
            states = [r.step(*st, k)[:2] for r, st in zip(runs, states)]
        (p_eager, _), (p_comp, _) = states
        for a, b in zip(optree.tree_leaves(p_eager), optree.tree_leaves(p_comp)):
            assert torch.equal(a, b), (k, (a - b).abs().max())


_MALLINFO = """
import ctypes, json, sys
import torch
from shmap.train.loop import keep_freed_memory

class Info(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t fields
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
t = torch.ones(4 << 20)  # 16 MiB, as a step's activation
during = libc.mallinfo2()
del t
after = libc.mallinfo2()
print(json.dumps({"kept": kept, "mmapped": during.hblkhd, "heap_during": during.arena, "heap_after": after.arena}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_keep_freed_memory_keeps_a_steps_blocks_in_the_heap():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", _MALLINFO, mode], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    default, kept = run("default"), run("keep")
    assert default["mmapped"] >= 16 << 20  # glibc's default: a fresh mapping, returned to the kernel at free
    assert kept["kept"] is True
    assert kept["mmapped"] < 16 << 20  # from the heap ...
    assert kept["heap_after"] >= kept["heap_during"] >= 16 << 20  # ... which keeps it for the next step


def test_remat_keeps_its_memory_saving_when_compiled(monkeypatch):
    """`--remat --compile`: the compiled backward recomputes each layer (shmap/remat.py), so the step keeps
    for its backward about what the eager remat step keeps; before, the compiled program kept every
    activation (what `--compile` alone keeps), silently.  Losses equal the eager step's."""
    import functools

    import optree

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    def saved(remat, compile_):
        run = loop.Run(tiny("fsdp=2,tensor=2", remat=remat, compile=compile_))
        params, _ = run.fresh_state()
        leaves, treedef = optree.tree_flatten(params)
        leaves = [p.requires_grad_() for p in leaves]
        out = []
        for k in range(2):  # (the first call compiles)
            storages = {}

            def pack(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = run.loss(optree.tree_unflatten(treedef, leaves), run.batch(k))
            torch.autograd.grad(loss, leaves)
            out.append(float(loss))
        return sum(storages.values()), out

    kept, losses = saved(False, True)
    kept_remat, losses_remat = saved(True, True)
    eager_remat, losses_eager = saved(True, False)
    assert kept_remat * 2 < kept, (kept_remat, kept)
    assert kept_remat <= 1.5 * eager_remat, (kept_remat, eager_remat)
    assert losses_remat == pytest.approx(losses_eager, rel=1e-12) and losses == pytest.approx(losses_eager, rel=1e-12)


def test_a_run_that_does_not_fit_in_memory_says_so_naming_the_sizes(monkeypatch, capsys, tmp_path):
    """An allocation failure (here: the first batch's) is a message naming the size flags, exit status 1,
    not a traceback from torch's allocator."""
    def fail(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 8000000000 bytes.")

    monkeypatch.setattr(loop.Run, "batch", fail)
    assert loop.main(TINY_FLAGS + ["--mesh", "none", "--steps", "1", "--sample-len", "0", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "shmap-train: error: out of memory (" in err and "--batch-size 8, --seq-len 16" in err
    assert "Fix: smaller sizes." in err


def test_other_runtime_errors_still_propagate(monkeypatch, tmp_path):
    def fail(*a, **k):
        raise RuntimeError("something else")

    monkeypatch.setattr(loop.Run, "batch", fail)
    with pytest.raises(RuntimeError, match="something else"):
        loop.main(TINY_FLAGS + ["--mesh", "none", "--steps", "1", "--sample-len", "0", "--out", str(tmp_path)])
