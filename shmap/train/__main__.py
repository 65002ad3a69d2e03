"""`python -m shmap.train ...` (also under `torchrun --nproc-per-node N -m shmap.train`)."""
import sys

from .loop import main

sys.exit(main())
