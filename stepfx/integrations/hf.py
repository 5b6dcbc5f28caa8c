"""``StepfxTrainer``: a Hugging Face ``transformers.Trainer`` whose training step runs through ``stepfx.parallelize``.

The one-line change to a stock Trainer script::

    trainer = Trainer(model=model, args=args, ...)                                       # before
    trainer = StepfxTrainer(model=model, args=args, ..., stepfx_config="ds_config.json")  # after

``stepfx_config`` is the DeepSpeed JSON (path or dict, with an optional
``"stepfx"`` block) that would otherwise go to ``TrainingArguments(deepspeed=...)``;
``TrainingArguments.deepspeed`` stays unset (it starts DeepSpeed itself).
Launch with torchrun as before. What changes inside the Trainer, and where:

- the config: its ``"auto"`` values are filled from the ``TrainingArguments``
  as transformers' DeepSpeed integration fills them (``hf_config.py``), when
  training starts (the number of update steps is known then);
- the step: ``training_step`` calls one compiled stepfx step (forward with
  the Trainer's own ``compute_loss``, backward, the optimizer's update,
  gradient clipping per the config's ``gradient_clipping``, ZeRO per the
  config). The update happens there, exactly once: the optimizer the
  Trainer loop holds is a stand-in whose ``step``/``zero_grad`` do nothing,
  and the loop's own gradient clipping is skipped (so ``grad_norm`` is not
  logged). The loss it returns is the Trainer's loss for that micro-batch,
  so the logged losses are the stock Trainer's;
- the optimizer: the Trainer's own (``create_optimizer``: AdamW with its
  weight-decay groups, or ``optimizers=`` passed in), or the config's
  ``optimizer`` block built as DeepSpeed builds it (over all trainable
  parameters, one group). The scheduler: the Trainer's own, stepped by its
  loop (the learning rate is an input of the compiled step), or the
  config's ``scheduler`` block, which stepfx advances inside the step (not on
  an fp16-skipped step, as DeepSpeed; the Trainer then logs the next step's
  learning rate, as under DeepSpeed);
- the model is not wrapped in DistributedDataParallel (stepfx does the data
  parallelism) and accelerate's autocast and GradScaler stay off (the
  config's ``fp16``/``bf16`` blocks do mixed precision in the graph);
- checkpoints (``save_strategy``): ``checkpoint-N/`` holds what the stock
  Trainer writes there (the model from ``save_model``, ``trainer_state.json``,
  the RNG files) plus a stepfx checkpoint (``step.save_checkpoint``:
  ``latest`` and ``global_stepN/``, DeepSpeed's layout) in place of
  ``optimizer.pt``/``scheduler.pt``; ``train(resume_from_checkpoint=...)``
  loads it with ``step.load_checkpoint`` (model, optimizer, scheduler and
  step counts; the Trainer restores its own RNG files, at the point of the
  loop where it always does), and so does ``load_best_model_at_end``;
- ``save_model`` writes ``step.model_state_dict()`` (gathered from the
  ZeRO-3 pieces; the fp32 parameters) through the stock ``save_pretrained``;
- evaluation and prediction during training (``eval_strategy``, or
  ``evaluate``/``predict`` between steps) under ZeRO-3 run the model's
  forward through the step's evaluator (``step.evaluator``): the parameters
  stay in pieces, gathered a bucket at a time and freed as in training (as
  DeepSpeed's engine evaluates), so no rank holds the whole model. The
  forward's key/value cache is left out of its output (evaluation ignores
  it). Otherwise (before the first step, after ``train()``, under tensor or
  pipeline parallelism, with ``fp16_full_eval``/``bf16_full_eval``, which
  cast the module itself) evaluation runs on the module after
  ``step.sync_model()`` makes its parameters whole. The end of ``train()``
  makes them whole, so the model is usable afterwards.

Gradient accumulation: stepfx updates every ``gradient_accumulation_steps``
calls; an epoch whose batch count is not a multiple of it (the Trainer ends
its last window early) is refused with a message saying so.

transformers offers no public hooks for most of this, so these private
``Trainer`` methods are overridden (each with the reason at the override):
``_build_accelerator_args``, ``_prepare_for_training``, ``_wrap_model``,
``_clip_grad_norm``, ``_get_grad_norm``, ``_save_optimizer_and_scheduler``,
``_load_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_best_model``; ``_run_epoch`` (not overridden) is the loop they
serve. Written against transformers 5.25 with accelerate 1.16; a Trainer
lacking any of these methods (an older transformers) is refused when the
trainer is made, rather than silently not calling an override.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from transformers import Trainer

from ..api import ParallelStep, parallelize
from ..config import ConfigError, load_config
from ..errors import StepfxError
from ..optimizer_builder import build_optimizer
from .hf_config import raw_config, trainer_config

__all__ = ["ScheduleInStep", "StepfxTrainer", "UpdateInStep"]

log = logging.getLogger("stepfx")

_SCHEDULER_KEY = "hf_lr_scheduler"  # client_state entry holding the Trainer's own scheduler's state


class UpdateInStep(torch.optim.Optimizer):
    """The optimizer as the Trainer loop sees it: parameter groups and state
    are the real optimizer's (so the Trainer's scheduler sets the learning
    rate the compiled step reads), while ``step`` and ``zero_grad`` do
    nothing — the real ones run inside the stepfx step. Like accelerate's
    ``AcceleratedOptimizer``, it does not call ``Optimizer.__init__``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure=None) -> None:  # the update ran inside the stepfx step
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # stepfx clears gradients after an update
        return None


class ScheduleInStep:
    """The config's ``scheduler`` block as the Trainer loop sees it: stepfx
    builds it at the step's first call and advances it inside the step, so
    the loop's ``step()`` does nothing; ``get_last_lr`` reads it (before the
    first call, the optimizer's learning rates) — after an update, that is
    the next update's rate, which the Trainer logs as transformers' DeepSpeed
    integration does. Its state is saved with the stepfx checkpoint."""

    def __init__(self, trainer: StepfxTrainer):
        self._trainer = trainer

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        scheduler = self._trainer.stepfx_step.lr_scheduler
        if scheduler is not None:
            return scheduler.get_last_lr()
        return [group["lr"] for group in self._trainer.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class _StepfxModule(torch.nn.Module):
    """What the Trainer loop gets as its wrapped training model in place of
    DistributedDataParallel: the module itself, unchanged, behind a
    forwarding shell (accelerate then prepares only the optimizer)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _StepfxEvaluation(torch.nn.Module):
    """What evaluation and prediction call in place of the model under a
    stepfx step that has run: each forward goes through the step's evaluator
    (``ParallelStep.evaluator``), which reads the parameters where the step
    keeps them (ZeRO-3: gathered bucket by bucket and freed, never the whole
    model on a rank). The module stays a submodule, so ``eval()``/``train()``
    reach it; other attributes (``config``, ...) are the module's."""

    def __init__(self, module: torch.nn.Module, forward):
        super().__init__()
        self.module = module
        self._evaluate = forward

    def forward(self, *args, **kwargs):
        return self._evaluate(self.module, None, args, kwargs)

    def _get_name(self) -> str:  # compute_loss's label smoothing asks the model's class name
        return self.module._get_name()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def _without_caches(output):
    """A model output without its key/value cache: evaluation ignores it
    (``keys_to_ignore_at_inference``), and its tensors sit in an object that
    a compiled step cannot return."""
    try:
        from transformers.cache_utils import Cache
        from transformers.utils import ModelOutput
    except ImportError:  # pragma: no cover - transformers without caches
        return output
    if isinstance(output, ModelOutput) and any(isinstance(v, Cache) for v in output.values()):
        return type(output)(**{k: v for k, v in output.items() if not isinstance(v, Cache)})
    return output


def _has_stepfx_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "latest"))


# the Trainer's private methods StepfxTrainer overrides: without one, the Trainer would not call the override and
# would, e.g., never build the step or wrap the model in DDP
_OVERRIDDEN = ("_build_accelerator_args", "_prepare_for_training", "_wrap_model", "_clip_grad_norm", "_get_grad_norm",
               "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "_load_from_checkpoint",
               "_load_best_model")


def _check_trainer_version() -> None:
    missing = [name for name in _OVERRIDDEN if not callable(getattr(Trainer, name, None))]
    if missing:
        import transformers

        raise ImportError(f"StepfxTrainer overrides Trainer.{', Trainer.'.join(missing)}, which transformers "
                          f"{transformers.__version__} does not have (written against transformers 5.25)")


class StepfxTrainer(Trainer):
    """``transformers.Trainer`` training through ``stepfx.parallelize(stepfx_config)``.

    ``stepfx_config``: a DeepSpeed JSON config (path or dict; ``"auto"``
    values are filled from the ``TrainingArguments``). Every other argument
    is ``Trainer``'s. ``stepfx_step`` is the compiled step (``explain()``,
    ``updates``, ...) once training started.
    """

    def __init__(self, *args: Any, stepfx_config: Any, **kwargs: Any):
        _check_trainer_version()
        self.stepfx_config = raw_config(stepfx_config)
        load_config(self.stepfx_config)  # a bad key fails here, not when training starts
        self.stepfx_step: ParallelStep | None = None
        self._stepfx_optimizer: torch.optim.Optimizer | None = None  # the real one, updated inside the step
        self._stepfx_optimizer_block = None  # the config's optimizer block, built by create_optimizer
        self._stepfx_owns_scheduler = False  # the config's scheduler block: stepfx builds and advances it
        self._stepfx_k = 1  # gradient accumulation steps
        self._stepfx_calls = 0  # training_step calls since the step was built (or resumed at an update)
        self._stepfx_evaluator: ParallelStep | None = None  # the step's evaluator (evaluation under a step that ran)
        self._stepfx_evaluates = False  # this evaluation loop runs through it
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.args.deepspeed:
            raise ValueError("StepfxTrainer runs the DeepSpeed config through stepfx: pass it as stepfx_config= and "
                             "leave TrainingArguments.deepspeed unset (it starts DeepSpeed itself)")
        if self.is_fsdp_enabled:
            raise ValueError("StepfxTrainer does the data parallelism itself (ZeRO per stepfx_config); turn FSDP off")

    # -- setting up -------------------------------------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        # accelerate's native AMP would wrap forward in autocast and the optimizer in a GradScaler; stepfx does
        # mixed precision in the graph, per the config's fp16/bf16 blocks (their "auto" follows args.fp16/bf16)
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"
        return args

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # the first place where both the model and the number of update steps are known (the "auto" scheduler
        # values need it), as transformers' DeepSpeed integration finalizes its config here (deepspeed_init)
        config = trainer_config(self.stepfx_config, self.args, self.model, max_steps)
        self._stepfx_optimizer_block = config.optimizer
        self._stepfx_owns_scheduler = config.scheduler is not None
        self._stepfx_k = config.gradient_accumulation_steps
        self._stepfx_calls = 0
        # the optimizer block is built by create_optimizer (the Trainer needs it before the first step), and the
        # step is given that optimizer
        self.stepfx_step = parallelize(dataclasses.replace(config, optimizer=None))(self._stepfx_train_step)
        self._stepfx_evaluator = self.stepfx_step.evaluator(self._stepfx_forward)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The real optimizer (the config's ``optimizer`` block, or the
        Trainer's own), behind :class:`UpdateInStep` for the loop."""
        if isinstance(self.optimizer, UpdateInStep):  # a later train() call: the same optimizer
            return self.optimizer
        block = self._stepfx_optimizer_block
        if block is not None:
            if self.optimizer is not None:
                raise ConfigError("optimizer", f"the stepfx_config's optimizer block builds the optimizer "
                                  f"({block.type}), and the Trainer was also given a {type(self.optimizer).__name__}; "
                                  "pass one of them", value=block.type, expected="no optimizers= given")
            real = build_optimizer(block, [p for p in self.model.parameters() if p.requires_grad])
        else:
            real = super().create_optimizer(model)
        self._stepfx_optimizer = real
        self.optimizer = UpdateInStep(real)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """The Trainer's scheduler, or, for a config with a ``scheduler``
        block, :class:`ScheduleInStep` (stepfx builds and advances it)."""
        if self._stepfx_owns_scheduler and self.lr_scheduler is None:
            self.lr_scheduler = ScheduleInStep(self)
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # the Trainer prepares the model with accelerate when _wrap_model returns it unchanged, which wraps it in
        # DistributedDataParallel (a second gradient all-reduce, and a whole-gradient buffer ZeRO is meant to
        # save); a shell that is not the model makes it prepare only the optimizer. Evaluation under ZeRO-3 between
        # steps gets a shell whose forward is the step's evaluator (evaluation_loop decides); otherwise the stock path.
        if training and self.stepfx_step is not None:
            return model if isinstance(model, _StepfxModule) else _StepfxModule(self.model)
        if not training and self._stepfx_evaluates:
            return _StepfxEvaluation(self.model, self._stepfx_evaluator)
        return super()._wrap_model(model, training, dataloader)

    # -- the step ----------------------------------------------------------------------------------------------
    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch through the stepfx step; returns its loss as the Trainer's ``training_step`` does."""
        self._stepfx_calls += 1
        updates = self._stepfx_calls % self._stepfx_k == 0
        if updates != self.accelerator.sync_gradients:
            raise StepfxError(
                f"StepfxTrainer: the Trainer {'ends' if self.accelerator.sync_gradients else 'does not end'} a "
                f"gradient accumulation window at this micro-batch, and stepfx updates every "
                f"{self._stepfx_k} calls; make the number of batches per epoch a multiple of "
                "gradient_accumulation_steps (dataset size, dataloader_drop_last)")
        self.model.train()
        batch = dict(self._prepare_inputs(inputs))  # a BatchEncoding would be an opaque argument to stepfx
        extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        return self.stepfx_step(self.model, self._stepfx_optimizer, batch, self.current_gradient_accumulation_steps,
                                **extra)

    def _stepfx_train_step(self, model, optimizer, inputs, accumulation_steps: int, num_items_in_batch=None):
        """What stepfx captures: the Trainer's ``training_step`` with the
        update (DeepSpeed's engine does the same with ``engine.backward`` and
        ``engine.step``)."""
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # the Trainer's rule: normalized by the token count over the accumulated batches
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / accumulation_steps
        # stepfx divides what is back-propagated by gradient_accumulation_steps (DeepSpeed's scale_wrt_gas), and
        # the loss above is already scaled as the Trainer wants its gradients: multiply that division away
        (loss * self._stepfx_k if self._stepfx_k > 1 else loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def _clip_grad_norm(self, model):
        # clipping happens inside the step (the config's gradient_clipping, over the ZeRO pieces)
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        # the norm is computed inside the step and not returned: no grad_norm is logged
        return grad_norm

    # -- the model for evaluation and saving ---------------------------------------------------------------------
    def _sync_model(self) -> None:
        """Whole parameters back into the module (a collective; a no-op without ZeRO-3 pieces)."""
        if self.stepfx_step is not None and self._stepfx_ran():
            self.stepfx_step.sync_model()

    def _stepfx_ran(self) -> bool:
        try:
            self.stepfx_step.plan  # noqa: B018 - raises until the step's first call
        except RuntimeError:
            return False
        return True

    def train(self, *args, **kwargs):
        """``Trainer.train``; afterwards the module holds the trained parameters (also under ZeRO-3)."""
        output = super().train(*args, **kwargs)
        self._sync_model()
        return output

    def evaluation_loop(self, *args, **kwargs):
        """``Trainer.evaluation_loop``; while ZeRO-3 holds the parameters in
        pieces (between steps, during training), each forward goes through
        the step's evaluator: they stay in pieces, gathered a bucket at a time
        as in training. Otherwise (before the first step, after ``train()``
        made the module whole, under tensor or pipeline parallelism, and with
        ``fp16_full_eval``/``bf16_full_eval``, which cast the module itself)
        on the module's own parameters, made whole first."""
        self._stepfx_evaluates = self._evaluator_applies()
        if not self._stepfx_evaluates:
            self._sync_model()
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self._stepfx_evaluates = False

    def _evaluator_applies(self) -> bool:
        if self.stepfx_step is None or not self._stepfx_ran():
            return False
        if self.args.fp16_full_eval or self.args.bf16_full_eval:
            return False
        world = self.stepfx_step._dp  # the evaluator runs beside data parallelism and ZeRO, not beside TP or PP
        if world is None or world.tp_size > 1 or world.pp_size > 1:
            return False
        # ZeRO-3 between steps: the module's parameters are empty. A module made whole (the end of train()) is
        # evaluated as it is, and stays whole for what the user does next with it
        return any(p.numel() == 0 for p in self.model.parameters())

    def _stepfx_forward(self, model, optimizer, args: tuple, kwargs: dict):
        """What the evaluator captures: the model's forward (as the stock
        ``prediction_step`` calls it), without the key/value cache."""
        return _without_caches(model(*args, **kwargs))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` with the weights stepfx holds (gathered under
        ZeRO-3: a collective, so every rank calls it, as under DeepSpeed)."""
        if self.stepfx_step is None or not self._stepfx_ran():
            return super().save_model(output_dir, _internal_call)
        # every rank takes part in the gather; those that write (args.should_save) get the weights
        state_dict = self.stepfx_step.model_state_dict(rank0_only=not self.args.save_on_each_node)
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # in place of optimizer.pt/scheduler.pt: a stepfx checkpoint (each rank writes the pieces it holds), as the
        # DeepSpeed path writes the engine's checkpoint here. The Trainer's own scheduler goes into its client_state.
        client = {} if self._stepfx_owns_scheduler else {_SCHEDULER_KEY: self.lr_scheduler.state_dict()}
        self.stepfx_step.save_checkpoint(output_dir, client_state=client)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # called by _prepare_for_training after the optimizer and scheduler exist and before the first step
        if checkpoint is None:
            return
        if not _has_stepfx_checkpoint(checkpoint):
            # as the stock Trainer goes on when a checkpoint has no optimizer.pt (save_only_model): the weights were
            # loaded by _load_from_checkpoint, the optimizer and scheduler start afresh
            log.warning("stepfx: %s has no stepfx checkpoint ('latest'): resuming with its model weights only; the "
                        "optimizer and scheduler start afresh", checkpoint)
            return
        # the Trainer restores its RNG files itself, after it skipped the batches already seen
        _, client = self.stepfx_step.load_checkpoint(checkpoint, model=self.model, optimizer=self._stepfx_optimizer,
                                                     load_rng_states=False)
        if not self._stepfx_owns_scheduler:
            self.lr_scheduler.load_state_dict(client[_SCHEDULER_KEY])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # the weights of a stepfx checkpoint come with its optimizer state (_load_optimizer_and_scheduler), as the
        # fp32 parameters; the stock path would read the saved model first, for nothing
        if _has_stepfx_checkpoint(resume_from_checkpoint):
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        # through stepfx, so that the step's pieces (ZeRO-3) and the module agree on the best weights
        best = self.state.best_model_checkpoint
        if self.stepfx_step is None or best is None or not _has_stepfx_checkpoint(best):
            return super()._load_best_model()
        self.stepfx_step.load_checkpoint(best, load_rng_states=False)
        self._sync_model()
