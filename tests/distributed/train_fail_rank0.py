"""`shmap-train` whose rank 0 alone fails mid-run (writing its metrics raises OSError, as a full disk
would); test_dist_train runs it under torchrun to check that torchrun's root cause is that rank."""
import sys

import torch.distributed as dist

from shmap.train import loop

_write = loop.RecordWriter.write


def write(self, out):
    if dist.get_rank() == 0 and out.get("step", 0) >= 1:
        raise OSError("No space left on device (injected on rank 0)")
    return _write(self, out)


loop.RecordWriter.write = write
sys.exit(loop.main())
