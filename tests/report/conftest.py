"""One captured step shared by the report tests (a capture costs seconds on this CPU)."""
import pytest
import torch

import stepfx
from tests.steps import mlp_batches, ce_step, small_mlp


@pytest.fixture(scope="module")
def mlp_step():
    """A small MLP's step under ZeRO stage 1 on one process, run three times
    (the last two measured by step.profile): passes that change the graph,
    an optimizer state worth plotting."""
    torch.manual_seed(0)
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"zero_optimization": {"stage": 1}, "gradient_clipping": 0})(ce_step)
    batches = mlp_batches(3)
    step(model, opt, *batches[0])
    step.profile(steps=2)
    for batch in batches[1:]:
        step(model, opt, *batch)
    return step
