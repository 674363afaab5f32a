"""Our T5 against Hugging Face's T5ForConditionalGeneration on the same random weights.

HF weights are mapped into our tree with `checkpoints.hf.from_state_dict`
(the same name mapping the HF checkpoint reader uses). Checks logits (the same
function in float64, each float32 run within float32 rounding of it:
tests/float64_reference.py) and greedy decoding token for token, for T5.1.1 (gated GELU,
untied output projection) and a T5 1.0-style model (ReLU 'wi', tied and
scaled embeddings).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import float64_reference as f64  # noqa: E402
from spec_decode import decoding  # noqa: E402
from spec_decode.checkpoints import hf  # noqa: E402
from spec_decode.models import t5  # noqa: E402

VOCAB = 64
# Padded encoder inputs of different lengths (0 = pad), ending in EOS = 1.
ENCODER_TOKENS = np.array([
    [5, 17, 33, 8, 9, 41, 12, 1],
    [7, 22, 1, 0, 0, 0, 0, 0],
    [60, 3, 4, 28, 1, 0, 0, 0],
    [13, 1, 0, 0, 0, 0, 0, 0],
], np.int32)


def hf_model(feed_forward_proj: str, tie_word_embeddings: bool, seed: int):
  torch.manual_seed(seed)
  config = transformers.T5Config(
      vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
      num_heads=4, feed_forward_proj=feed_forward_proj,
      tie_word_embeddings=tie_word_embeddings, dropout_rate=0.0,
      decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
  model = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for p in model.parameters():  # HF's init leaves norms at 1; randomize everything
      p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    if not tie_word_embeddings:
      # Newer transformers tie lm_head to `shared` even for T5.1.1; give it its own weights.
      model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.3)
      model.all_tied_weights_keys.pop("lm_head.weight", None)
  return model


def ours_from_hf(model):
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  config, params = hf.from_state_dict(model.config.to_dict(), state, dtype=np.float32)
  return t5.T5(config), params


def decoder_inputs(seed: int, length: int = 7):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, VOCAB, size=(len(ENCODER_TOKENS), length)).astype(np.int32)
  tokens[:, 0] = 0  # BOS
  return tokens


def check_logits(model, ours, params, seed):
  got, ref64 = f64.check_t5_against_hf(model, ours.config, params, ENCODER_TOKENS,
                                       decoder_inputs(seed))
  print(f"max |logit error| vs float64: {np.abs(got - ref64).max():.3e} "
        f"(logit scale {np.abs(ref64).max():.2f})")


@pytest.fixture(scope="module")
def v1_1():
  model = hf_model("gated-gelu", tie_word_embeddings=False, seed=0)
  ours, params = ours_from_hf(model)
  return model, ours, params


def test_v1_1_config_mapping(v1_1):
  _, ours, params = v1_1
  c = ours.config
  assert (c.vocab_size, c.emb_dim, c.num_heads, c.head_dim, c.mlp_dim) == (VOCAB, 32, 4, 8, 48)
  assert (c.num_encoder_layers, c.num_decoder_layers) == (2, 3)
  assert c.mlp_activations == ("gelu", "linear") and not c.logits_via_embedding
  assert "logits_dense" in params["decoder"]


def test_v1_1_logits_match_hf(v1_1):
  model, ours, params = v1_1
  check_logits(model, ours, params, seed=1)


def hf_greedy(model, max_len):
  with torch.no_grad():
    tokens = model.generate(
        input_ids=torch.tensor(ENCODER_TOKENS, dtype=torch.long),
        attention_mask=torch.tensor(ENCODER_TOKENS > 0, dtype=torch.long),
        do_sample=False, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
        max_new_tokens=max_len,
        # transformers 5.x sizes its KV cache by num_layers, which breaks decoders deeper
        # than the encoder (IndexError); without a cache HF recomputes every step.
        use_cache=False).numpy()
  assert np.all(tokens[:, 0] == 0)
  out = np.zeros((len(ENCODER_TOKENS), max_len), np.int32)  # drop BOS, 0-pad to max_len
  out[:, :tokens.shape[1] - 1] = tokens[:, 1:]
  return out


def test_v1_1_greedy_matches_hf_generate():
  max_len = 12
  model = hf_model("gated-gelu", tie_word_embeddings=False, seed=0)
  # Make some rows stop early: EOS takes over the output row of a token that row 0
  # emits, scaled up so it wins wherever that token would have.
  token = int(hf_greedy(model, max_len)[0, 2])
  with torch.no_grad():
    model.lm_head.weight[t5.EOS_ID] = 1.25 * model.lm_head.weight[token]
  expected = hf_greedy(model, max_len)
  ended = (expected == t5.EOS_ID).any(axis=1)
  assert ended.any() and not ended.all(), expected  # both kinds of rows are covered
  ours, params = ours_from_hf(model)
  result = decoding.autoregressive(ours, params, ENCODER_TOKENS, max_decode_len=max_len,
                                   sampling=decoding.Sampling(temperature=0.0))
  np.testing.assert_array_equal(np.asarray(result.tokens), expected)


def test_t5_1_0_tied_scaled_embeddings_match_hf():
  model = hf_model("relu", tie_word_embeddings=True, seed=2)
  ours, params = ours_from_hf(model)
  c = ours.config
  assert c.mlp_activations == ("relu",) and c.logits_via_embedding
  assert "logits_dense" not in params["decoder"] and "wi" in params["encoder"]["layers_0"]["mlp"]
  check_logits(model, ours, params, seed=3)
