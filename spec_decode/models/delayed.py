"""An artificial-delay draft: any `Decoder` plus a fixed extra cost per decode call.

The c sweep of `experiments/ablate.py` varies the draft's cost coefficient c = T_q / T_p
continuously while keeping its distributions (so alpha) fixed:

  draft = DelayedDecoder(inner=small, mode="compute")
  params = draft.wrap_params(small_params, delay=200)   # 200 extra matmuls per call

The delay is a *parameter* (a traced scalar), not a static field, so one
compiled speculative loop serves every delay of a sweep. Two modes:

* "compute" (default): a dependent chain of `delay` [n, n] matmuls (n =
  `matmul_size`) inside the decode call, fed by the logits and fed back into
  them, so XLA neither drops it (its result is used) nor overlaps it with the
  draft's own work (a data dependence orders them). It costs device time the
  way a bigger draft does, runs on every backend and under a mesh (replicated
  on each device), and never leaves the device. Its seconds per iteration vary
  with the hardware and with contention, so the c it gives is measured.
* "sleep": a host callback (`jax.experimental.io_callback`) that sleeps
  `delay` seconds, ordered after the logits by a data dependence. A Python
  `time.sleep` in the traced function would run once at trace time; the
  callback runs on every call, inside `lax.scan`/`while_loop` too. It adds
  exact wall time without using a core (useful on a loaded CPU), but on a GPU
  or TPU each call also waits for a device-to-host round trip, which is itself
  a cost the real draft would not have.

Either way the logits are unchanged (the extra term is exactly 0).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

MODES = ("compute", "sleep")


def _sleep(seconds, probe) -> np.ndarray:
  del probe  # only orders the callback after the logits
  time.sleep(max(float(seconds), 0.0))
  return np.zeros((), np.float32)


@dataclasses.dataclass(frozen=True)
class DelayedDecoder:
  """`inner` (a hashable Decoder) with `delay` extra cost per `decode` call.

  params: {"inner": the inner model's params, "delay": scalar} (see
  `wrap_params`); the cache is the inner model's own, so rewinds and sharding
  rules apply unchanged.
  """
  inner: Any
  mode: str = "compute"
  matmul_size: int = 128

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"DelayedDecoder.mode must be one of {MODES}, got {self.mode!r}")
    if not isinstance(self.matmul_size, int) or isinstance(self.matmul_size, bool) \
        or self.matmul_size < 1:
      raise ValueError(f"DelayedDecoder.matmul_size must be an int >= 1, "
                       f"got {self.matmul_size!r}")
    for name in ("encode", "init_cache", "decode", "vocab_size"):
      if not hasattr(self.inner, name):
        raise ValueError(f"DelayedDecoder.inner must implement the Decoder protocol; "
                         f"{type(self.inner).__name__} has no {name!r}")

  @property
  def delay_dtype(self):
    return jnp.int32 if self.mode == "compute" else jnp.float32

  def wrap_params(self, inner_params, delay) -> dict:
    """Params for this wrapper: delay = matmul iterations (compute) or seconds (sleep)."""
    d = np.asarray(delay)
    if d.ndim or not np.isfinite(d) or d < 0 or (self.mode == "compute" and d != np.round(d)):
      kind = "a whole number of iterations" if self.mode == "compute" else "seconds"
      raise ValueError(f"delay must be a scalar >= 0 ({kind}), got {delay!r}")
    return {"inner": inner_params, "delay": jnp.asarray(delay, self.delay_dtype)}

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  @property
  def config(self):
    """The inner model's config (partitioning reads num_heads from it), or None."""
    return getattr(self.inner, "config", None)

  def logical_axes(self) -> dict:
    return {"inner": self.inner.logical_axes(), "delay": ()}

  def param_shapes(self) -> dict:
    return {"inner": self.inner.param_shapes(),
            "delay": jax.ShapeDtypeStruct((), self.delay_dtype)}

  def encode(self, params, encoder_tokens):
    return self.inner.encode(params["inner"], encoder_tokens)

  def init_cache(self, params, encoded, max_decode_len: int):
    return self.inner.init_cache(params["inner"], encoded, max_decode_len)

  def decode(self, params, cache, tokens, *, positions=None, tree_mask=None):
    """The inner decode, then the delay; returns the inner outputs unchanged."""
    out = self.inner.decode(params["inner"], cache, tokens, positions=positions,
                            tree_mask=tree_mask)
    return out.replace(logits=self._delay(out.logits, params["delay"]))

  @functools.partial(jax.jit, static_argnums=0)
  def _delay(self, logits, delay):
    probe = jnp.sum(logits)  # a full reduction: valid for any sharding of the logits
    if self.mode == "sleep":
      zero = io_callback(_sleep, jax.ShapeDtypeStruct((), jnp.float32), delay, probe,
                         ordered=False)
      return logits + zero
    n = self.matmul_size
    x = jnp.full((n, n), 1.0 / n, jnp.float32) * jnp.tanh(probe)
    w = (jnp.eye(n, dtype=jnp.float32) + 1.0 / n) * 0.5
    x = jax.lax.fori_loop(0, delay, lambda _, x: jnp.tanh(x @ w), x)
    # tanh keeps x finite, so this adds exactly 0; XLA does not fold 0 * x for floats,
    # so the chain stays (checked in tests/test_experiments.py by timing-free HLO).
    return logits + 0.0 * jnp.sum(x)
