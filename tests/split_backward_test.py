"""The split backward (BI keeps op cotangents, BW only weight gradients)
against plain `jax.vjp`, and what the compiled BW computes."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.models.losses import lm_cross_entropy
from stalepipe.pipeline import executor
from stalepipe.pipeline import split_backward as split_lib

_KEY = jax.random.key(0)


def _normal(i, shape):
  return jax.random.normal(jax.random.fold_in(_KEY, i), shape)


def _mlp_stage():
  staged = sp.models.split(sp.models.mlp(8, 6, 3, 4, seed=1), 2)
  return (lambda p, x, t: staged.stage_fns[0](p, x), staged.stage_params[0],
          _normal(1, (3, 8)), None)


def _flax_stage():
  class Block(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.gelu(nn.LayerNorm()(nn.Dense(5)(x))) + x[:, :5]

  block = Block()
  x = _normal(2, (3, 7))
  params = block.init(jax.random.key(1), x)
  return lambda p, x, t: block.apply(p, x), params, x, None


def _last_stage():
  staged = sp.models.split(sp.models.mlp(8, 6, 3, 4, seed=2), 2)
  return (lambda p, x, t: cross_entropy(staged.stage_fns[1](p, x), t),
          staged.stage_params[1], _normal(3, (3, 6)), jnp.array([0, 3, 1]))


def _shared_weight():
  def f(p, x, t):
    del t
    h = jnp.tanh(x @ p["w"])
    return h @ p["w"].T + x * p["w"][0]  # w feeds three weight ops
  return f, {"w": _normal(4, (4, 4))}, _normal(5, (2, 4)), None


def _cast_weight():
  def f(p, x, t):
    del t
    w = p["w"].astype(jnp.bfloat16).astype(jnp.float32)
    gate = (x > p["w"][0]).astype(jnp.float32)  # boolean output: no cotangent
    return jnp.sin(x @ w) * gate
  return f, {"w": _normal(6, (4, 4))}, _normal(7, (2, 4)), None


def _token_ids():
  def f(p, x, t):
    del t
    return jnp.tanh(p["embed"][x] @ p["w"]).sum(-1)
  params = {"embed": _normal(8, (10, 4)), "w": _normal(9, (4, 3))}
  return f, params, jnp.array([[1, 2, 9], [0, 4, 4]], jnp.int32), None


def _transformer(stage):
  """`sp.models.transformer` in two stages: token ids, embedding, a decoder
  block (attention, LayerNorm, GELU); then a block and the LM loss."""
  staged = sp.models.split(sp.models.transformer(
      50, d_model=16, num_heads=2, num_layers=2, max_len=6), 2)
  ids = jax.random.randint(jax.random.fold_in(_KEY, 12), (2, 6), 0, 50)
  if stage == 0:
    return (lambda p, x, t: staged.stage_fns[0](p, x), staged.stage_params[0],
            ids, None)
  h = _normal(13, (2, 6, 16))
  return (lambda p, x, t: lm_cross_entropy(staged.stage_fns[1](p, x), t),
          staged.stage_params[1], h, ids)


_CASES = {"mlp": _mlp_stage, "flax": _flax_stage, "last_stage": _last_stage,
          "shared_weight": _shared_weight, "cast_weight": _cast_weight,
          "token_ids": _token_ids,
          "transformer_first": functools.partial(_transformer, 0),
          "transformer_last": functools.partial(_transformer, 1)}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n.startswith("transformer")
    else n for n in sorted(_CASES)])
def test_bi_and_bw_equal_jax_vjp(name):
  f, p, x, t = _CASES[name]()
  split = split_lib.analyse(f, p, x, t)
  assert split.weight_ops
  out, (pullback, kept) = jax.jit(
      lambda p, x, t: split_lib.forward(split, p, x, t))(p, x, t)
  want, vjp = jax.vjp(lambda p, x: f(p, x, t), p, x)
  cotangent = _normal(10, jnp.shape(want)).astype(jnp.result_type(want))
  g_x, op_cots = jax.jit(functools.partial(split_lib.input_gradient, split))(
      pullback, cotangent)
  g_p = jax.jit(lambda *a: split_lib.weight_gradient(split, *a))(
      p, x, t, kept, op_cots)
  want_p, want_x = vjp(cotangent)
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  for got, expected in zip(jax.tree.leaves(g_p), jax.tree.leaves(want_p),
                           strict=True):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  if jnp.issubdtype(x.dtype, jnp.integer):
    assert g_x.dtype == jax.dtypes.float0  # token ids: no cotangent
  else:
    np.testing.assert_allclose(g_x, want_x, rtol=1e-5, atol=1e-5)


def test_bw_keeps_only_what_it_reads():
  f, p, x, t = _mlp_stage()
  split = split_lib.analyse(f, p, x, t)
  # Two layers: x @ W1 (x is the input: not kept), + b1 (its input is not
  # read by BW), relu, @ W2 (its input kept), + b2.
  assert len(split.weight_ops) == 4
  assert [v.aval.shape for v in split.stored] == [(3, 6)]
  assert len(split.unread) == 2
  # A bias add passes its cotangent to the matmul before it: kept once.
  assert split.kept_index == (0, 0, 1, 1)
  f, p, x, t = _token_ids()
  split = split_lib.analyse(f, p, x, t)
  assert {v.aval.dtype for v in split.stored} >= {jnp.dtype(jnp.int32)}


def test_an_output_of_the_weights_alone_is_refused():
  with pytest.raises(ValueError, match="depends on the weights alone"):
    split_lib.analyse(lambda p, x, t: p * 2.0, jnp.ones(3), jnp.ones(3), None)


def _dots(compiled) -> int:
  return len(re.findall(r"\bdot\(", compiled.as_text()))


def test_compiled_bw_runs_only_the_weight_gradient_matmuls():
  """An N-layer MLP stage: BW runs N matmuls (x_l^T ybar_l); the weight
  gradient of the whole pullback (what BW called before the split) also
  re-derives the N-1 cotangent matmuls BI ran."""
  N = 5
  staged = sp.models.split(sp.models.mlp(8, 8, N - 1, 8, seed=3), 1)
  f = lambda p, x, t: staged.stage_fns[0](p, x)  # pylint: disable=unnecessary-lambda-assignment
  p, x = staged.stage_params[0], _normal(11, (2, 8))
  cotangent = jnp.ones((2, 8))
  split = split_lib.analyse(f, p, x, None)
  _, (pullback, kept) = split_lib.forward(split, p, x, None)
  _, op_cots = split_lib.input_gradient(split, pullback, cotangent)
  bw = jax.jit(lambda *a: split_lib.weight_gradient(split, *a)).lower(
      p, x, None, kept, op_cots).compile()
  _, whole = jax.vjp(lambda p, x: f(p, x, None), p, x)
  old_bw = jax.jit(lambda pullback, c: pullback(c)[0]).lower(
      whole, cotangent).compile()
  assert _dots(bw) == N
  assert _dots(old_bw) == 2 * N - 1


def test_split_zero_bubble_step_runs_the_matmuls_of_a_fused_backward():
  """Under remat="residuals", zb-h1's BI and BW together compile to as many
  matmuls as 1F1B's fused B: BW no longer re-derives BI's cotangents."""
  S, L, M = 2, 3, 2
  staged = sp.models.split(sp.models.mlp(8, 8, S * L - 1, 8), S)
  mesh = jax.make_mesh((1, S), ("data", "stage"))
  x, y = np.zeros((1, M, 2, 8), np.float32), np.zeros((1, M, 2), np.int32)
  dots = {}
  for name in ("1f1b", "zb-h1"):
    schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                                 num_minibatches=1)
    pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                             optax.sgd(0.1), mesh, remat="residuals")
    dots[name] = _dots(pipe.compile(pipe.init(staged.stage_params), x, y))
  assert dots["zb-h1"] == dots["1f1b"]
