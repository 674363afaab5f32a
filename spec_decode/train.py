"""Optax training of T5 models: supervised fine-tuning and draft distillation.

    python -m spec_decode.train --gin_file=configs/demo/ende_target.gin

`train(TrainConfig(...))` is the library entry point (usable from a notebook);
`main` only parses gin into a `TrainConfig`. One jitted step (state donated)
computes the loss, its gradient and the optimizer update:
  * mode 'supervised': token cross-entropy + z-loss (T5X's 1e-4 * logsumexp^2)
    against the task's targets;
  * mode 'distill': a divergence (`losses.DIVERGENCES`) between a frozen
    teacher T5 and the trained draft, on prefixes that are either the task's
    targets ('data') or outputs the teacher generated for the training inputs
    ('target', DistillSpec's on-policy-for-the-teacher variant), plus z-loss.
The train state (step, params, optimizer state) is checkpointed with an orbax
CheckpointManager in `workdir`; a run restarts from the latest one and, since
batches are a function of the step, continues exactly as if uninterrupted.
The final parameters are exported with `checkpoints.save` (T5X or Orbax format).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable, Mapping, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_decode import losses, train_data
from spec_decode.data import tokenized
from spec_decode.models import t5

MODES = ("supervised", "distill")
OPTIMIZERS = ("adafactor", "adamw")
SCHEDULES = ("constant", "rsqrt", "cosine")
PREFIXES = ("data", "target")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a training run needs. model: T5Config fields, optionally {'preset': name, ...}.

  init_checkpoint: start from these parameters instead of a random init; with
  grow_init, a smaller T5 grown into `model` by `models.grow.grow` (function-preserving
  widening and deepening, new parameters from the seed's random init).
  teacher_checkpoint: the frozen target for mode 'distill'. teacher_examples:
  how many training inputs the teacher decodes for prefixes 'target' (greedy
  when teacher_temperature is 0). eval_examples: validation examples per eval.
  export_dtype: dtype of the exported checkpoint ('bfloat16' halves its size).
  """
  task: str = "synthetic_ende"
  model: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"preset": "t5_1_1_tiny"})
  mode: str = "supervised"
  init_checkpoint: Optional[str] = None
  grow_init: bool = False
  teacher_checkpoint: Optional[str] = None
  divergence: str = "fkl"
  distill_temperature: float = 1.0
  prefixes: str = "target"
  teacher_examples: int = 4096
  teacher_temperature: float = 0.0
  optimizer: str = "adamw"
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  schedule: str = "cosine"
  weight_decay: float = 0.0
  z_loss: float = 1e-4
  batch_size: int = 64
  num_steps: int = 1000
  input_length: int = 64
  target_length: int = 64
  max_train_examples: Optional[int] = None
  seed: int = 0
  workdir: Optional[str] = None
  save_every: int = 500
  eval_every: int = 500
  eval_examples: int = 256
  log_every: int = 50
  export_path: Optional[str] = None
  export_format: str = "t5x"
  export_dtype: str = "bfloat16"

  def __post_init__(self):
    for name, allowed in (("mode", MODES), ("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                          ("prefixes", PREFIXES), ("divergence", losses.DIVERGENCES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"TrainConfig.{name} must be one of {allowed}, "
                         f"got {getattr(self, name)!r}")
    for name in ("batch_size", "input_length", "target_length", "save_every", "eval_every",
                 "log_every", "teacher_examples"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.num_steps < 0 or self.warmup_steps < 0 or self.learning_rate <= 0:
      raise ValueError("TrainConfig needs num_steps >= 0, warmup_steps >= 0, learning_rate > 0")
    if self.grow_init and not self.init_checkpoint:
      raise ValueError("TrainConfig.grow_init needs init_checkpoint (the model to grow)")
    if self.mode == "distill" and not self.teacher_checkpoint:
      raise ValueError("mode 'distill' needs teacher_checkpoint")

  def model_config(self) -> t5.T5Config:
    fields = dict(self.model)
    preset = fields.pop("preset", None)
    return t5.T5Config.preset(preset, **fields) if preset else t5.T5Config(**fields)


@flax.struct.dataclass
class TrainState:
  """step: scalar int32; params: T5 parameter tree; opt_state: the optax state."""
  step: jax.Array
  params: Any
  opt_state: Any


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then constant, rsqrt or cosine decay to 10%."""
  peak, warm = cfg.learning_rate, max(cfg.warmup_steps, 1)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    ramp = jnp.minimum(1.0, (step + 1) / warm)
    if cfg.schedule == "constant":
      decay = 1.0
    elif cfg.schedule == "rsqrt":
      decay = jax.lax.rsqrt(jnp.maximum(step, warm) / warm)
    else:
      frac = jnp.clip((step - warm) / max(cfg.num_steps - warm, 1), 0.0, 1.0)
      decay = 0.1 + 0.9 * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return peak * ramp * decay
  return schedule


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  lr = learning_rate_schedule(cfg)
  if cfg.optimizer == "adafactor":
    # T5X's defaults: factored second moments, decay 0.8, update clipping 1.0,
    # updates scaled by the parameter scale.
    opt = optax.adafactor(learning_rate=lr, decay_rate=0.8, clipping_threshold=1.0,
                          multiply_by_parameter_scale=True)
  else:
    opt = optax.adamw(learning_rate=lr, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay)
  return optax.chain(optax.clip_by_global_norm(1.0), opt)


# ----------------------------------------------------------------------------- steps
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


def make_train_step(model, optimizer, cfg, teacher=None) -> Callable:
  """(state, batch, teacher_params) -> (state, metrics), jitted, state donated."""

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state: TrainState, batch, teacher_params):
    grad_fn = jax.value_and_grad(
        lambda p: _loss(model, p, batch, cfg=cfg, teacher=teacher,
                        teacher_params=teacher_params), has_aux=True)
    (loss, metrics), grads = grad_fn(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics
  return step


def make_eval_step(model, cfg, teacher=None) -> Callable:
  @jax.jit
  def step(params, batch, teacher_params):
    _, metrics = _loss(model, params, batch, cfg=cfg, teacher=teacher,
                       teacher_params=teacher_params)
    return metrics
  return step


def evaluate(eval_step, params, batches, teacher_params=None) -> dict[str, float]:
  """Token-weighted means of the eval metrics over `batches`."""
  sums: dict[str, float] = {}
  total = 0.0
  for batch in batches:
    m = jax.device_get(eval_step(params, batch, teacher_params))
    n = float(m["tokens"])
    total += n
    for k, v in m.items():
      if k != "tokens":
        sums[k] = sums.get(k, 0.0) + float(v) * n
  return {k: v / max(total, 1.0) for k, v in sums.items()}


# ----------------------------------------------------------------------------- checkpoints
def _manager(workdir: str, cfg: TrainConfig):
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  return ocp.CheckpointManager(os.path.abspath(workdir), options=options)


def _save_state(manager, state: TrainState) -> None:
  import orbax.checkpoint as ocp
  manager.save(int(state.step), args=ocp.args.StandardSave(
      {"step": state.step, "params": state.params, "opt_state": state.opt_state}))
  manager.wait_until_finished()


def _restore_state(manager, state: TrainState) -> TrainState:
  import orbax.checkpoint as ocp
  latest = manager.latest_step()
  if latest is None:
    return state
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
      {"step": state.step, "params": state.params, "opt_state": state.opt_state})
  restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
  return TrainState(step=jnp.asarray(restored["step"], jnp.int32), params=restored["params"],
                    opt_state=restored["opt_state"])


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


def _teacher_split(teacher, teacher_params, split: train_data.TokenizedSplit, cfg: TrainConfig,
                   report) -> train_data.TokenizedSplit:
  """The first `teacher_examples` training inputs with targets decoded by the teacher."""
  from spec_decode import decoding
  n = min(cfg.teacher_examples, len(split))
  sampling = decoding.Sampling(temperature=cfg.teacher_temperature)
  outs = []
  for start in range(0, n, 256):
    idx = list(range(start, min(n, start + 256)))
    enc = tokenized.pad_rows([split.inputs[i] for i in idx], cfg.input_length, 8)
    r = decoding.autoregressive(teacher, teacher_params, enc, max_decode_len=cfg.target_length,
                                sampling=sampling, rng=jax.random.PRNGKey(cfg.seed + 7),
                                row_ids=np.asarray(idx, np.int32))
    toks, lens = np.asarray(r.tokens), np.asarray(r.lengths)
    outs.extend(tuple(int(t) for t in row[:m]) for row, m in zip(toks, lens))
    report(f"teacher decoded {len(outs)}/{n} training inputs")
  return train_data.TokenizedSplit(split.inputs[:n], tuple(outs))


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """params: final parameters; history: logged metric dicts; eval: the last eval metrics."""
  config: t5.T5Config
  params: Any
  history: tuple
  eval: Mapping[str, float]


def resume(state: TrainState, cfg, report: Callable[[str], None]):
  """(state, Orbax manager) of cfg.workdir: the latest saved state there, if any, else
  `state`; (state, None) without a workdir."""
  manager = _manager(cfg.workdir, cfg) if cfg.workdir else None
  if manager is not None:
    state = _restore_state(manager, state)
    if int(state.step):
      report(f"resumed from step {int(state.step)} in {cfg.workdir}")
  return state, manager


def run_steps(state: TrainState, cfg, *, train_step, eval_step, train_split, eval_split,
              frozen_params, manager, report: Callable[[str], None],
              describe: Callable[[dict], str]):
  """The step loop every resumable trainer shares (this module's and the EAGLE head's).

  From state.step to cfg.num_steps: batch `step` of train_split (cfg.batch_size,
  input/target lengths, seed), train_step(state, batch, frozen_params); every
  cfg.log_every steps a line `step k/N <describe(metrics)> (rate)`, every cfg.eval_every
  (and at the end) an evaluation on eval_split, every cfg.save_every (and at the end) an
  Orbax save to `manager` (None: no saves). Returns (state, history, last eval).
  """
  batch_kw = dict(input_length=cfg.input_length, target_length=cfg.target_length)
  eval_now = lambda: evaluate(eval_step, state.params, train_data.eval_batches(
      eval_split, batch_size=cfg.batch_size, max_examples=cfg.eval_examples, **batch_kw),
      frozen_params)
  history, last_eval = [], {}
  t0, start = time.time(), int(state.step)
  while int(state.step) < cfg.num_steps:
    step = int(state.step)
    batch = train_data.batch_at(train_split, step, batch_size=cfg.batch_size, seed=cfg.seed,
                                **batch_kw)
    state, metrics = train_step(state, batch, frozen_params)
    done = step + 1
    if done % cfg.log_every == 0 or done == cfg.num_steps:
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}
      m["step"] = done
      history.append(m)
      rate = (done - start) / max(time.time() - t0, 1e-9)
      report(f"step {done}/{cfg.num_steps} {describe(m)} ({rate:.2f} steps/s)")
    if done % cfg.eval_every == 0 or done == cfg.num_steps:
      last_eval = eval_now()
      report(f"eval at step {done}: " + json.dumps({k: round(v, 4) for k, v in last_eval.items()}))
    if manager is not None and (done % cfg.save_every == 0 or done == cfg.num_steps):
      _save_state(manager, state)
  if not last_eval:
    last_eval = eval_now()
  return state, history, last_eval


def train(cfg: TrainConfig, *, report: Callable[[str], None] = print,
          train_split: train_data.TokenizedSplit | None = None,
          eval_split: train_data.TokenizedSplit | None = None) -> TrainResult:
  """Runs (or resumes) training for cfg.num_steps steps in total; returns the final state.

  train_split / eval_split override the task's data (tests pass tiny splits).
  """
  model_cfg = cfg.model_config()
  model = t5.T5(model_cfg)
  if cfg.export_path and os.path.isdir(cfg.export_path) and os.listdir(cfg.export_path):
    raise ValueError(f"export_path {cfg.export_path} already holds files; remove it first "
                     f"(checkpoints.save writes into a new or empty directory)")
  if train_split is None or eval_split is None:
    from spec_decode.data import synthetic_tasks
    source = synthetic_tasks.offline_source(cfg.task)
    if train_split is None:
      train_split = source.tokenized("train", cfg.max_train_examples)
    if eval_split is None:
      eval_split = source.tokenized("validation", cfg.eval_examples)
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
      train_split = _teacher_split(teacher, teacher_params, train_split, cfg, report)
  report(f"model: {model.num_params():,} parameters; {len(train_split)} training examples")

  rng = jax.random.PRNGKey(cfg.seed)
  params = model.init(rng)
  if cfg.init_checkpoint:
    params = _initial_params(cfg, model_cfg, rng)
  optimizer = make_optimizer(cfg)
  state = TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))
  state, manager = resume(state, cfg, report)

  train_step = make_train_step(model, optimizer, cfg, teacher)
  eval_step = make_eval_step(model, cfg, teacher)
  state, history, last_eval = run_steps(
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


def run_cli() -> None:
  """`python -m spec_decode.train --gin_file=... [--gin.NAME=VALUE]`: one line per error."""
  from spec_decode import gin_config
  gin_config.run_trainer("spec_decode.train", TrainConfig, "TrainConfig",
                         "configs/demo/... (see configs/demo/)",
                         lambda cfg: train(cfg, report=lambda s: print(s, flush=True)))


if __name__ == "__main__":
  # Run the importable module's copy, so gin registers one TrainConfig class.
  from spec_decode import train as _train
  _train.run_cli()
