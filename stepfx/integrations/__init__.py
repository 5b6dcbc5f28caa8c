"""Front ends for other libraries' training loops.

Each integration is imported on its own, so that stepfx does not import the
library it integrates with until asked:

    from stepfx.integrations.hf import StepfxTrainer   # transformers.Trainer through stepfx (needs accelerate)
"""
