"""The one trainer: a train state, its optimizer, jitted steps, the resumable step loop.

Every training run (a T5 model: `train.models`; a draft head on a frozen target:
`train.heads` and its recipes) is this loop around its own loss:

  train_step, eval_step = make_steps(loss_fn, make_optimizer(cfg))
  state, manager = resume(TrainState(...), cfg, report)
  state, history, last_eval = run_steps(state, cfg, train_step=..., eval_step=..., ...)

loss_fn(params, *, target_params, batch) -> (loss, metrics): target_params are the
frozen parameters the loss reads (a teacher, or the target a head drafts for), or None.
The train state (step, params, optimizer state) is checkpointed with an Orbax
CheckpointManager in cfg.workdir; a run restarts from the latest one and, since batches
are a function of the step (`train.data`), continues exactly as if uninterrupted.

Every training config extends `RunConfig`, the settings of a run that this trainer
reads (a recipe's config adds what its loss and model need, and its own defaults).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_decode.data.tokenized import TokenizedSplit, pad_rows
from spec_decode.train import data as train_data

OPTIMIZERS = ("adafactor", "adamw")
SCHEDULES = ("constant", "rsqrt", "cosine")
PREFIXES = ("data", "target")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The settings of a training run that the trainer reads; every training config extends it
  (`train.models.TrainConfig` for T5 models, `train.heads.HeadTrainConfig` for draft heads).

  task: an offline task (its train and validation splits). prefixes: 'data' (the task's
  targets) or 'target' (the teacher's own outputs for the first teacher_examples inputs,
  greedy when teacher_temperature is 0). optimizer ('adamw' or 'adafactor'), learning_rate,
  warmup_steps, schedule ('constant', 'rsqrt', 'cosine'), weight_decay: `make_optimizer`.
  batch_size, num_steps, input_length, target_length, max_train_examples (None: the whole
  split), seed: the batches (`train.data`). workdir: where the train state is checkpointed
  every save_every steps (a rerun resumes); log_every, eval_every, eval_examples: the log
  and the evaluations. export_path (new or empty), export_dtype: the exported result.
  """
  task: str = "synthetic_ende"
  prefixes: str = "target"
  teacher_examples: int = 4096
  teacher_temperature: float = 0.0
  optimizer: str = "adamw"
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  schedule: str = "cosine"
  weight_decay: float = 0.0
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
  export_dtype: str = "bfloat16"

  _positive_ints = ("batch_size", "input_length", "target_length", "save_every", "eval_every",
                    "log_every", "teacher_examples")

  def __post_init__(self):
    name = type(self).__name__
    for field, allowed in (("prefixes", PREFIXES), ("optimizer", OPTIMIZERS),
                           ("schedule", SCHEDULES)):
      if getattr(self, field) not in allowed:
        raise ValueError(f"{name}.{field} must be one of {allowed}, "
                         f"got {getattr(self, field)!r}")
    for field in self._positive_ints:
      v = getattr(self, field)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}.{field} must be an int >= 1, got {v!r}")
    if not isinstance(self.num_steps, int) or isinstance(self.num_steps, bool) \
        or self.num_steps < 1:
      raise ValueError(f"{name}.num_steps must be an int >= 1 (0 would export the initial "
                       f"parameters untrained), got {self.num_steps!r}")
    # PRNGKey keeps 32 bits of a seed, and the evaluation's key is PRNGKey(seed + 7): a seed
    # outside this range would silently repeat another seed's random stream
    if not isinstance(self.seed, int) or isinstance(self.seed, bool) \
        or not 0 <= self.seed < 2 ** 32 - 7:
      raise ValueError(f"{name}.seed must be an int in [0, 2**32 - 7), got {self.seed!r}")
    if self.warmup_steps < 0 or not 0 < self.learning_rate < float("inf"):
      raise ValueError(f"{name} needs warmup_steps >= 0 and a finite learning_rate > 0, got "
                       f"{self.warmup_steps!r} and {self.learning_rate!r}")
    for field, what in (("export_path", "the export is a checkpoint directory (new or empty)"),
                        ("workdir", "it holds the run's checkpoints")):
      path = getattr(self, field)
      if path and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name}.{field} {path} is a file, not a directory: {what}")


class NonFiniteLossError(ValueError):
  """A training step's loss was NaN or infinite (a diverged run)."""


@flax.struct.dataclass
class TrainState:
  """step: scalar int32; params: the parameter tree being trained; opt_state: optax's."""
  step: jax.Array
  params: Any
  opt_state: Any


def learning_rate_schedule(cfg) -> optax.Schedule:
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


def make_optimizer(cfg) -> optax.GradientTransformation:
  """cfg.optimizer (clipped to global norm 1) with `learning_rate_schedule`."""
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
def make_steps(loss_fn, optimizer):
  """(train_step(state, batch, target_params), eval_step(params, batch, target_params)) of
  loss_fn(params, target_params=..., batch=...) -> (loss, metrics)."""

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state: TrainState, batch, target_params):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: loss_fn(p, target_params=target_params, batch=batch), has_aux=True)(
            state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), metrics

  @jax.jit
  def eval_step(params, batch, target_params):
    loss, metrics = loss_fn(params, target_params=target_params, batch=batch)
    return dict(metrics, loss=loss)
  return train_step, eval_step


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
def _manager(workdir: str):
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
  try:
    restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # Orbax raises ValueError, KeyError, RuntimeError, ... by cause
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    raise ValueError(
        f"cannot resume from the train state saved at step {latest} in {manager.directory}: "
        f"{type(e).__name__}: {first}. It is another run's (another model, optimizer or "
        "head) or it is damaged; use a new workdir, or delete that step's directory to "
        "resume from an earlier one") from e
  return TrainState(step=jnp.asarray(restored["step"], jnp.int32), params=restored["params"],
                    opt_state=restored["opt_state"])


# ----------------------------------------------------------------------------- data
def splits(cfg: RunConfig, train_split: TokenizedSplit | None = None,
           eval_split: TokenizedSplit | None = None) -> tuple[TokenizedSplit, TokenizedSplit]:
  """(training, evaluation) splits of cfg.task (at most max_train_examples and eval_examples
  examples); a split given (tests pass tiny ones) is used as it is."""
  if train_split is None or eval_split is None:
    from spec_decode.data import synthetic_tasks
    source = synthetic_tasks.offline_source(cfg.task)
    if train_split is None:
      train_split = source.tokenized("train", cfg.max_train_examples)
    if eval_split is None:
      eval_split = source.tokenized("validation", cfg.eval_examples)
  return train_split, eval_split


def teacher_split(teacher, teacher_params, split: TokenizedSplit, cfg, report, *,
                  num_examples: int | None = None, what: str = "training") -> TokenizedSplit:
  """The first `num_examples` (default cfg.teacher_examples) inputs of `split` with the
  teacher's own outputs as targets: greedy at cfg.teacher_temperature 0, else sampled
  (keys from cfg.seed, row ids the example indices)."""
  from spec_decode import decoding
  n = min(cfg.teacher_examples if num_examples is None else num_examples, len(split))
  sampling = decoding.Sampling(temperature=cfg.teacher_temperature)
  outs = []
  for start in range(0, n, 256):
    idx = list(range(start, min(n, start + 256)))
    enc = pad_rows([split.inputs[i] for i in idx], cfg.input_length, 8)
    r = decoding.autoregressive(teacher, teacher_params, enc, max_decode_len=cfg.target_length,
                                sampling=sampling, rng=jax.random.PRNGKey(cfg.seed + 7),
                                row_ids=np.asarray(idx, np.int32))
    toks, lens = np.asarray(r.tokens), np.asarray(r.lengths)
    outs.extend(tuple(int(t) for t in row[:m]) for row, m in zip(toks, lens))
    report(f"teacher decoded {len(outs)}/{n} {what} inputs")
  return TokenizedSplit(split.inputs[:n], tuple(outs))


def resume(state: TrainState, cfg, report: Callable[[str], None]):
  """(state, Orbax manager) of cfg.workdir: the latest saved state there, if any, else
  `state`; (state, None) without a workdir."""
  manager = _manager(cfg.workdir) if cfg.workdir else None
  if manager is not None:
    state = _restore_state(manager, state)
    if int(state.step):
      report(f"resumed from step {int(state.step)} in {cfg.workdir}")
  return state, manager


def run_steps(state: TrainState, cfg, *, train_step, eval_step, train_split, eval_split,
              frozen_params, manager, report: Callable[[str], None],
              describe: Callable[[dict], str]):
  """The step loop of every training run (T5 models and draft heads).

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
    loss = float(metrics["loss"])  # the loop waits for each step anyway (state.step)
    if not np.isfinite(loss):
      raise NonFiniteLossError(
          f"the training loss is {loss} at step {done} (gradient norm "
          f"{float(metrics['grad_norm'])}): training stopped; nothing after step {step} is "
          "saved or exported" + (f" (the checkpoints in {cfg.workdir} stay as they were)"
                                 if manager is not None else "")
          + "; lower the learning rate, or check the data and the initial checkpoint")
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
