import os

import torch

# stepfx's Triton kernels run on CPU only in Triton's interpreter, which is
# chosen when a kernel is defined: set it before any test imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["stepfx.testing.pytest_plugin"]
