"""Weight-streaming matrix products for decoding on XLA:CPU (an XLA FFI custom call).

A decode step multiplies a handful of rows (1 token, or the gamma + 1 tokens of
a verify call, times the batch) by every weight matrix. XLA:CPU runs a 1-row
product as a GEMV that reads the weights once, but hands 2 or more rows to a
GEMM library call that packs the weight panel first, so verifying 5 tokens cost
about 1.8-2.4 single-token steps: not the "about one step while memory bound" the
paper's argument rests on.

This module keeps each decoding weight W [K, N] in a panel layout made once
(`pack`: panels[j, k, :] = W[k, 16 j : 16 j + 16]) and multiplies by it with a
small C++ kernel (cpu_matmul.cc) that streams the panels in memory order, so
the weights are read once per call for any number of rows, and splits the
panels over XLA's intra-op threads. Every output accumulates over k in order,
so a row's result does not depend on the other rows of the call: a verify
call's logits equal single-token steps' bit for bit.

Weights: float32; bfloat16, widened to float32 in registers, so a matrix whose values
are bfloat16 (a checkpoint stored in bfloat16) gives its float32 copy's bits at half
the bytes (`pack(weights="auto")` picks it for such matrices); int8 with a float32
scale per column (an option: the products change by the quantization).

Variants: 8-wide vectors (AVX2) always, 16-wide (AVX-512) where the compiler targets
AVX-512F, each with or without weight vectors held in registers ('r': otherwise the
compiler may fold a weight's load into every row's multiply-add, and a block of rows
then waits on the load ports) and with or without software prefetch of the panels
ahead of the hardware prefetcher ('p'), with rows in blocks as even as possible or
full blocks first ('f': 8 rows of 8-wide as 6 + 2, not 4 + 4): '8', '8p', '8r', '8rp',
'8f', ..., '16', ... All give the same bits; which is fastest depends on the CPU, the
weights and the number of rows (on one AMD EPYC, prefetching cost a third of the
bandwidth at 1 row and gained a fifth at 5 rows of 8-wide), so the first product of each
shape and row count on a machine times them and keeps the fastest (`chosen_variant`,
cached per CPU in the kernel cache); SPEC_DECODE_CPU_KERNEL_VARIANT fixes one for
reproducible benchmarks.

The same library attends (`attention`): a decode step's queries against a cache's K and V,
each query reading its visible slots only, where XLA's batched dots read every slot of the
cache (a 160-slot cache holding 30 tokens costs 30), and each computed alone (a verify
call's rows equal single-token steps' here too). T5 decoders whose weights are packed
attend with it (`t5.ATTENTION_KERNEL`).

The kernel is compiled on first use with the system C++ compiler for the host CPU
(-march=native) against jaxlib's FFI headers, cached under $SPEC_DECODE_KERNEL_CACHE
(default ~/.cache/spec_decode/kernels) by source, flags, compiler, jax version and
the CPU's model and features, so a home directory shared between machines never runs
a binary built for another CPU; then registered with jax. Where that is not possible
(no compiler, another backend, SPEC_DECODE_CPU_KERNELS=0) `available()` is False and
models keep XLA's dots; outputs are the same up to float rounding.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from spec_decode import compile_options, native

PANEL = 16
_SOURCE = Path(__file__).with_name("cpu_matmul.cc")
# (int8 scales, fused norm) -> (the jax FFI target, the library's handler symbol)
_TARGETS = {
    (False, False): ("spec_decode_small_m_matmul", "SpecDecodeSmallMMatmul"),
    (True, False): ("spec_decode_small_m_matmul_scaled", "SpecDecodeSmallMMatmulScaled"),
    (False, True): ("spec_decode_small_m_matmul_normed", "SpecDecodeSmallMMatmulNormed"),
    (True, True): ("spec_decode_small_m_matmul_normed_scaled",
                   "SpecDecodeSmallMMatmulNormedScaled"),
}
# Decode-step attention over a cache (`attention`).
_ATTENTION_TARGET = ("spec_decode_decode_attention", "SpecDecodeAttention")
# An encoder's self-attention from its joined projection (`self_attention`) and a joined
# key/value product in the cache's layouts (`kv_layout`).
_SELF_ATTENTION_TARGET = ("spec_decode_self_attention", "SpecDecodeSelfAttention")
_KV_LAYOUT_TARGET = ("spec_decode_kv_layout", "SpecDecodeKvLayout")
# Prefixed to every target name a traced call uses (`handlers_under`); "" for this build's.
_target_prefix = ""


def ffi_targets() -> tuple[tuple[str, str], ...]:
  """(jax FFI target, the library's handler symbol) of every handler the kernel registers."""
  return (*_TARGETS.values(), _ATTENTION_TARGET, _SELF_ATTENTION_TARGET, _KV_LAYOUT_TARGET)


def register_handlers(lib, prefix: str = "") -> None:
  """Registers a loaded kernel library's handlers with jax, each as prefix + its target
  (this build's under their own names; another build's, for an A/B in one process,
  under a prefix of its own: `handlers_under`)."""
  for target, symbol in ffi_targets():
    jax.ffi.register_ffi_target(prefix + target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                platform="cpu")


@contextlib.contextmanager
def handlers_under(prefix: str):
  """Within: programs traced call the handlers `register_handlers` registered under
  `prefix` (another build of this kernel, `experiments.kernel_ab`). jax's caches are
  cleared on entry and on exit (as `t5.switched` does): a jitted function (the model's
  jitted decode, inside a timing loop) keeps the trace of its first call, and would
  otherwise call the handlers that were in force then. Programs compiled ahead of time
  inside the block (`jax.jit(f).lower(...).compile()`, `timing.decode_loop(compiled=True)`)
  keep its handlers; jitted functions called after it retrace."""
  global _target_prefix
  saved, _target_prefix = _target_prefix, prefix
  jax.clear_caches()
  try:
    yield
  finally:
    _target_prefix = saved
    jax.clear_caches()


def _ffi_call(target: str, out):
  """jax's FFI call of one of the kernel's targets (its name, unprefixed) under the
  handlers in use (`handlers_under`)."""
  return jax.ffi.ffi_call(_target_prefix + target, out, vmap_method="sequential")


_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w")
# Weight matrices with fewer elements than this keep XLA's dot (per matrix, in
# `T5.decode_params`). Per product, XLA's single-row dot on a 64 x 64 or 64 x 192 matrix is
# 0.1-0.4 us faster than a custom call (2-core AMD EPYC, a jitted loop), and the kernel wins
# from 192 x 192 up. But a layer whose matrices are all packed also attends in the kernel
# (`t5._attention_kernel`) and folds its norms into the products: the 0.44M draft's step
# (2 layers of 64) runs 48 thunks instead of 133, and each thunk is a cold call right after
# the target's verify call, which evicts every line and instruction a thunk touches. So every
# matrix of 64 x 64 and up is packed (`experiments.draft_layout`: a proposal's cost alone and
# in the loop, and the set-up, per layout; results per CPU in experiments/results).
MIN_PACKED_ELEMENTS = 2 ** 12
ENV_DISABLE = "SPEC_DECODE_CPU_KERNELS"
ENV_CACHE = native.ENV_CACHE
ENV_THREADS = "SPEC_DECODE_CPU_MATMUL_THREADS"
ENV_VARIANT = "SPEC_DECODE_CPU_KERNEL_VARIANT"
WEIGHTS = ("auto", "float32", "bfloat16", "int8", "bfloat16_dot")
_DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.int8): 2}


@flax.struct.dataclass
class PackedKernel:
  """A weight matrix W [K, N] as column panels [ceil(N / 16), K, 16] (zero-padded) of
  float32, bfloat16 or int8; int8 panels have `scales` [16 ceil(N / 16)] (W = q * scale
  per column), the others None. For bfloat16 dot products (`pack(weights='bfloat16_dot')`)
  the panels are [ceil(N / 16), K / 2, 16, 2]: W[2 kk, n] and W[2 kk + 1, n] side by side."""
  panels: jax.Array
  scales: jax.Array | None = None
  n: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def shape(self) -> tuple[int, int]:
    return (self.panels.shape[1] * (2 if self.pairs else 1), self.n)

  @property
  def pairs(self) -> bool:
    """Whether the panels hold bfloat16 pairs for dot products (x rounded to bfloat16)."""
    return self.panels.ndim == 4

  @property
  def dtype(self):
    return self.panels.dtype


def _panels(kernel, dtype) -> jax.Array:
  K, N = kernel.shape
  P = -(-N // PANEL)
  padded = jnp.pad(kernel, ((0, 0), (0, P * PANEL - N))).astype(dtype)
  return jnp.transpose(padded.reshape(K, P, PANEL), (1, 0, 2))


def bfloat16_exact(kernel) -> jax.Array:
  """Whether every value of `kernel` is a bfloat16 value (so bfloat16 panels lose nothing)."""
  kernel = jnp.asarray(kernel)
  return jnp.all(kernel.astype(jnp.bfloat16).astype(kernel.dtype) == kernel)


def pack(kernel, weights: str = "float32") -> PackedKernel:
  """W [K, N] (float32 or bfloat16) -> PackedKernel (one copy of the weights, made once).

  weights: 'float32'; 'bfloat16' (rounds float32 values to bfloat16, exact for values that
  are bfloat16 already; products stay float32 x float32); 'int8' (symmetric per column:
  scale = max |W[:, n]| / 127); 'bfloat16_dot' (bfloat16 weights in pairs of k for the
  AVX512-BF16 dot product, which rounds the activations to bfloat16 too: a different
  function, twice the multiply-adds per instruction; K must be even); 'auto' is
  'bfloat16' when every value is a bfloat16 value, else 'float32' (it needs concrete
  values: decide outside jit with `bfloat16_exact`)."""
  kernel = jnp.asarray(kernel)
  if kernel.ndim != 2 or kernel.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"pack wants a float32 or bfloat16 [K, N] kernel, got {kernel.dtype} "
                     f"{kernel.shape}")
  if weights not in WEIGHTS:
    raise ValueError(f"pack: weights must be one of {WEIGHTS}, got {weights!r}")
  if weights == "auto":
    weights = "bfloat16" if bool(bfloat16_exact(kernel)) else "float32"
  K, N = kernel.shape
  P = -(-N // PANEL)
  if weights == "int8":
    w = kernel.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=0) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127)
    return PackedKernel(panels=_panels(q, jnp.int8),
                        scales=jnp.pad(scale, (0, P * PANEL - N), constant_values=1.0), n=N)
  if weights == "bfloat16_dot":
    if K % 2:
      raise ValueError(f"pack: bfloat16_dot needs an even K, got [K, N] = {kernel.shape}")
    panels = _panels(kernel, jnp.bfloat16)  # [P, K, 16] -> [P, K / 2, 16, 2]
    return PackedKernel(panels=jnp.swapaxes(panels.reshape(P, K // 2, 2, PANEL), 2, 3), n=N)
  return PackedKernel(panels=_panels(kernel, jnp.dtype(weights)), n=N)


def unpack(packed: PackedKernel) -> jax.Array:
  """The float32 matrix [K, N] the kernel multiplies by (for int8: q * scale)."""
  panels = packed.panels
  if packed.pairs:
    P, K2 = panels.shape[:2]
    panels = jnp.swapaxes(panels, 2, 3).reshape(P, 2 * K2, PANEL)
  P, K, _ = panels.shape
  w = jnp.transpose(panels, (1, 0, 2)).reshape(K, P * PANEL).astype(jnp.float32)
  if packed.scales is not None:
    w = w * packed.scales[None, :]
  return w[:, :packed.n]


def _threads() -> int:
  raw = os.environ.get(ENV_THREADS, "")
  if not raw:
    return 1 << 20  # all of XLA's intra-op threads
  try:
    n = int(raw)
  except ValueError:
    n = 0
  if n < 1:
    raise ValueError(f"{ENV_THREADS} must be a positive int, got {raw!r}")
  return n


def matmul(x, kernel: PackedKernel, *, norm=None, eps: float = 1e-6, rows=None) -> jax.Array:
  """x [..., K] @ W -> [..., N] float32 through the kernel (on CPU, when `available()`).

  norm [K]: multiply T5's RMS norm of x by W instead, rms_norm(x) = x * rsqrt(mean(x^2) +
  eps) * norm, computed in the same call (a norm and the projection after it cost one
  kernel launch, not five).

  rows (an int, or a traced int32 scalar): multiply only the first `rows` rows of x
  flattened to [M, K] (clamped to [0, M]); the other rows of the result are zeros. For
  inputs whose trailing rows are padding (an encoder input padded to its length bucket):
  the work follows the real length while the compiled shapes stay fixed. The rows computed
  are the same bits as without `rows`."""
  reason = _register()
  if reason is not None:
    raise RuntimeError(f"the CPU decoding kernel is unavailable ({reason}); multiply by "
                       f"cpu_matmul.unpack(kernel) instead")
  K, N = kernel.shape
  if x.shape[-1] != K:
    raise ValueError(f"matmul: x has {x.shape[-1]} features, the kernel wants {K}")
  if norm is not None and tuple(norm.shape) != (K,):
    raise ValueError(f"matmul: norm must be [{K}], got {tuple(norm.shape)}")
  lead = x.shape[:-1]
  x2 = x.astype(jnp.float32).reshape(-1, K)
  if kernel.pairs and not has_bfloat16_dot():
    raise RuntimeError(f"bfloat16_dot weights need a CPU with AVX512-BF16; "
                       f"{cpu_info()['model']} has {cpu_info()['features']}")
  variant = chosen_variant(x2.shape[0], K, N, kernel.dtype, kernel.pairs)
  out = jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32)
  attrs = dict(threads=np.int64(_threads()), variant=np.int64(_variant_code(variant)))
  args = [x2, kernel.panels] + ([] if kernel.scales is None else [kernel.scales])
  if norm is not None:
    args.append(norm.astype(jnp.float32))
    attrs["eps"] = np.float32(eps)
  args.append(jnp.reshape(jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32), (1,)))
  target = _TARGETS[(kernel.scales is not None, norm is not None)][0]
  y = _ffi_call(target, out)(*args, **attrs)
  return y.reshape(*lead, N)


def attention(q_BTNH, k_BNHL, v_BNLH, bias_BNTL, mask_BTL) -> jax.Array:
  """Attention of T new tokens' queries over a decode cache, float32, on the CPU:
  softmax(where(mask, q . K + bias, -1e10)) @ V per head, without 1 / sqrt(H) (T5's), in the
  cache's layouts: q [B, T, N, H], K [B, N, H, L], V [B, N, L, H], bias [B or 1, N, T, L]
  or None, mask [B, T, L] (broadcastable) -> [B, T, N, H].

  Each query reads the slots up to its last visible one only (XLA's batched dots read all L:
  a 160-slot cache holding 30 tokens costs 30 here), and is computed alone, so a verify
  call's rows are the same bits as single-token steps'. A query that sees no slot attends to
  all L uniformly, as the masked softmax does. The same function as the softmax over XLA's
  dots up to float rounding (its exp is a polynomial of about 1 ulp)."""
  reason = _register()
  if reason is not None:
    raise RuntimeError(f"the CPU decoding kernel is unavailable ({reason})")
  B, T, N, H = q_BTNH.shape
  L = k_BNHL.shape[-1]
  if k_BNHL.shape != (B, N, H, L) or v_BNLH.shape != (B, N, L, H):
    raise ValueError(f"attention: want K [B, N, H, L] and V [B, N, L, H] for q {q_BTNH.shape}, "
                     f"got {k_BNHL.shape} and {v_BNLH.shape}")
  f32 = lambda x: x.astype(jnp.float32)
  mask = jnp.broadcast_to(mask_BTL, (B, T, L)).astype(bool)
  has_bias = bias_BNTL is not None
  if has_bias:  # one bias per row, or one for the batch
    rows = B if jnp.ndim(bias_BNTL) == 4 and jnp.shape(bias_BNTL)[0] == B else 1
    bias = jnp.broadcast_to(f32(bias_BNTL), (rows, N, T, L))
  else:
    bias = jnp.zeros((1, 1, 1, 1), jnp.float32)
  out = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  return _ffi_call(_ATTENTION_TARGET[0], out)(
      f32(q_BTNH), f32(k_BNHL), f32(v_BNLH), bias, mask, threads=np.int64(_threads()),
      has_bias=np.int64(has_bias))


def _joined_heads(x_BSC, num_heads: int, parts: int, what: str) -> tuple[int, int, int, int]:
  """(B, S, N, H) of a joined product [B, S, parts x N x H] of `parts` projections, after
  checking that the kernel is available and the columns split into num_heads heads."""
  reason = _register()
  if reason is not None:
    raise RuntimeError(f"the CPU decoding kernel is unavailable ({reason})")
  B, S, C = x_BSC.shape
  N = int(num_heads)
  if N < 1 or C % (parts * N):
    raise ValueError(f"{what} has {C} columns, not {parts} x {N} heads x head_dim")
  return B, S, N, C // (parts * N)


def dot_attention_head_dim(head_dim: int) -> bool:
  """Whether `self_attention(dot=True)` takes heads of `head_dim` (pairs of 16-lane chunks)."""
  return head_dim % 32 == 0 and head_dim <= 128


def self_attention(qkv_BSC, bias_NR, mask_BS, num_heads: int, *, dot: bool = False
                   ) -> jax.Array:
  """An encoder layer's self-attention read from its joined query/key/value product
  qkv [B, S, 3 N H] (query, key, value columns, heads in order) where it lies: no
  transposed copy of K or V is made outside the kernel (each (row, head) copies its K, and
  for rows of 64 positions or more its V, into a thread's scratch in the order its loops
  read them; such rows run as two blocked matrix products, 6 queries x 16 slots or
  features per block on AVX2, 12 x 32 on AVX-512). bias_NR [N, 2 S - 1] or None: the
  relative-position bias by key - query (query t, key l: bias_NR[:, S - 1 - t + l]);
  mask_BS [B, S]: the keys each row's queries see. -> [B, S, N, H] float32, the same bits
  as `attention` over the split q, K, V, the full bias and the mask broadcast to every
  query.

  dot: both products in bfloat16 dot products (AVX512-BF16; `has_bfloat16_dot`): q, K, the
  softmax's weights and V rounded to bfloat16, pairs summed in float32 (twice the
  multiply-adds per instruction), the softmax in float32; head_dim a multiple of 32. For a
  set-up whose products run in bfloat16 already (`T5.setup_kernel_weights`
  'bfloat16_dot'), as an encoder on a TPU attends."""
  B, S, N, H = _joined_heads(qkv_BSC, num_heads, 3, "self_attention: qkv")
  has_bias = bias_NR is not None
  if has_bias and tuple(bias_NR.shape) != (N, 2 * S - 1):
    raise ValueError(f"self_attention: want bias [{N}, {2 * S - 1}], got {tuple(bias_NR.shape)}")
  if dot and not has_bfloat16_dot():
    raise RuntimeError(f"self_attention(dot=True) needs a CPU with AVX512-BF16; "
                       f"{cpu_info()['model']} has {cpu_info()['features']}")
  if dot and not dot_attention_head_dim(H):
    raise ValueError(f"self_attention(dot=True) needs a head_dim that is a multiple of 32, at "
                     f"most 128; got {H}")
  bias = (bias_NR.astype(jnp.float32) if has_bias else jnp.zeros((1, 1), jnp.float32))
  mask = jnp.broadcast_to(mask_BS, (B, S)).astype(bool)
  out = jax.ShapeDtypeStruct((B, S, N, H), jnp.float32)
  return _ffi_call(_SELF_ATTENTION_TARGET[0], out)(
      qkv_BSC.astype(jnp.float32), bias, mask, threads=np.int64(_threads()), heads=np.int64(N),
      has_bias=np.int64(has_bias), dot=np.int64(bool(dot)))


def kv_layout(kv_BSC, num_heads: int) -> tuple[jax.Array, jax.Array]:
  """A joined key/value product kv [B, S, 2 N H] (key columns, then value columns) in a
  decode cache's layouts: (K [B, N, H, S], V [B, N, S, H]) float32, exact copies made on the
  kernel's threads (XLA's transposes of them run on one)."""
  B, S, N, H = _joined_heads(kv_BSC, num_heads, 2, "kv_layout: kv")
  outs = (jax.ShapeDtypeStruct((B, N, H, S), jnp.float32),
          jax.ShapeDtypeStruct((B, N, S, H), jnp.float32))
  return tuple(_ffi_call(_KV_LAYOUT_TARGET[0], outs)(
      kv_BSC.astype(jnp.float32), threads=np.int64(_threads()), heads=np.int64(N)))


def _cpu_flags() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor()


# CPU features that decide which variants exist or pay (x86 /proc/cpuinfo names).
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni",
            "amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=None)
def cpu_info() -> dict[str, Any]:
  """{'model': the CPU's model name, 'features': those of FEATURES it has}. An x86 model
  name is followed by its family and model numbers ("AMD EPYC (family 25, model 1)"): a
  virtual machine's name can omit the generation, and two generations of one name differ
  in what the kernel can use (a family-25 EPYC of model 1 has AVX2 only, of model 17
  AVX-512)."""
  model = platform.processor() or platform.machine()
  numbers = {}
  processors = 0
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      key, _, value = (part.strip() for part in line.partition(":"))
      processors += key == "processor"
      if processors > 1:  # the first CPU's lines only
        break
      if key == "model name":
        model = value
      elif key in ("cpu family", "model"):
        numbers[key] = value
  except OSError:
    pass
  if "cpu family" in numbers and "model" in numbers:
    model = f"{model} (family {numbers['cpu family']}, model {numbers['model']})"
  flags = set(_cpu_flags().split(":", 1)[-1].split())
  return {"model": model, "features": [f for f in FEATURES if f in flags]}


def build_depends() -> list[str]:
  """What code compiled for this machine depends on beyond its source and flags: jax's
  version and the CPU (its model and feature flags). The kernel's build cache is keyed by
  it (`native.build`), and so is the cache of compiled XLA programs (`compile_cache`)."""
  return [jax.__version__, cpu_info()["model"], _cpu_flags()]


def _build() -> Path:
  """Compiles cpu_matmul.cc (once per source, compiler, jaxlib and CPU) -> the .so path."""
  return native.build(_SOURCE, [*_FLAGS, f"-I{jax.ffi.include_dir()}"],
                      depends_on=build_depends())


_LIB: dict[str, Any] = {}  # the loaded library ('lib') and its path ('path')


@functools.lru_cache(maxsize=None)
def _register() -> str | None:
  """Builds and registers the kernel once per process; None on success, else why not."""
  if compile_options.switched_off(ENV_DISABLE):
    return f"disabled by {ENV_DISABLE}"
  try:
    path = _build()
    lib = ctypes.cdll.LoadLibrary(str(path))
    register_handlers(lib)
    lib.spec_decode_widths.restype = ctypes.c_int64
    lib.spec_decode_has_bf16_dot.restype = ctypes.c_int
    lib.spec_decode_sweep.restype = ctypes.c_double
    lib.spec_decode_sweep.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7
    lib.spec_decode_matmul.restype = ctypes.c_int
    lib.spec_decode_matmul.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
    lib.spec_decode_read_gbps.restype = ctypes.c_double
    lib.spec_decode_read_gbps.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.spec_decode_thread_stats.restype = None
    lib.spec_decode_thread_stats.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.spec_decode_fma_gflops.restype = ctypes.c_double
    lib.spec_decode_fma_gflops.argtypes = [ctypes.c_int64] * 3
    lib.spec_decode_dot_gflops.restype = ctypes.c_double
    lib.spec_decode_dot_gflops.argtypes = [ctypes.c_int64] * 3
  except Exception as e:  # no compiler, no headers, an FFI mismatch: keep XLA's dots
    logging.warning("spec_decode: CPU decoding kernel unavailable, using XLA dots (%s)", e)
    return str(e)
  _LIB.update(lib=lib, path=path)
  return None


def available(backend: str | None = None) -> bool:
  """Whether decoding on `backend` (default: jax's default) can use the kernel."""
  backend = jax.default_backend() if backend is None else backend
  return backend == "cpu" and _register() is None


def unavailable_reason() -> str | None:
  """Why the kernel cannot be used (None when it can, on CPU)."""
  return _register()


def _library():
  reason = _register()
  if reason is not None:
    raise RuntimeError(f"the CPU decoding kernel is unavailable ({reason})")
  return _LIB["lib"]


def widths() -> tuple[int, ...]:
  """The vector widths built into the kernel for this CPU (8; 16 with AVX-512F)."""
  mask = int(_library().spec_decode_widths())
  return tuple(w for w in (8, 16) if mask >> w & 1)


def has_bfloat16_dot() -> bool:
  """Whether the bfloat16 dot-product variant is built (the CPU has AVX512-BF16)."""
  return bool(_library().spec_decode_has_bf16_dot())


def variants() -> tuple[str, ...]:
  """The kernel's variants on this CPU: width ('8', '16'), then 'f' where rows go in full
  blocks first, 'r' where the blocks hold their weight vectors in registers and 'p' where
  they prefetch them (`VARIANT_OPTIONS`)."""
  return tuple(f"{w}{o}" for w in widths() for o in VARIANT_OPTIONS)


# The options after a variant's width: rows in full blocks first ('f': 8 rows of 8-wide
# vectors as 6 + 2, else as even as possible, 4 + 4), weights held in registers ('r': a
# load per weight vector, however many rows use it, where the compiler would fold it into
# every row's multiply-add), software prefetch ('p').
VARIANT_OPTIONS = ("", "p", "r", "rp", "f", "fp", "fr", "frp")
# What the letters mean, for messages and result notes.
VARIANT_LEGEND = "f = full row blocks first, r = weights held in registers, p = software prefetch"
_VARIANT_NAMES = tuple(f"{w}{o}" for w in (8, 16) for o in VARIANT_OPTIONS)
# Rows per block of each width: 6 x 2 vectors of 8 fill 16 registers' accumulators, 12 x 2
# of 16 fill 32 (the kernel's `Blocks` tables).
_MAX_BLOCK_ROWS = {8: 6, 16: 12}


def variant_width(variant: str) -> int:
  """The vector width (floats) of a variant's name: 8 for '8frp'."""
  return int(variant.rstrip("frp"))


def _variant_code(variant: str) -> int:
  """The kernel's attribute for `variant`: 8 x width + 4 x full blocks first + 2 x
  registers + prefetch."""
  return (8 * variant_width(variant) + 4 * ("f" in variant) + 2 * ("r" in variant)
          + variant.endswith("p"))


def row_blocks(M: int, variant: str) -> tuple[int, ...]:
  """The rows of each block in which `variant` multiplies M rows (the kernel's `Panels`):
  as even as possible, or with 'f' full blocks first."""
  most = _MAX_BLOCK_ROWS[variant_width(variant)]
  count = -(-M // most)
  if "f" in variant:
    return tuple(min(most, M - most * b) for b in range(count))
  return tuple(M // count + (b < M % count) for b in range(count))


def distinct_variants(M: int, names=None) -> tuple[str, ...]:
  """`names` (default `variants()`) less the 'f' variants that split M rows as their even
  counterpart does (the same code path: 5 rows of 8-wide are one block either way)."""
  names = variants() if names is None else tuple(names)
  return tuple(v for v in names
               if "f" not in v or row_blocks(M, v) != row_blocks(M, v.replace("f", "")))


def _variant_env() -> str | None:
  """SPEC_DECODE_CPU_KERNEL_VARIANT if set (a ValueError unless a variant's name)."""
  raw = os.environ.get(ENV_VARIANT, "").strip()
  if raw and raw not in _VARIANT_NAMES:
    raise ValueError(f"{ENV_VARIANT} must be one of {', '.join(_VARIANT_NAMES)} (vector "
                     f"width; {VARIANT_LEGEND}), got {raw!r}")
  return raw or None


def check_environment() -> None:
  """A ValueError naming SPEC_DECODE_CPU_KERNEL_VARIANT or SPEC_DECODE_CPU_MATMUL_THREADS
  when either holds a value the kernel refuses, without building the kernel: commands
  check at start, since a run whose models never reach the kernel (all small) would
  otherwise take the bad value silently, and one whose models do would fail only after
  loading them."""
  _variant_env()
  _threads()


def _variant_override() -> str | None:
  raw = _variant_env()
  if raw is None:
    return None
  if raw not in variants():
    raise ValueError(f"{ENV_VARIANT}={raw}: this CPU's kernel has variants {variants()} only "
                     f"({cpu_info()['model']})")
  return raw


def _random_operands(M: int, K: int, N: int, dtype, pairs: bool = False, copies: int = 1):
  """x [M, K], `copies` weight panels of one shape end to end in one buffer, scales."""
  rng = np.random.default_rng(0)
  P = -(-N // PANEL)
  x = rng.standard_normal((M, K)).astype(np.float32)
  shape = (copies, P, K // 2, PANEL, 2) if pairs else (copies, P, K, PANEL)
  if np.dtype(dtype) == np.int8:
    one = rng.integers(-127, 128, shape[1:]).astype(np.int8)
  else:
    one = (rng.standard_normal(shape[1:]) / np.sqrt(K)).astype(dtype)
  return x, np.broadcast_to(one, shape).copy(), np.ones(P * PANEL, np.float32)


def _dtype_code(panels: np.ndarray, pairs: bool) -> int:
  return 3 if pairs else _DTYPE_CODES[panels.dtype]


def raw_matmul(x: np.ndarray, panels: np.ndarray, scales, n: int, variant: str) -> np.ndarray:
  """The kernel's product on numpy arrays in this thread (no XLA): x [M, K] float32,
  panels [P, K, 16] of float32/bfloat16/int8 or bfloat16 pairs [P, K / 2, 16, 2], scales
  [16 P] for int8 (else None), a `variants()` entry."""
  x = np.ascontiguousarray(x, np.float32)
  panels = np.ascontiguousarray(panels)
  y = np.zeros((x.shape[0], n), np.float32)
  s = None if scales is None else np.ascontiguousarray(scales, np.float32)
  if _library().spec_decode_matmul(x.ctypes.data, panels.ctypes.data,
                                   None if s is None else s.ctypes.data, y.ctypes.data,
                                   x.shape[0], x.shape[1], n, _dtype_code(panels, panels.ndim == 4),
                                   _variant_code(variant)) != 0:
    raise ValueError(f"raw_matmul: variant {variant} or {panels.dtype} weights not built")
  return y


# The tuner streams its weights through this many bytes of copies, so that they come from
# memory as a decode step's do, not from a cache that holds one small matrix.
TUNE_STREAM_BYTES = 48 << 20
# Row counts up to this are timed each on its own: the kernel splits them into blocks of
# different sizes (5 rows: one block of 5; 8 rows: two of 4 on 8-wide vectors), and the
# fastest variant for one block size can be a slow one for another (on an AVX2 AMD EPYC,
# with bfloat16 weights, the variant fastest at 8 rows was 4-16% slower at 5 rows, a
# gamma-4 verify call, than the best there, in three sweeps of the decoder's shapes; see
# `experiments/kernel_variants.py`). Above it, power-of-two buckets share the choice timed
# at their top.
TUNE_EXACT_ROWS = 16
# Row buckets above this share its measured choice: the kernel walks rows in blocks of at
# most 12, so more rows change no variant's speed per row, and timing an encoder's
# batch x length rows (millions, for a huge batch) would allocate them all.
TUNE_MAX_ROWS = 1024


def tuning_rows(M: int) -> int:
  """The row count whose measured choice M rows use: M itself up to TUNE_EXACT_ROWS, else
  the top of M's power-of-two bucket, at most TUNE_MAX_ROWS."""
  if M <= TUNE_EXACT_ROWS:
    return max(M, 1)
  return min(1 << (M - 1).bit_length(), TUNE_MAX_ROWS)


def _sweep(args) -> float:
  """Seconds of one `spec_decode_sweep` call (negative: a variant or dtype not built)."""
  return float(_library().spec_decode_sweep(*args))


def panel_bytes(K: int, N: int, dtype) -> int:
  """Bytes of a [K, N] weight matrix packed in panels of `dtype` (N padded to panels)."""
  return -(-N // PANEL) * K * PANEL * np.dtype(dtype).itemsize


def sweep_operands(M: int, K: int, N: int, dtype, pairs: bool = False,
                   stream_bytes: int = TUNE_STREAM_BYTES):
  """(args, copies): random operands of [M, K] x [K, N] products with weights of `dtype`,
  `copies` copies of the weights end to end filling `stream_bytes` (at least one), and
  args(variant), the arguments of a `spec_decode_sweep` call over all of them by that
  variant (the operands live as long as `args`)."""
  one = panel_bytes(K, N, dtype)
  copies = max(1, stream_bytes // one)
  x, panels, scales = _random_operands(M, K, N, dtype, pairs, copies)
  y = np.zeros((M, N), np.float32)
  s = scales.ctypes.data if np.dtype(dtype) == np.int8 else None
  code = _dtype_code(panels, pairs)

  def args(variant: str) -> tuple:
    return (x.ctypes.data, panels.ctypes.data, s, y.ctypes.data, M, K, N, code,
            _variant_code(variant), copies, one)
  return args, copies


def time_variants(M: int, K: int, N: int, dtype, variants_to_time, repeats: int = 3,
                  stream_bytes: int = TUNE_STREAM_BYTES, pairs: bool = False
                  ) -> dict[str, float]:
  """Seconds of one product [M, K] x [K, N] (weights of `dtype`) by each of
  `variants_to_time` in this thread, {variant: seconds}: the least, over `repeats` rounds
  after one warm-up round, of a sweep's time per product, a sweep multiplying by each of
  enough copies of the weights (end to end in one buffer) to fill `stream_bytes`.

  The variants take turns within each round (in reverse order every other round), so load
  from another process that comes and goes while the tuner runs falls on every variant
  alike, not on the one being timed then: timed one after another, a variant measured
  during a burst loses by the burst, and the loss is kept in the cache of choices."""
  variants_to_time = list(variants_to_time)
  args, copies = sweep_operands(M, K, N, dtype, pairs, stream_bytes)
  times: dict[str, list[float]] = {v: [] for v in variants_to_time}
  for r in range(repeats + 1):
    for v in (variants_to_time if r % 2 == 0 else variants_to_time[::-1]):
      t = _sweep(args(v))
      if t < 0:
        raise ValueError(f"time_variant: variant {v} or {np.dtype(dtype)} weights not built")
      if r:  # round 0 warms the caches, the page tables and the clock
        times[v].append(t)
  return {v: min(ts) / copies for v, ts in times.items()}


def time_variant(M: int, K: int, N: int, dtype, variant: str, repeats: int = 3,
                 stream_bytes: int = TUNE_STREAM_BYTES, pairs: bool = False) -> float:
  """Seconds of one product by `variant` alone (`time_variants` of one variant)."""
  return time_variants(M, K, N, dtype, [variant], repeats, stream_bytes, pairs)[variant]


def _tuning_path() -> Path:
  key = hashlib.sha256(str(_LIB["path"]).encode()).hexdigest()[:16]  # per build, so per CPU
  return native.cache_dir() / f"variants_{key}.json"


_CHOSEN: dict[str, str] = {}


def chosen_variant(M: int, K: int, N: int, dtype, pairs: bool = False) -> str:
  """The variant the kernel uses for M rows times [K, N] weights of `dtype` on this CPU:
  the override (SPEC_DECODE_CPU_KERNEL_VARIANT), else the fastest, measured once per CPU,
  weight shape and row count (`time_variants` at `tuning_rows(M)`: M itself for few rows,
  a power-of-two bucket's top above) and kept in the kernel cache. Every variant gives the
  same bits, so the choice changes only the time."""
  override = _variant_override()
  if override is not None:
    return override
  built = variants()
  rows = tuning_rows(M)
  name = f"{rows}x{K}x{N}:{np.dtype(dtype).name}{'_dot' if pairs else ''}"
  if not _CHOSEN:
    try:
      _CHOSEN.update(json.loads(_tuning_path().read_text()))
    except (OSError, ValueError):
      pass
  if _CHOSEN.get(name) not in built:
    timed = distinct_variants(rows, built)
    times = time_variants(rows, K, N, dtype, timed, pairs=pairs)
    _CHOSEN[name] = min(timed, key=times.__getitem__)
    _save_choices()
  return _CHOSEN[name]


def _save_choices():
  path = _tuning_path()
  try:
    merged = json.loads(path.read_text()) if path.exists() else {}
  except (OSError, ValueError):
    merged = {}
  merged.update(_CHOSEN)
  try:
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
      json.dump(merged, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except OSError as e:  # a read-only cache: keep the choices for this process only
    logging.warning("spec_decode: could not save kernel variant choices to %s (%s)", path, e)


_PACKED_AS: dict[str, int] = {}  # parameter trees packed in this process, by weight format


def note_packed(weights: str) -> None:
  """Records that a parameter tree was packed with `weights` ('float32', 'bfloat16', ...)."""
  _PACKED_AS[weights] = _PACKED_AS.get(weights, 0) + 1


def describe() -> dict[str, Any]:
  """The CPU and the kernel as decoding uses them: model, features, whether the kernel is
  on (or why not), the variants built, the variant chosen per weight shape so far and the
  weight formats parameter trees were packed in."""
  info = dict(cpu_info())
  reason = _register()
  info["kernel"] = "off: " + reason if reason else "on"
  if reason is None:
    info["widths"] = list(widths())
    info["bfloat16_dot"] = has_bfloat16_dot()
    info["variant_override"] = os.environ.get(ENV_VARIANT) or None
    info["chosen_variants"] = dict(sorted(_CHOSEN.items()))
    info["packed_weights"] = dict(sorted(_PACKED_AS.items()))
  return info


def thread_stats(reset: bool = False) -> dict[str, float]:
  """How the kernel's calls in this process split their weight panels between the calling
  thread and helpers from XLA's intra-op pool (one per other pool thread), since the last
  reset (reset=True zeroes the counters after reading): split_calls; helpers_per_call;
  helper_share, the fraction of the panels the helpers multiplied (0.5: an even split with
  one helper); helper_start_us, the mean delay from a call's start to the start of a
  helper that found work (the caller works alone meanwhile); helper_idle, the fraction of
  helpers that started after the work was gone; wait_us, the callers' mean wait for their
  helpers after their own share; call_us, the split calls' mean duration; helper_same_cpu,
  the fraction of helpers that found work and started on the CPU their caller was on when
  the call began (the two then share a core until the scheduler moves one). Calls below the
  split's size, or with one thread, are not counted; a helper still running when the
  counters are read is counted in the next reading."""
  out = (ctypes.c_double * 9)()
  _library().spec_decode_thread_stats(out, int(bool(reset)))
  calls, panels, helpers, helper_panels, working, start_ns, wait_ns, call_ns, same_cpu = out
  per = lambda total, n: total / n if n else 0.0
  return {"split_calls": int(calls), "helpers_per_call": per(helpers, calls),
          "helper_share": per(helper_panels, panels),
          "helper_start_us": per(start_ns, working) / 1e3,
          "helper_idle": per(helpers - working, helpers),
          "wait_us": per(wait_ns, calls) / 1e3, "call_us": per(call_ns, calls) / 1e3,
          "helper_same_cpu": per(same_cpu, working)}


def read_bandwidth(nbytes: int, *, threads: int = 0, passes: int = 5, repeats: int = 5
                   ) -> float:
  """GB/s of reading an `nbytes` buffer `passes` times with `threads` threads (0: one per
  core this process may use): the bound a weight-streaming step can reach. The highest of
  `repeats` readings: a capability, which load from elsewhere only lowers (one reading on a
  noisy 2-core AMD EPYC family 25 gave 12.8 GB/s where the others gave 25-27)."""
  threads = threads or len(os.sched_getaffinity(0))
  buf = np.ones(max(nbytes // 4, 1024), np.float32)
  _library().spec_decode_read_gbps(buf.ctypes.data, buf.nbytes, 1, threads)  # warm
  return max(float(_library().spec_decode_read_gbps(buf.ctypes.data, buf.nbytes, passes,
                                                    threads)) for _ in range(max(1, repeats)))


def fma_peak(width: int, *, threads: int = 0, iters: int = 20_000_000, repeats: int = 5
             ) -> float:
  """GFLOP/s of independent multiply-add chains of `width`-wide vectors on `threads`
  threads (0: one per core this process may use): the arithmetic bound, the highest of
  `repeats` readings (as `read_bandwidth`'s)."""
  threads = threads or len(os.sched_getaffinity(0))
  return max(float(_library().spec_decode_fma_gflops(width, iters, threads))
             for _ in range(max(1, repeats)))


def dot_peak(width: int, *, threads: int = 0, iters: int = 20_000_000, repeats: int = 5
             ) -> float | None:
  """GFLOP/s of independent bfloat16 dot-product chains (VDPBF16PS: two multiply-adds per
  lane) of `width`-wide float32 sums on `threads` threads, the highest of `repeats`
  readings: the arithmetic bound of the 'bfloat16_dot' weights. None where the kernel has no
  dot products (`has_bfloat16_dot`)."""
  threads = threads or len(os.sched_getaffinity(0))
  best = max(float(_library().spec_decode_dot_gflops(width, iters, threads))
             for _ in range(max(1, repeats)))
  return best if best > 0 else None


class PackCache:
  """Packed copies of a few parameter trees, keyed by the identity of their leaves.

  Decoders are called again and again with the same parameter objects; packing
  them once per tree (not once per call, inside jit) is what makes the panel
  layout free. Entries hold weak references to the original leaves and are
  dropped when those die or when more than `size` trees have been packed.
  """

  def __init__(self, size: int = 4):
    self._size = size
    self._entries: list[tuple[tuple[int, ...], list[Any], Any]] = []

  def made(self, tree) -> bool:
    """Whether `tree` is one of the packed trees this cache holds (so needs no packing)."""
    return any(packed is tree for _, _, packed in self._entries)

  def get(self, tree, make, tag: Any = None):
    """`make(tree)`, made once per tree (and `tag`: another packing of the same tree)."""
    leaves = jax.tree_util.tree_leaves(tree)
    key = (tag,) + tuple(id(leaf) for leaf in leaves)
    for i, (k, refs, packed) in enumerate(self._entries):
      if k == key and all(r() is leaf for r, leaf in zip(refs, leaves)):
        self._entries.append(self._entries.pop(i))
        return packed
    packed = make(tree)
    try:
      refs = [weakref.ref(leaf) for leaf in leaves]
    except TypeError:  # leaves that cannot be weakly referenced (numpy arrays): no caching
      return packed
    self._entries = [e for e in self._entries if all(r() is not None for r in e[1])]
    self._entries.append((key, refs, packed))
    del self._entries[:-self._size]
    return packed
