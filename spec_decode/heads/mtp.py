"""DeepSeek-V3-style sequential multi-token-prediction (MTP) modules on a frozen T5 target.

With f_t the target's final decoder state at input s_t (its logits for s_{t+1}
are read from it) and e(s) the target's embedding of token s, module k = 1 .. D
at position t reads the previous module's state there (h^0_t = f_t) and the
embedding of the token k steps ahead:

  x^k_t = W_k [norm(h^{k-1}_t); norm(e(s_{t+k}))]     (2D -> D)
  h^k_t = final_norm_k(one T5 decoder block_k on x^k_t)  (causal self-attention over
                                                    module k's own positions, cross-
                                                    attention to the TARGET's encoder
                                                    output, MLP)

and the target's own frozen LM head turns h^k_t into the law of s_{t+k+1}
(DeepSeek-V3, section 2.2: the modules are sequential, so each prediction
keeps the causal chain of the ones before it). Each module has the shape and
parameter names of an EAGLE head (`heads.eagle`); module k's parameters are
under `mtp_{k}/`. Unlike an EAGLE head, module k is a different network for
each depth k and is trained teacher-forced on true tokens (`train.mtp`), with
no feature-regression target: the chain of states is the modules' own.

Drafting (decoding.drafters.mtp): with m tokens committed and f_{m-1} known,
module k at position m - 1 proposes s_{m+k}, reading the drafts x_1 ..
x_{k-1} as its look-ahead tokens: a proposal of gamma <= D tokens costs gamma
module calls and no target call. Checkpoints are the one format of draft heads
(`checkpoints.heads`, kind 'mtp').
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.heads import eagle
from spec_decode.models import base, t5


@dataclasses.dataclass(frozen=True)
class MtpConfig(eagle.EagleConfig):
  """num_modules D (tokens one proposal holds at most) and each module's block shape
  (the fields of `EagleConfig`; vocab_size and d_model are the target's)."""
  num_modules: int = 4

  def __post_init__(self):
    super().__post_init__()
    D = self.num_modules
    if not isinstance(D, (int, np.integer)) or isinstance(D, bool) or D < 1:
      raise ValueError(f"MtpConfig.num_modules must be an int >= 1, got {D!r}")

  @property
  def module_config(self) -> eagle.EagleConfig:
    """One module's config (an EAGLE head's)."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(eagle.EagleConfig)}
    return eagle.EagleConfig(**fields)

  @classmethod
  def from_json(cls, d) -> "MtpConfig":
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class MtpModules(base.ParamSpecs):
  """D sequential MTP modules: pure functions of (params, inputs); hashable, jit-static.

  It is the draft "model" of `decoding.Speculative(drafter=MtpDrafter())`.
  """
  config: MtpConfig

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def d_model(self) -> int:
    return self.config.d_model

  @property
  def num_modules(self) -> int:
    return self.config.num_modules

  @property
  def module(self) -> eagle.EagleHead:
    """Each module's network: an EAGLE head's (fc, norms, one decoder block)."""
    return eagle.EagleHead(self.config.module_config)

  def _param_specs(self):
    one = self.module._param_specs()
    return {f"mtp_{k}/{path}": spec for k in range(1, self.num_modules + 1)
            for path, spec in one.items()}

  def module_params(self, params, k: int):
    """Module k's (1-based) parameters."""
    return params[f"mtp_{k}"]

  def check_params(self, params) -> None:
    """Raises ValueError unless `params` has these modules' names and shapes."""
    self.check_param_names(params, f"MTP module ({self.num_modules} modules)")

  def decode_params(self, params) -> dict:
    """`params` laid out for decoding: each module's as an EAGLE head's are
    (`EagleHead.decode_params`: on XLA:CPU its layer's and fc's kernels packed for the CPU
    decoding kernel, in bfloat16 when the modules were stored in bfloat16); the same values.
    A proposal runs every module over a window of 2 gamma positions, so the modules' products
    read their weights as the verify call reads the target's, at half the bytes of XLA's
    float32 dots."""
    module = self.module
    return {name: module.decode_params(p) for name, p in params.items()}

  def check_target(self, target) -> None:
    """Raises ValueError unless `target` is a T5 whose states and LM head these modules read."""
    eagle.check_feature_target(target, self.d_model, self.vocab_size, "an MTP module stack")

  def init_caches(self, params, encoded: t5.EncoderOutput, max_length: int, num: int):
    """Empty self-attention caches of modules 1 .. num (`max_length` slots each),
    cross-attending to the TARGET's encoder output."""
    module = self.module
    return tuple(module.init_cache(self.module_params(params, k), encoded, max_length)
                 for k in range(1, num + 1))

  def forward(self, params, encoded: t5.EncoderOutput, features_BTD, embed_fn, tokens_BT):
    """Teacher-forced states [h^1 .. h^D], each [B, T, D], of the modules on a sequence.

    features [B, T, D]: f_0 .. f_{T-1}; tokens [B, T]: s_0 .. s_{T-1} (module k reads
    s_{t+k}; zeros past the end); embed_fn: the target's embedding.
    """
    module = self.module
    T = tokens_BT.shape[1]
    padded = jnp.pad(tokens_BT, ((0, 0), (0, self.num_modules)))
    h, states = features_BTD, []
    for k in range(1, self.num_modules + 1):
      h = module.forward(self.module_params(params, k), encoded, h,
                         embed_fn(padded[:, k:k + T]))
      states.append(h)
    return states

  def window_step(self, params, k: int, cache, states_BWD, tokens_BW, at_B, target: t5.T5,
                  target_params):
    """Module k over a window of W positions (one drafting call of `MtpDrafter`):
    (its states [B, W, D], its cache with lengths + W, the target's LM-head logits [B, V]
    on its state at window slot at_B)."""
    h, cache = self.module.step(self.module_params(params, k), cache, states_BWD,
                                target.embed(target_params, tokens_BW))
    h_at = jnp.take_along_axis(h, at_B[:, None, None], axis=1)
    logits = target.logits_from_hidden(target_params, h_at.astype(target.config.dtype))
    return h, cache, logits[:, 0]


head_checkpoints.register("mtp", MtpModules, what="an MTP module",
                          from_config=lambda d: MtpModules(MtpConfig.from_json(d)))
