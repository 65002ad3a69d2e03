"""`torchrun ... torchrun_faults.py CASE BAD_RANK`: one fault of dist_faults under torchrun (test_dist_launch)."""
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_faults  # noqa: E402

dist.init_process_group("gloo")
result = getattr(dist_faults, sys.argv[1])(int(sys.argv[2]))
print(f"rank {dist.get_rank()} returned {result!r}", flush=True)
