"""Hugging Face directories: written by transformers and read by us, and the reverse."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import float64_reference as f64  # noqa: E402
from spec_decode import checkpoints  # noqa: E402
from spec_decode.models import t5  # noqa: E402

ENC = np.array([[5, 17, 33, 8, 9, 1], [7, 22, 1, 0, 0, 0], [60, 3, 4, 1, 0, 0]], np.int32)
DEC = np.array([[0, 4, 9, 2, 30], [0, 11, 11, 6, 2], [0, 50, 1, 0, 0]], np.int32)


def make_hf(feed_forward_proj="gated-gelu", tie_word_embeddings=False, untie=True, seed=0):
  torch.manual_seed(seed)
  config = transformers.T5Config(
      vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
      num_heads=4, feed_forward_proj=feed_forward_proj,
      tie_word_embeddings=tie_word_embeddings, dropout_rate=0.0)
  model = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    if untie:  # a T5.1.1 lm_head of its own (newer transformers tie it by default)
      model.lm_head.weight = torch.nn.Parameter(torch.randn(64, 32) * 0.3)
      model.all_tied_weights_keys.pop("lm_head.weight", None)
  return model


def check_logits(model, config, params):
  """Ours and transformers' logits on ENC/DEC: the same function in float64, each within
  float32 rounding of it (tests/float64_reference.py)."""
  f64.check_t5_against_hf(model, config, params, ENC, DEC)


@pytest.mark.parametrize("kind", ["v1_1", "v1_1_tied_unscaled", "t5_1_0"])
def test_load_transformers_save_pretrained(tmp_path, kind):
  model = {"v1_1": lambda: make_hf(),
           # transformers 5.x default for tie_word_embeddings=False: lm_head shares
           # `shared` without scaling, and the file holds no lm_head.weight.
           "v1_1_tied_unscaled": lambda: make_hf(untie=False),
           "t5_1_0": lambda: make_hf("relu", tie_word_embeddings=True, untie=False)}[kind]()
  model.save_pretrained(tmp_path / "hf")
  assert checkpoints.detect_format(tmp_path / "hf") == "hf"
  config, params = checkpoints.load(tmp_path / "hf", dtype=jnp.float32)
  assert (config.num_encoder_layers, config.num_decoder_layers, config.mlp_dim) == (2, 3, 48)
  assert config.logits_via_embedding == (kind == "t5_1_0")
  check_logits(model, config, params)


def test_load_pytorch_bin(tmp_path):
  model = make_hf(seed=1)
  model.save_pretrained(tmp_path / "st")
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
  state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}  # all keys, tied too
  torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
  _, from_bin = checkpoints.load(tmp_path / "bin", dtype=jnp.bfloat16)
  _, from_st = checkpoints.load(tmp_path / "st", dtype=jnp.float32)
  for a, b in zip(jax.tree.leaves(from_bin), jax.tree.leaves(from_st)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                  np.asarray(b.astype(jnp.bfloat16)).view(np.uint16))


@pytest.mark.parametrize("preset", ["t5_1_1_tiny", "t5_tiny"])
def test_our_hf_save_loads_in_transformers(tmp_path, preset):
  config = t5.T5Config.preset(preset, num_decoder_layers=3)
  params = t5.T5(config).init(jax.random.PRNGKey(4))
  checkpoints.save(tmp_path / "hf", config, params, format="hf")
  hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert hf_config["tie_word_embeddings"] == config.logits_via_embedding
  assert hf_config["feed_forward_proj"] == ("relu" if preset == "t5_tiny" else "gated-gelu")
  model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
  check_logits(model, config, params)


def test_our_bfloat16_hf_save(tmp_path):
  config = t5.T5Config.preset("t5_1_1_tiny", dtype=jnp.bfloat16)
  params = t5.T5(config).init(jax.random.PRNGKey(5))
  checkpoints.save(tmp_path / "hf", config, params, format="hf")
  model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf")
  assert model.shared.weight.dtype == torch.bfloat16
  np.testing.assert_array_equal(
      model.shared.weight.detach().view(torch.int16).numpy(),
      np.asarray(params["token_embedder"]["embedding"]).view(np.int16))


def test_hf_errors(tmp_path):
  model = make_hf()
  model.save_pretrained(tmp_path / "hf")
  from safetensors.numpy import load_file, save_file
  weights = load_file(tmp_path / "hf" / "model.safetensors")
  name = "decoder.block.2.layer.1.EncDecAttention.k.weight"
  del weights[name]
  save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(checkpoints.CheckpointError,
                     match=rf"missing weights: {name} \(for decoder/layers_2/"
                           r"encoder_decoder_attention/key/kernel\)"):
    checkpoints.load(tmp_path / "hf")
  (tmp_path / "hf" / "model.safetensors").unlink()
  with pytest.raises(checkpoints.CheckpointError, match="has no weights"):
    checkpoints.load(tmp_path / "hf")
  (tmp_path / "hf" / "config.json").write_text(json.dumps(
      {"model_type": "t5", "vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 48,
       "num_layers": 2, "num_heads": 4, "feed_forward_proj": "gated-silu"}))
  with pytest.raises(checkpoints.CheckpointError, match="feed_forward_proj 'gated-silu'"):
    checkpoints.load(tmp_path / "hf")


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "/tmp/model.safetensors"])
def test_index_shard_outside_the_directory_is_refused(tmp_path, shard):
  """An index's weight_map may only name files inside the checkpoint, unless allowed."""
  import shutil
  model = make_hf()
  model.save_pretrained(tmp_path / "hf")
  hf_dir = tmp_path / "hf"
  outside = (hf_dir / shard) if not shard.startswith("/") else tmp_path / "abs.safetensors"
  outside.parent.mkdir(parents=True, exist_ok=True)
  shutil.move(hf_dir / "model.safetensors", outside)
  shard = shard if not shard.startswith("/") else str(outside)
  from safetensors import safe_open
  with safe_open(str(outside), framework="np") as f:
    names = list(f.keys())
  (hf_dir / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {n: shard for n in names}}))
  with pytest.raises(checkpoints.CheckpointError,
                     match="weight_map names .*which lies outside the checkpoint"):
    checkpoints.load(hf_dir)
  config, params = checkpoints.load(hf_dir, dtype=jnp.float32, allow_outside_paths=True)
  check_logits(model, config, params)
