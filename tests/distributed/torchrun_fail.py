"""A program whose rank 2 raises (uncaught) under torchrun; test_dist_launch runs it."""
import torch
import torch.distributed as dist

import shmap
from shmap import P

dist.init_process_group("gloo")
mesh = shmap.make_mesh((dist.get_world_size(),), ("i",))


def body(x):
    if dist.get_rank() == 2:
        raise ValueError("torchrun boom on rank 2")
    return shmap.psum(x, "i")


shmap.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())(torch.ones(8))
print("unreachable on every rank")
