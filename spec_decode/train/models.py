"""Training T5 models on the one trainer: supervised fine-tuning and draft distillation.

    python -m spec_decode.cli.train --gin_file=configs/demo/ende_target.gin

`train(TrainConfig(...))` is the library entry point (usable from a notebook);
the command line only parses gin into a `TrainConfig`. One jitted step (state
donated, `trainer.make_steps`) computes the loss, its gradient and the optimizer
update:
  * mode 'supervised': token cross-entropy + z-loss (T5X's 1e-4 * logsumexp^2)
    against the task's targets;
  * mode 'distill': a divergence (`losses.DIVERGENCES`) between a frozen
    teacher T5 and the trained draft, on prefixes that are either the task's
    targets ('data') or outputs the teacher generated for the training inputs
    ('target', DistillSpec's on-policy-for-the-teacher variant), plus z-loss.
The train state is checkpointed in `workdir` and a run resumes exactly
(`trainer.resume`, `trainer.run_steps`). The final parameters are exported with
`checkpoints.save` (T5X or Orbax format).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import configurable
from spec_decode.data.tokenized import TokenizedSplit
from spec_decode.models import t5
from spec_decode.train import losses, trainer

MODES = ("supervised", "distill")


@configurable.register(runnable=True)
@dataclasses.dataclass(frozen=True)
class TrainConfig(trainer.RunConfig):
  """A run training a T5 model: the trainer's settings (`trainer.RunConfig`) and the model.

  model: T5Config fields, optionally {'preset': name, ...}. mode: 'supervised' or
  'distill'. init_checkpoint: start from these parameters instead of a random init; with
  grow_init, a smaller T5 grown into `model` by `models.grow.grow` (function-preserving
  widening and deepening, new parameters from the seed's random init).
  teacher_checkpoint: the frozen target for mode 'distill'; divergence and
  distill_temperature: `losses.divergence`. z_loss: T5X's z-loss weight. export_format:
  't5x', 'orbax' or 'hf' (`checkpoints.FORMATS`); export_dtype ('bfloat16' by default)
  halves the checkpoint's size. Both, and the keys of `model`, are checked when the config
  is built: a typo there would otherwise surface only after training.
  """
  model: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"preset": "t5_1_1_tiny"})
  mode: str = "supervised"
  init_checkpoint: Optional[str] = None
  grow_init: bool = False
  teacher_checkpoint: Optional[str] = None
  divergence: str = "fkl"
  distill_temperature: float = 1.0
  z_loss: float = 1e-4
  export_format: str = "t5x"

  def __post_init__(self):
    super().__post_init__()
    from spec_decode import checkpoints
    for name, allowed in (("mode", MODES), ("divergence", losses.DIVERGENCES),
                          ("export_format", checkpoints.FORMATS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"TrainConfig.{name} must be one of {allowed}, "
                         f"got {getattr(self, name)!r}")
    trainer.check_real(self, "distill_temperature", "a finite number >= 0 (0: the teacher's "
                       "argmax)", lambda v: v >= 0)
    trainer.check_real(self, "z_loss", "a finite number >= 0", lambda v: v >= 0)
    if not isinstance(self.grow_init, bool):
      raise ValueError(f"TrainConfig.grow_init must be True or False, got {self.grow_init!r}")
    if self.grow_init and not self.init_checkpoint:
      raise ValueError("TrainConfig.grow_init needs init_checkpoint (the model to grow)")
    if self.mode == "distill" and not self.teacher_checkpoint:
      raise ValueError("mode 'distill' needs teacher_checkpoint")
    try:  # an unknown key, preset or value in `model` is refused before training
      self.model_config()
    except ValueError as e:
      if str(e).startswith("TrainConfig.model"):
        raise
      raise ValueError(f"TrainConfig.model {self.model!r}: {e}") from e

  def model_config(self) -> t5.T5Config:
    """The T5Config `model` describes; a ValueError naming the keys that are neither 'preset'
    nor a T5Config field (T5Config(**model) would raise a bare TypeError)."""
    if not isinstance(self.model, Mapping):
      raise ValueError(f"TrainConfig.model must be a dict of T5Config fields (optionally with "
                       f"'preset'), got {self.model!r}")
    valid = ["preset"] + [f.name for f in dataclasses.fields(t5.T5Config)]
    unknown = [k for k in self.model if k not in valid]
    if unknown:
      raise ValueError(f"TrainConfig.model has unknown keys {unknown}; valid keys: {valid}")
    fields = dict(self.model)
    preset = fields.pop("preset", None)
    return t5.T5Config.preset(preset, **fields) if preset else t5.T5Config(**fields)

  def run(self, **kw) -> "TrainResult":
    """Trains (`train`): what the command line runs with this config."""
    return train(self, **kw)


# ----------------------------------------------------------------------------- loss
def _loss(model, params, batch, *, cfg, teacher=None, teacher_params=None):
  logits = model.forward(params, batch["encoder_tokens"], batch["decoder_inputs"])
  w = batch["weights"]
  loss_sum, z_sum, correct, total = losses.cross_entropy(logits, batch["decoder_targets"], w,
                                                         z_loss=cfg.z_loss)
  metrics = {"token_loss": (loss_sum - z_sum) / total, "z_loss": z_sum / total,
             "accuracy": correct / total, "tokens": total}
  if teacher is None:
    return loss_sum / total, metrics
  t_logits = teacher.forward(teacher_params, batch["encoder_tokens"], batch["decoder_inputs"])
  div_sum, agree, _ = losses.divergence(t_logits, logits, w, kind=cfg.divergence,
                                        temperature=cfg.distill_temperature)
  metrics.update(divergence=div_sum / total, teacher_agreement=agree / total)
  return (div_sum + z_sum) / total, metrics


# ----------------------------------------------------------------------------- data
def _load_params(path: str, dtype=jnp.float32):
  from spec_decode import checkpoints
  return checkpoints.load(path, dtype=dtype)


def _initial_params(cfg: TrainConfig, model_cfg: t5.T5Config, rng):
  """cfg.init_checkpoint's parameters for model_cfg: as stored, or grown (cfg.grow_init)."""
  init_cfg, params = _load_params(cfg.init_checkpoint, model_cfg.dtype)
  if cfg.grow_init:
    from spec_decode.models import grow
    return grow.grow(init_cfg, params, model_cfg, rng)
  if init_cfg.replace(dtype=model_cfg.dtype) != model_cfg:
    raise ValueError(f"init_checkpoint {cfg.init_checkpoint} holds a different model than "
                     f"TrainConfig.model: {init_cfg} vs {model_cfg} (set TrainConfig.grow_init "
                     f"to grow a smaller model into this one)")
  return params


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """params: final parameters; history: logged metric dicts; eval: the last eval metrics."""
  config: t5.T5Config
  params: Any
  history: tuple
  eval: Mapping[str, float]


def train(cfg: TrainConfig, *, report: Callable[[str], None] = print,
          train_split: TokenizedSplit | None = None,
          eval_split: TokenizedSplit | None = None) -> TrainResult:
  """Runs (or resumes) training for cfg.num_steps steps in total; returns the final state.

  train_split / eval_split override the task's data (tests pass tiny splits).
  """
  model_cfg = cfg.model_config()
  model = t5.T5(model_cfg)
  if cfg.export_path and os.path.isdir(cfg.export_path) and os.listdir(cfg.export_path):
    raise ValueError(f"export_path {cfg.export_path} already holds files; remove it first "
                     f"(checkpoints.save writes into a new or empty directory)")
  train_split, eval_split = trainer.splits(cfg, train_split, eval_split)
  for name, split in (("training", train_split), ("evaluation", eval_split)):
    top = max(max(max(r, default=0) for r in split.inputs),
              max(max(r, default=0) for r in split.targets))
    if top >= model_cfg.vocab_size:
      raise ValueError(f"the {name} data of task {cfg.task!r} has token id {top}, outside the "
                       f"model's vocabulary of {model_cfg.vocab_size} (TrainConfig.model "
                       f"{dict(cfg.model)}); set its vocab_size to the task's vocabulary")
  teacher = teacher_params = None
  if cfg.mode == "distill":
    teacher_cfg, teacher_params = _load_params(cfg.teacher_checkpoint)
    if teacher_cfg.vocab_size != model_cfg.vocab_size:
      raise ValueError(f"teacher vocab_size {teacher_cfg.vocab_size} != draft vocab_size "
                       f"{model_cfg.vocab_size}")
    teacher = t5.T5(teacher_cfg.replace(dtype=jnp.float32))
    if cfg.prefixes == "target":
      train_split = trainer.teacher_split(teacher, teacher_params, train_split, cfg, report)
  report(f"model: {model.num_params():,} parameters; {len(train_split)} training examples")

  rng = jax.random.PRNGKey(cfg.seed)
  params = model.init(rng)
  if cfg.init_checkpoint:
    params = _initial_params(cfg, model_cfg, rng)
  optimizer = trainer.make_optimizer(cfg)
  state = trainer.TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))
  state, manager = trainer.resume(state, cfg, report)

  loss_fn = lambda p, *, target_params, batch: _loss(model, p, batch, cfg=cfg, teacher=teacher,
                                                     teacher_params=target_params)
  train_step, eval_step = trainer.make_steps(loss_fn, optimizer)
  state, history, last_eval = trainer.run_steps(
      state, cfg, train_step=train_step, eval_step=eval_step, train_split=train_split,
      eval_split=eval_split, frozen_params=teacher_params, manager=manager, report=report,
      describe=lambda m: f"loss {m['loss']:.4f} acc {m['accuracy']:.3f}" + (
          f" agree {m['teacher_agreement']:.3f}" if "teacher_agreement" in m else ""))
  if cfg.export_path:
    from spec_decode import checkpoints
    out = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(jnp.dtype(cfg.export_dtype)),
                                 jax.device_get(state.params))
    checkpoints.save(cfg.export_path, model_cfg.replace(dtype=jnp.dtype(cfg.export_dtype)),
                     out, format=cfg.export_format, step=int(state.step))
    report(f"exported {cfg.export_format} checkpoint to {cfg.export_path}")
  return TrainResult(config=model_cfg, params=state.params, history=tuple(history),
                     eval=last_eval)
