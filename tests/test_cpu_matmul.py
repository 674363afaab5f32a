"""The weight-streaming CPU decoding kernel (spec_decode/kernels/cpu_matmul)."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float64_reference as f64
from spec_decode import decoding
from spec_decode.kernels import cpu_matmul
from spec_decode.models import base, t5

HAVE_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None
needs_kernel = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler to build the kernel")


@needs_kernel
def test_kernel_builds_on_cpu():
  assert cpu_matmul.available(), cpu_matmul.unavailable_reason()
  assert cpu_matmul.unavailable_reason() is None


def test_pack_round_trip_and_layout():
  w = np.arange(24 * 40, dtype=np.float32).reshape(24, 40)
  p = cpu_matmul.pack(w)
  assert p.panels.shape == (3, 24, 16) and p.shape == (24, 40) and p.n == 40
  np.testing.assert_array_equal(np.asarray(p.panels[1, 5]), w[5, 16:32])
  np.testing.assert_array_equal(np.asarray(p.panels[2, 0, 8:]), 0)  # zero padding past N
  np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(p)), w)
  with pytest.raises(ValueError, match="float32"):
    cpu_matmul.pack(w.astype(np.float16))
  with pytest.raises(ValueError, match=r"\[K, N\]"):
    cpu_matmul.pack(w[0])


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("k,n", [(33, 50), (64, 16), (256, 200)])
def test_matmul_matches_numpy(m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.standard_normal((2, m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  got = np.asarray(jax.jit(cpu_matmul.matmul)(x, cpu_matmul.pack(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  assert got.shape == (2, m, n)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@needs_kernel
def test_rows_do_not_depend_on_their_neighbours(monkeypatch):
  """A row's product is the same bits alone, in a verify-sized call and in a large one,
  with one thread or several: accumulation over k is in order for every output."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((23, 512)).astype(np.float32)
  w = cpu_matmul.pack(rng.standard_normal((512, 1024)).astype(np.float32) / 20)
  full = np.asarray(jax.jit(cpu_matmul.matmul)(x, w))
  for rows in (slice(0, 1), slice(3, 8), slice(7, 18)):
    part = np.asarray(jax.jit(cpu_matmul.matmul)(x[rows], w))
    np.testing.assert_array_equal(part, full[rows])
  monkeypatch.setenv(cpu_matmul.ENV_THREADS, "1")
  one_thread = np.asarray(jax.jit(lambda a, b: cpu_matmul.matmul(a, b))(x, w))
  np.testing.assert_array_equal(one_thread, full)
  monkeypatch.setenv(cpu_matmul.ENV_THREADS, "zero")
  with pytest.raises(ValueError, match=cpu_matmul.ENV_THREADS):
    jax.jit(lambda a, b: cpu_matmul.matmul(a, b))(x, w)


@needs_kernel
def test_joined_kernels_give_the_separate_products_bit_for_bit():
  rs = np.random.RandomState(5)
  w = [rs.normal(size=(40, n)).astype(np.float32) for n in (24, 40, 7)]
  x = jnp.asarray(rs.normal(size=(6, 40)).astype(np.float32))
  joined = np.asarray(cpu_matmul.matmul(x, cpu_matmul.pack(np.concatenate(w, axis=1))))
  separate = np.concatenate([np.asarray(cpu_matmul.matmul(x, cpu_matmul.pack(k))) for k in w],
                            axis=1)
  np.testing.assert_array_equal(joined, separate)


@needs_kernel
def test_t5_joins_projections_of_one_input(pack_small):
  model, params = _mini()
  packed = model.decode_params(params)
  for block in (packed["encoder"]["layers_0"]["attention"],
                packed["decoder"]["layers_1"]["self_attention"]):
    assert sorted(block) == ["out", t5.JOINED[("query", "key", "value")]]
    assert block["qkv_joined"]["kernel"].shape == (96, 3 * 64)
  cross = packed["decoder"]["layers_1"]["encoder_decoder_attention"]
  assert sorted(cross) == [t5.JOINED[("key", "value")], "out", "query"]
  assert model.decode_params(packed) is packed


@needs_kernel
def test_matmul_refuses_a_feature_mismatch():
  w = cpu_matmul.pack(np.ones((8, 16), np.float32))
  with pytest.raises(ValueError, match="7 features, the kernel wants 8"):
    cpu_matmul.matmul(jnp.ones((2, 7)), w)


def _check_kernel_and_xla_dots(model, packed, params, enc, dec):
  """The model's logits with packed kernels (the CPU kernel) and with XLA's dots: each
  within float32 rounding of the float64 run (tests/float64_reference.py)."""
  ref64, noise = f64.t5_float64_reference(model.config, params, enc, dec)
  kernel, dots = (np.asarray(model.forward(p, enc, dec)) for p in (packed, params))
  f64.assert_float32_rounding(kernel, ref64, noise, "CPU kernel", others=[("XLA dots", dots)])
  f64.assert_float32_rounding(dots, ref64, noise, "XLA dots", others=[("CPU kernel", kernel)])


@pytest.fixture
def pack_small(monkeypatch):
  """Pack even the tests' small models (by default only large ones are packed)."""
  monkeypatch.setattr(cpu_matmul, "MIN_PACKED_ELEMENTS", 0)


def _mini(**overrides):
  model = t5.T5(t5.T5Config.preset("t5_1_1_mini", vocab_size=100, emb_dim=96, mlp_dim=200,
                                   **overrides))
  return model, model.init(jax.random.PRNGKey(0))


@needs_kernel
def test_small_models_keep_xla_dots():
  model, params = _mini()
  assert model.decode_params(params) is params  # no kernel of 2**15 elements (96 x 200 at most)


@needs_kernel
def test_only_large_kernels_are_packed(monkeypatch):
  model, params = _mini()
  monkeypatch.setattr(cpu_matmul, "MIN_PACKED_ELEMENTS", 96 * 200)  # the MLP's, not attention's
  packed = model.decode_params(params)
  layer = packed["decoder"]["layers_0"]
  # The gated MLP's two input kernels are joined into one packed kernel [96, 400].
  assert sorted(layer["mlp"]) == [t5.JOINED_MLP, "wo"]
  assert layer["mlp"][t5.JOINED_MLP]["kernel"].shape == (96, 400)
  assert isinstance(layer["mlp"]["wo"]["kernel"], cpu_matmul.PackedKernel)
  # Attention's q/k/v (3 x 96 x 64 = 18432 elements joined) stay separate XLA dots.
  assert not isinstance(layer["self_attention"]["query"]["kernel"], cpu_matmul.PackedKernel)
  assert model.decode_params(packed) is packed  # a packed tree is not packed again
  enc = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 2, 100)
  _check_kernel_and_xla_dots(model, packed, params, enc, dec)


@needs_kernel
def test_t5_decode_params_packs_once_and_keeps_the_function(pack_small):
  model, params = _mini()
  packed = model.decode_params(params)
  assert model.decode_params(params) is packed  # cached by the leaves' identity
  kernel = packed["decoder"]["layers_1"]["mlp"]["wo"]["kernel"]
  assert isinstance(kernel, cpu_matmul.PackedKernel) and kernel.shape == (200, 96)
  assert not isinstance(packed["token_embedder"]["embedding"], cpu_matmul.PackedKernel)
  np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(kernel)),
                                np.asarray(params["decoder"]["layers_1"]["mlp"]["wo"]["kernel"]))
  enc = jax.random.randint(jax.random.PRNGKey(1), (3, 9), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (3, 6), 2, 100)
  _check_kernel_and_xla_dots(model, packed, params, enc, dec)
  # Another tree (same values, new arrays) is packed anew; models without the hook pass through.
  other = jax.tree_util.tree_map(jnp.array, params)
  assert model.decode_params(other) is not packed
  assert base.decoding_params(object(), params) is params
  assert base.decoding_params(model, None) is None


def test_t5_decode_params_leaves_streamed_and_bfloat16_params_alone(pack_small):
  model, params = _mini()
  assert t5.T5(model.config, stream_params=True).decode_params(params) is params
  bf16 = t5.T5(model.config.replace(dtype=jnp.bfloat16))
  assert bf16.decode_params(params) is params


@needs_kernel
def test_speculative_equals_autoregressive_with_packed_kernels(pack_small):
  target, tparams = _mini()
  draft = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=100))
  dparams = draft.init(jax.random.PRNGKey(3))
  enc = jax.random.randint(jax.random.PRNGKey(4), (4, 11), 2, 100)
  ar = decoding.run(decoding.Autoregressive(), target, tparams, enc, max_decode_len=16)
  spec = decoding.run(decoding.Speculative(gamma=4), target, tparams, enc, draft=draft,
                      draft_params=dparams, max_decode_len=16)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  hlo = jax.jit(lambda p, e: target.forward(p, e, e)).lower(
      target.decode_params(tparams), enc).as_text()
  assert "spec_decode_small_m_matmul" in hlo


def _python(code: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, timeout=300)


_PROBE = """
import jax
from spec_decode.kernels import cpu_matmul
from spec_decode.models import t5
cpu_matmul.MIN_PACKED_ELEMENTS = 0
m = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
p = m.init(jax.random.PRNGKey(0))
print(cpu_matmul.available(), m.decode_params(p) is p, cpu_matmul.unavailable_reason())
"""


def test_disabled_by_environment():
  out = _python(_PROBE, SPEC_DECODE_CPU_KERNELS="0")
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("False True disabled by SPEC_DECODE_CPU_KERNELS"), out.stdout


def test_a_failing_compiler_falls_back_to_xla_dots(tmp_path):
  out = _python(_PROBE, CXX="/bin/false", SPEC_DECODE_KERNEL_CACHE=str(tmp_path))
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("False True /bin/false failed on cpu_matmul.cc"), out.stdout
  assert "using XLA dots" in out.stderr
  assert not list(tmp_path.iterdir())  # no partial library left behind


def test_pack_cache_evicts_and_tracks_identity():
  cache = cpu_matmul.PackCache(size=2)
  calls = []
  make = lambda tree: calls.append(1) or {"packed": tree}
  trees = [{"w": jnp.full((2,), i, jnp.float32)} for i in range(3)]
  first = cache.get(trees[0], make)
  assert cache.get(trees[0], make) is first and len(calls) == 1
  cache.get(trees[1], make)
  cache.get(trees[2], make)  # evicts trees[0], the least recently used
  cache.get(trees[0], make)
  assert len(calls) == 4
