"""Medusa-style heads (Cai et al. 2024) on a frozen T5 target's final decoder states.

Head k (k = 1 .. K) reads the target's final decoder state h_t (the state the
target's own LM head turns into the law of token t + 1) and predicts token
t + 1 + k through a residual block and the TARGET's LM head (frozen, shared):

  f_k = h_t + SiLU(h_t W_k + b_k),   logits_k = target.logits_from_hidden(f_k).

W_k and b_k start at zero, so every head starts as the target's next-token
prediction (Medusa's initialisation) and learns the offset. The heads cost K
small matmuls and one LM-head product of K rows per proposal, with no
sequential draft calls: a chain of K tokens comes out of one state.

Training (`train`): self-distillation on the frozen target. The target decodes
training inputs greedily (its own outputs are what the heads see when
decoding); then, teacher-forced on those outputs, head k at position t is
trained with cross-entropy against the target's own law at position t + k,
softmax(target logits at t + k), weighted 0.8^(k - 1) (later heads are harder
and matter less: a chain stops at its first rejection).

Checkpoints: the one format of draft heads (`checkpoints.heads`, kind 'medusa',
float32 arrays); directories written before it (`medusa.json`, `params.msgpack`) still load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.models import base, t5


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  """num_heads K (tokens proposed per call at most), the target's emb_dim and vocab_size.
  The heads compute in float32 (`dtype`)."""
  num_heads: int
  emb_dim: int
  vocab_size: int

  def __post_init__(self):
    for name in ("num_heads", "emb_dim", "vocab_size"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"MedusaConfig.{name} must be an int >= 1, got {v!r}")

  @classmethod
  def for_target(cls, target: t5.T5, num_heads: int) -> "MedusaConfig":
    return cls(num_heads=num_heads, emb_dim=target.config.emb_dim,
               vocab_size=target.config.vocab_size)

  @property
  def dtype(self):
    return jnp.dtype(jnp.float32)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d) -> "MedusaConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class MedusaHeads(base.ParamSpecs):
  """K heads over a target's final decoder states (hashable: a jit-static draft "model").

  It is the draft of `decoding.Speculative(drafter=MedusaDrafter())`: the loop
  passes it as `draft` with its params as `draft_params`; it has no encoder or
  cache of its own.
  """
  config: MedusaConfig

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def num_heads(self) -> int:
    return self.config.num_heads

  def _param_specs(self):
    """Zero residual blocks: every head starts as the target's next-token prediction."""
    K, D = self.config.num_heads, self.config.emb_dim
    zeros = jax.nn.initializers.zeros
    return {"w": ((K, D, D), (None, "embed", "mlp"), zeros), "b": ((K, D), (None, "mlp"), zeros)}

  def init(self, rng=None) -> dict:
    """Zero residual blocks (deterministic: rng is unused)."""
    return super().init(jax.random.PRNGKey(0) if rng is None else rng)

  def check_params(self, params) -> None:
    """Raises ValueError unless `params` has these heads' names and shapes."""
    self.check_param_names(params, f"Medusa heads ({self.num_heads})")

  def check_target(self, target) -> None:
    """ValueError unless `target` is a T5 of this head's emb_dim and vocabulary."""
    if not isinstance(target, t5.T5):
      raise ValueError(f"Medusa heads read a T5 target's decoder states; got "
                       f"{type(target).__name__}")
    c = target.config
    if (c.emb_dim, c.vocab_size) != (self.config.emb_dim, self.config.vocab_size):
      raise ValueError(f"Medusa heads were made for emb_dim {self.config.emb_dim}, vocab_size "
                       f"{self.config.vocab_size}; the target has emb_dim {c.emb_dim}, "
                       f"vocab_size {c.vocab_size}")

  def features(self, params, hidden):
    """hidden [..., D] -> the heads' states [..., K, D]."""
    h = hidden.astype(jnp.float32)
    z = jnp.einsum("...d,kde->...ke", h, params["w"]) + params["b"]
    return h[..., None, :] + jax.nn.silu(z)

  def logits(self, params, target: t5.T5, target_params, hidden):
    """hidden [..., D] -> float32 logits [..., K, V] through the target's LM head."""
    f = self.features(params, hidden)
    shape = f.shape
    flat = f.reshape((-1, 1, shape[-1])).astype(target.config.dtype)
    out = target.logits_from_hidden(target_params, flat)
    return out.reshape(shape[:-1] + (out.shape[-1],))


head_checkpoints.register("medusa", MedusaHeads, what="a Medusa heads", dtype=jnp.float32,
                          from_config=lambda d: MedusaHeads(MedusaConfig.from_json(d)))


# ----------------------------------------------------------------------------- training
HEAD_DECAY = 0.8


def loss_fn(heads: MedusaHeads, params, target: t5.T5, target_params, batch):
  """(loss, metrics) of self-distillation on one teacher-forced batch.

  batch: encoder_tokens [B, S], decoder_inputs [B, T] (BOS first), weights
  [B, T] (1 at real target tokens). Head k at position t is scored against
  the target's law at t + k for every t with a real token at t + k.
  """
  encoded = target.encode(target_params, batch["encoder_tokens"])
  T = batch["decoder_inputs"].shape[1]
  cache = target.init_cache(target_params, encoded, T)
  out = target.decode(target_params, cache, batch["decoder_inputs"])
  hidden = jax.lax.stop_gradient(out.hidden)
  teacher = jax.nn.log_softmax(jax.lax.stop_gradient(out.logits), axis=-1)  # [B, T, V]
  logits = heads.logits(params, target, target_params, hidden)  # [B, T, K, V]
  logq = jax.nn.log_softmax(logits, axis=-1)
  total, weight_sum, metrics = 0.0, 0.0, {}
  for k in range(1, heads.num_heads + 1):
    p_next = jnp.exp(teacher[:, k:])  # the target's law at t + k, for t = 0 .. T - k - 1
    ce = -jnp.sum(p_next * logq[:, :T - k, k - 1], axis=-1)  # [B, T - k]
    w = batch["weights"][:, k:]
    ce_k = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
    agree = jnp.argmax(logq[:, :T - k, k - 1], -1) == jnp.argmax(teacher[:, k:], -1)
    metrics[f"head{k}_agreement"] = jnp.sum(agree * w) / jnp.maximum(jnp.sum(w), 1.0)
    metrics[f"head{k}_ce"] = ce_k
    total = total + HEAD_DECAY ** (k - 1) * ce_k
    weight_sum += HEAD_DECAY ** (k - 1)
  loss = total / weight_sum
  metrics["loss"] = loss
  metrics["tokens"] = jnp.sum(batch["weights"])  # evaluations weight batches by it
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Self-distillation of Medusa heads on a frozen target checkpoint.

  target_checkpoint: the target (any format `checkpoints.load` reads). task: a
  synthetic task ('synthetic_ende', 'synthetic_cnndm'). teacher_examples:
  training inputs the target decodes greedily (the heads' training targets).
  export_path: where `save` writes the heads (new or empty directory).
  workdir: where the train state is checkpointed every save_every steps (Orbax);
  a rerun with the same workdir resumes (batches are a function of the step).
  """
  target_checkpoint: str
  task: str
  export_path: str | None = None
  num_heads: int = 4
  num_steps: int = 300
  batch_size: int = 32
  learning_rate: float = 3e-3
  input_length: int = 64
  target_length: int = 48
  teacher_examples: int = 2048
  eval_examples: int = 128
  seed: int = 0
  log_every: int = 50
  eval_every: int = 100
  save_every: int = 100
  workdir: str | None = None


def _greedy_split(target, target_params, split, n: int, cfg: TrainConfig, report):
  from spec_decode import decoding, train_data
  from spec_decode.data import tokenized
  n = min(n, len(split))
  outs = []
  for start in range(0, n, 256):
    idx = list(range(start, min(n, start + 256)))
    enc = tokenized.pad_rows([split.inputs[i] for i in idx], cfg.input_length, 8)
    r = decoding.autoregressive(target, target_params, enc, max_decode_len=cfg.target_length)
    toks, lens = np.asarray(r.tokens), np.asarray(r.lengths)
    outs.extend(tuple(int(t) for t in row[:m]) for row, m in zip(toks, lens))
    report(f"target decoded {len(outs)}/{n} inputs")
  return train_data.TokenizedSplit(split.inputs[:n], tuple(outs))


def train(cfg: TrainConfig, *, report: Callable[[str], None] = print, train_split=None,
          eval_split=None) -> dict[str, Any]:
  """Trains (or resumes from cfg.workdir) heads for cfg.num_steps steps in total; returns
  {heads, params, history, eval, minutes} (history: the logged training metrics).

  train_split / eval_split (`train_data.TokenizedSplit`) override the task's
  inputs (tests pass tiny ones); either way the targets are the target's own
  greedy outputs.
  """
  import optax
  from spec_decode import checkpoints, model_specs, train as train_lib
  from spec_decode.heads import train_eagle
  if cfg.export_path and os.path.isdir(cfg.export_path) and os.listdir(cfg.export_path):
    raise ValueError(f"export_path {cfg.export_path} already holds files; remove it first")
  tcfg, tparams = checkpoints.load(model_specs.resolve_checkpoint(cfg.target_checkpoint),
                                   dtype="float32")
  target = t5.T5(tcfg.replace(dtype=jnp.float32))
  if train_split is None or eval_split is None:
    from spec_decode.data import synthetic_tasks
    source = synthetic_tasks.offline_source(cfg.task)
    if train_split is None:
      train_split = source.tokenized("train", cfg.teacher_examples)
    if eval_split is None:
      eval_split = source.tokenized("validation", cfg.eval_examples)
  start = time.time()
  train_split = _greedy_split(target, tparams, train_split, cfg.teacher_examples, cfg, report)
  eval_split = _greedy_split(target, tparams, eval_split, cfg.eval_examples, cfg, report)
  heads = MedusaHeads(MedusaConfig.for_target(target, cfg.num_heads))
  params = heads.init()
  optimizer = optax.adamw(optax.cosine_decay_schedule(cfg.learning_rate, cfg.num_steps),
                          weight_decay=0.0)
  state = train_lib.TrainState(step=jnp.int32(0), params=params,
                               opt_state=optimizer.init(params))
  state, manager = train_lib.resume(state, cfg, report)
  loss = lambda p, *, target_params, batch: loss_fn(heads, p, target, target_params, batch)
  train_step, eval_step = train_eagle.make_steps(loss, optimizer)
  state, history, final = train_lib.run_steps(
      state, cfg, train_step=train_step, eval_step=eval_step, train_split=train_split,
      eval_split=eval_split, frozen_params=tparams, manager=manager, report=report,
      describe=lambda m: (f"loss {m['loss']:.4f} head1_agreement "
                          f"{m['head1_agreement']:.3f}"))
  minutes = (time.time() - start) / 60
  report(f"trained to step {int(state.step)} ({minutes:.1f} min)")
  if cfg.export_path:
    head_checkpoints.save(cfg.export_path, heads, state.params, step=int(state.step))
    report(f"saved Medusa heads to {cfg.export_path}")
  return {"heads": heads, "params": state.params, "history": history, "eval": final,
          "minutes": minutes}


def run_cli() -> None:
  """`python -m spec_decode.heads.medusa --gin_file=configs/demo/ende_medusa.gin`."""
  from spec_decode import gin_config
  gin_config.run_trainer("spec_decode.heads.medusa", TrainConfig, "MedusaTrainConfig",
                         "configs/demo/ende_medusa.gin",
                         lambda cfg: train(cfg, report=lambda s: print(s, flush=True)))


if __name__ == "__main__":
  # Run the importable module's copy, so gin registers one TrainConfig class.
  from spec_decode.heads import medusa as _medusa
  _medusa.run_cli()
