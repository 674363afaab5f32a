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
import math
import numbers
import os
import time
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_decode import configurable
from spec_decode.data.tokenized import TokenizedSplit, pad_rows
from spec_decode.train import data as train_data

OPTIMIZERS = ("adafactor", "adamw")
SCHEDULES = ("constant", "rsqrt", "cosine")
PREFIXES = ("data", "target")
# The dtypes an export may be cast to: the float dtypes `checkpoints.load` and
# `checkpoints.heads.load` read back (an int8 export would be written, then refused).
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def check_int(cfg, field: str, minimum: int = 1, *, optional: bool = False,
              why: str = "") -> None:
  """Raises a ValueError naming `field` of config `cfg` unless it is an int >= minimum (not a
  bool, a float or a string: gin passes '5' through as a string; None too when `optional`);
  `why` is added to the message. Checked before any comparison, which would otherwise end in
  a raw TypeError ('<' between int and str)."""
  v = getattr(cfg, field)
  if optional and v is None:
    return
  if not configurable.is_int(v) or v < minimum:
    none = " or None" if optional else ""
    raise ValueError(f"{type(cfg).__name__}.{field} must be an int >= {minimum}{none}{why}, "
                     f"got {v!r}")


def check_real(cfg, field: str, need: str, ok: Callable[[float], bool] = lambda v: True) -> None:
  """Raises a ValueError naming `field` of config `cfg` unless it is a finite real number (an
  int or a float, not a bool or a string) for which ok(value) holds; `need` says what it must
  be ('a finite number > 0'). NaN and infinities are refused: a learning rate, weight or decay
  that is not finite makes every parameter NaN at the first step."""
  v = getattr(cfg, field)
  if not (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
          and ok(v)):
    raise ValueError(f"{type(cfg).__name__}.{field} must be {need}, got {v!r}")


def _dtype_name(v) -> str | None:
  """The name of dtype `v` ('bfloat16'), or None when it names no dtype ('float7', 3)."""
  try:
    return jnp.dtype(v).name
  except (TypeError, ValueError):
    return None


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
  and the evaluations. export_path (new or empty), export_dtype (one of `EXPORT_DTYPES`):
  the exported result.

  Every setting is checked when the config is built (types first: gin passes a quoted
  '1e-3' through as a string), so that a typo ends the run before any step, with an error
  naming the setting, not after training or in a raw TypeError.
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
    if _dtype_name(self.export_dtype) not in EXPORT_DTYPES:
      raise ValueError(f"{name}.export_dtype must be one of {EXPORT_DTYPES} (the float dtypes "
                       f"the checkpoint loaders read back), got {self.export_dtype!r}")
    for field in self._positive_ints:
      check_int(self, field)
    check_int(self, "num_steps",
              why=" (0 would export the initial parameters untrained)")
    check_int(self, "eval_examples", why=" (the examples each evaluation reads)")
    check_int(self, "max_train_examples", optional=True,
              why=" (None: the whole training split)")
    check_int(self, "warmup_steps", 0)
    # PRNGKey keeps 32 bits of a seed, and the evaluation's key is PRNGKey(seed + 7): a seed
    # outside this range would silently repeat another seed's random stream
    if not configurable.is_int(self.seed) or not 0 <= self.seed < 2 ** 32 - 7:
      raise ValueError(f"{name}.seed must be an int in [0, 2**32 - 7), got {self.seed!r}")
    check_real(self, "learning_rate", "a finite number > 0", lambda v: v > 0)
    check_real(self, "weight_decay", "a finite number >= 0", lambda v: v >= 0)
    check_real(self, "teacher_temperature", "a finite number >= 0 (0: greedy)",
               lambda v: v >= 0)
    for field, what in (("export_path", "the export is a checkpoint directory (new or empty)"),
                        ("workdir", "it holds the run's checkpoints")):
      path = getattr(self, field)
      if path and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name}.{field} {path} is a file, not a directory: {what}")


class NonFiniteLossError(ValueError):
  """A training step's or an evaluation's loss was NaN or infinite (a diverged run); the
  checkpoint of the parameters that gave it is removed (`run_steps`)."""


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


def _discard_diverged(manager, step: int) -> str:
  """Removes the checkpoint of `step` from `manager`, if one was saved: its parameters gave a
  non-finite loss, and a rerun would resume from them (or, with num_steps <= step, export
  them). Returns what the error says of the workdir: what was removed and the last good
  checkpoint left (a rerun resumes from it), or '' without a workdir."""
  if manager is None:
    return ""
  where, latest = manager.directory, manager.latest_step()
  if step in manager.all_steps():
    manager.delete(step)
    latest = manager.latest_step()
    left = (f"the last good checkpoint left is step {latest}" if latest is not None else
            "none is left (a rerun starts from the beginning)")
    return f"; the checkpoint of step {step} in {where} (those parameters) is removed: {left}"
  if latest is None:
    return f"; {where} holds no checkpoint (a rerun starts from the beginning)"
  return f"; the last good checkpoint in {where} is step {latest}"


def run_steps(state: TrainState, cfg, *, train_step, eval_step, train_split, eval_split,
              frozen_params, manager, report: Callable[[str], None],
              describe: Callable[[dict], str]):
  """The step loop of every training run (T5 models and draft heads).

  From state.step to cfg.num_steps: batch `step` of train_split (cfg.batch_size,
  input/target lengths, seed), train_step(state, batch, frozen_params); every
  cfg.log_every steps a line `step k/N <describe(metrics)> (rate)`, every cfg.eval_every
  (and at the end) an evaluation on eval_split, every cfg.save_every (and at the end) an
  Orbax save to `manager` (None: no saves). Returns (state, history, last eval).

  A diverged run leaves no checkpoint it would resume from or export: the loss of step k is
  computed with the parameters after step k - 1, so a non-finite training loss at step k
  proves those parameters bad, and their checkpoint (if one was saved) is removed before
  the `NonFiniteLossError`; an evaluation after step k (it runs before that step's save)
  whose loss is not finite stops the run the same way. The returned evaluation is of the
  final parameters, so its loss is finite: the callers export only parameters that give a
  finite loss (a rerun that resumes at num_steps evaluates the saved parameters first).
  """
  batch_kw = dict(input_length=cfg.input_length, target_length=cfg.target_length)
  fix = "; lower the learning rate, or check the data and the initial checkpoint"

  def eval_now(done: int) -> dict[str, float]:
    """The evaluation of the parameters after step `done`; a NonFiniteLossError (their
    checkpoint removed) if its loss is not finite."""
    result = evaluate(eval_step, state.params, train_data.eval_batches(
        eval_split, batch_size=cfg.batch_size, max_examples=cfg.eval_examples, **batch_kw),
        frozen_params)
    loss = result.get("loss")
    if loss is not None and not math.isfinite(loss):
      raise NonFiniteLossError(
          f"the evaluation loss is {loss} after step {done}: training stopped and nothing is "
          f"exported" + _discard_diverged(manager, done) + fix)
    return result

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
      given = f"the parameters after step {step}" if step else "the initial parameters"
      raise NonFiniteLossError(
          f"the training loss is {loss} at step {done} (gradient norm "
          f"{float(metrics['grad_norm'])}), computed with {given}: training stopped and "
          "nothing is exported" + _discard_diverged(manager, step) + fix)
    if done % cfg.log_every == 0 or done == cfg.num_steps:
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}
      m["step"] = done
      history.append(m)
      rate = (done - start) / max(time.time() - t0, 1e-9)
      report(f"step {done}/{cfg.num_steps} {describe(m)} ({rate:.2f} steps/s)")
    if done % cfg.eval_every == 0 or done == cfg.num_steps:
      last_eval = eval_now(done)
      report(f"eval at step {done}: " + json.dumps({k: round(v, 4) for k, v in last_eval.items()}))
    if manager is not None and (done % cfg.save_every == 0 or done == cfg.num_steps):
      _save_state(manager, state)
  if not last_eval:
    last_eval = eval_now(int(state.step))
  return state, history, last_eval
