import os

import torch

# stepfx's Triton kernels run on CPU only in Triton's interpreter, which is
# chosen when a kernel is defined: set it before any test imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The on-disk plan cache is off for the suite: tests capture on purpose (and
# patch passes and kernels), and a plan another test left would skip that.
# Its own tests (tests/plan_cache/test_plan_cache.py) turn it on with a folder of theirs.
os.environ["STEPFX_CACHE_DIR"] = "off"

# Tiny tensors gain nothing from intra-op threads, and the suite runs two
# test processes (pytest-xdist) plus their rank processes on two cores:
# one thread each, as the rank processes already have (testing/ranks.py).
torch.set_num_threads(1)

pytest_plugins = ["stepfx.testing.pytest_plugin"]
