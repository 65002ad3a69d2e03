"""A tiny model for the recipe's tests: seconds per run on 2 cores, float64 so meshes agree to 1e-15."""
from shmap.train import config

TINY = dict(batch_size=8, seq_len=16, layers=2, embed_dim=32, heads=4, mlp_dim=64, eval_batches=1,
            dtype="float64", out=None, progress=False, sample_len=0, eval_every=0)
TINY_FLAGS = ["--batch-size", "8", "--seq-len", "16", "--layers", "2", "--embed-dim", "32", "--heads", "4",
              "--mlp-dim", "64", "--eval-batches", "1", "--dtype", "float64", "--no-progress", "--eval-every", "0"]
#: the meshes the issue names, on at most 8 simulated devices
MESHES = ["data=8", "fsdp=8", "tensor=4", "fsdp=2,tensor=4", "data=2,fsdp=2,tensor=2"]


def tiny(mesh="none", **kw):
    return config.validate(config.Config(mesh=config.parse_mesh(mesh), **{**TINY, "steps": 4, **kw}))
