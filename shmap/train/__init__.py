"""The training recipe: a byte-level Transformer decoder trained with DP, FSDP
and TP — and any mix of them — chosen by the mesh alone.

It follows the JAX training cookbook and is a *user* of shmap: it imports only
shmap's public API, so it doubles as the reference for how to write a training
program with shmap.  Read it in this order:

- `config.py`      the run's settings and the `shmap-train` command line
- `model.py`       parameters, their specs per mesh axis, the per-device forward
- `optim.py`       Adam as a map over the parameter pytree, LR schedule, clipping
- `data.py`        byte tokens from a corpus, train/validation split, batches
- `checkpoint.py`  torch.distributed.checkpoint save/restore, any mesh to any mesh
- `loop.py`        the train step, evaluation, sampling, the loop, the command
- `metrics.py`     the run's outputs: lagged metrics, the loss plot, --out's checks

Run it with `make train`, `shmap-train --mesh fsdp=2,tensor=4`, or
`torchrun --nproc-per-node 4 -m shmap.train --mesh data=2,tensor=2`.
"""
from .config import Config, parse_args
from .model import Layout, forward, init_params, param_specs
from .optim import adam_init, adam_update, learning_rate
from .loop import train, main

__all__ = ["Config", "parse_args", "Layout", "forward", "init_params", "param_specs", "adam_init",
           "adam_update", "learning_rate", "train", "main"]
