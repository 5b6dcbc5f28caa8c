import os

import torch

# stepfx's Triton kernels run on CPU only in Triton's interpreter, which is
# chosen when a kernel is defined: set it before any test imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny tensors gain nothing from intra-op threads, and the suite runs two
# test processes (pytest-xdist) plus their rank processes on two cores:
# one thread each, as the rank processes already have (testing/ranks.py).
torch.set_num_threads(1)

pytest_plugins = ["stepfx.testing.pytest_plugin"]
