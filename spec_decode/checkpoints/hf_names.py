"""Hugging Face `T5ForConditionalGeneration` names and config.json <-> T5X names and T5Config.

HF stores torch Linear weights as [out, in], the transpose of T5X's 2-D
kernels, and the relative position tables as [buckets, heads], the transpose
of T5X's rel_embedding; only block 0 of each stack holds the table.
`shared.weight` is the token embedding ([V, E], not transposed) and
`lm_head.weight` [V, E] the untied output projection of T5.1.1.

HF's `tie_word_embeddings` (newer transformers: `scale_decoder_outputs`)
means the decoder output is multiplied by d_model**-0.5 before an lm_head
tied to `shared`: T5X's `logits_via_embedding` (T5 1.0).
"""

from __future__ import annotations

from typing import Any, Mapping

from spec_decode.checkpoints import limits
from spec_decode.checkpoints.common import CheckpointError
from spec_decode.models import t5

# feed_forward_proj <-> T5Config.mlp_activations ('gelu' is the tanh approximation,
# HF's gelu_new, which its 'gated-gelu' uses).
_FEED_FORWARD = {
    "gated-gelu": ("gelu", "linear"),
    "gated-gelu_new": ("gelu", "linear"),
    "gated-relu": ("relu", "linear"),
    "relu": ("relu",),
    "gelu_new": ("gelu",),
}
_FEED_FORWARD_NAME = {
    ("gelu", "linear"): "gated-gelu",
    ("relu", "linear"): "gated-relu",
    ("relu",): "relu",
    ("gelu",): "gelu_new",
}
_ATTENTION = (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))
_MODEL_TYPES = ("t5", "mt5")  # same architecture; umt5 (per-layer position tables) is not


def param_names(config: t5.T5Config) -> dict[str, tuple[str, bool]]:
  """{T5X parameter path: (HF weight name, stored transposed)} for every parameter."""
  names = {"token_embedder/embedding": ("shared.weight", False)}
  stacks = (
      ("encoder", config.num_encoder_layers, "encoder_norm",
       (("pre_attention_layer_norm", "attention", "SelfAttention"),)),
      ("decoder", config.num_decoder_layers, "decoder_norm",
       (("pre_self_attention_layer_norm", "self_attention", "SelfAttention"),
        ("pre_cross_attention_layer_norm", "encoder_decoder_attention", "EncDecAttention"))),
  )
  for stack, num_layers, final_norm, attentions in stacks:
    names[f"{stack}/relpos_bias/rel_embedding"] = (
        f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True)
    names[f"{stack}/{final_norm}/scale"] = (f"{stack}.final_layer_norm.weight", False)
    for i in range(num_layers):
      ours, theirs = f"{stack}/layers_{i}", f"{stack}.block.{i}.layer"
      for j, (norm, attention, hf_attention) in enumerate(attentions):
        names[f"{ours}/{norm}/scale"] = (f"{theirs}.{j}.layer_norm.weight", False)
        for t5x_name, hf_name in _ATTENTION:
          names[f"{ours}/{attention}/{t5x_name}/kernel"] = (
              f"{theirs}.{j}.{hf_attention}.{hf_name}.weight", True)
      j = len(attentions)
      names[f"{ours}/pre_mlp_layer_norm/scale"] = (f"{theirs}.{j}.layer_norm.weight", False)
      for mlp in config.mlp_names() + ("wo",):
        names[f"{ours}/mlp/{mlp}/kernel"] = (f"{theirs}.{j}.DenseReluDense.{mlp}.weight", True)
  if not config.logits_via_embedding:
    names["decoder/logits_dense/kernel"] = ("lm_head.weight", True)
  return names


# Weights HF files may hold that carry no parameter of their own.
IGNORED_WEIGHTS = frozenset({
    "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",  # copies of shared.weight
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",  # unused by HF
})


def _get(hf: Mapping[str, Any], key: str, default=None, *, required: bool = False):
  value = hf.get(key, default)
  if required and value is None:
    raise CheckpointError(f"HF config.json lacks the required field {key!r}")
  return value


def config_from_hf(hf: Mapping[str, Any], where: str = "HF config.json"
                   ) -> tuple[t5.T5Config, bool]:
  """(T5Config, scales decoder outputs) from a parsed config.json.

  The returned config has logits_via_embedding equal to the scaling flag; the
  reader revises it when an untied lm_head is stored without scaling. Sizes
  beyond `limits.MAX_SIZES` are refused here, before anything is built from
  them (`where` names the file in that message).
  """
  model_type = hf.get("model_type", "t5")
  if model_type not in _MODEL_TYPES:
    raise CheckpointError(f"HF model_type {model_type!r} is not a T5 ({_MODEL_TYPES})")
  proj = _get(hf, "feed_forward_proj", "relu")  # HF's default
  if not isinstance(proj, str) or proj not in _FEED_FORWARD:
    raise CheckpointError(f"HF feed_forward_proj {proj!r} is not supported; known: "
                          f"{sorted(_FEED_FORWARD)}")
  if "scale_decoder_outputs" in hf:
    scale = bool(hf["scale_decoder_outputs"])
  else:
    scale = bool(hf.get("tie_word_embeddings", True))  # HF's default
  num_layers = _get(hf, "num_layers", required=True)
  eps = _get(hf, "layer_norm_epsilon", 1e-6)  # checked by limits.check_config_sizes
  try:
    config = t5.T5Config(
        vocab_size=_get(hf, "vocab_size", required=True),
        emb_dim=_get(hf, "d_model", required=True),
        num_heads=_get(hf, "num_heads", required=True),
        head_dim=_get(hf, "d_kv", required=True),
        mlp_dim=_get(hf, "d_ff", required=True),
        num_encoder_layers=num_layers,
        num_decoder_layers=_get(hf, "num_decoder_layers") or num_layers,
        mlp_activations=_FEED_FORWARD[proj],
        logits_via_embedding=scale,
        relative_attention_num_buckets=_get(hf, "relative_attention_num_buckets", 32),
        relative_attention_max_distance=_get(hf, "relative_attention_max_distance", 128),
        layer_norm_epsilon=float(eps) if isinstance(eps, (int, float)) else eps)
  except ValueError as e:
    raise CheckpointError(f"HF config.json does not describe a valid T5: {e}") from e
  limits.check_config_sizes(config, where)
  return config, scale


def config_to_hf(config: t5.T5Config, dtype_name: str) -> dict[str, Any]:
  """config.json contents for `config` (a T5ForConditionalGeneration)."""
  if config.mlp_activations not in _FEED_FORWARD_NAME:
    raise CheckpointError(f"mlp_activations {config.mlp_activations} have no HF "
                          f"feed_forward_proj; supported: {sorted(_FEED_FORWARD_NAME)}")
  return {
      "architectures": ["T5ForConditionalGeneration"],
      "model_type": "t5",
      "is_encoder_decoder": True,
      "vocab_size": config.vocab_size,
      "d_model": config.emb_dim,
      "d_kv": config.head_dim,
      "d_ff": config.mlp_dim,
      "num_layers": config.num_encoder_layers,
      "num_decoder_layers": config.num_decoder_layers,
      "num_heads": config.num_heads,
      "feed_forward_proj": _FEED_FORWARD_NAME[config.mlp_activations],
      "tie_word_embeddings": config.logits_via_embedding,
      "relative_attention_num_buckets": config.relative_attention_num_buckets,
      "relative_attention_max_distance": config.relative_attention_max_distance,
      "layer_norm_epsilon": config.layer_norm_epsilon,
      "decoder_start_token_id": t5.BOS_ID,
      "eos_token_id": t5.EOS_ID,
      "pad_token_id": t5.PAD_ID,
      "dtype": dtype_name,  # transformers >= 5
      "torch_dtype": dtype_name,  # transformers 4.x
  }
