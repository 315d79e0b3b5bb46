"""Tests for the block models, the stage splitter and the losses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stalepipe import models
from stalepipe.models import losses
from stalepipe.models.cnn import VGG19
from stalepipe.models.resnet import RESNET152

VOCAB = 24  # = 3 * d_model: the unembedding shares the qkv kernel shape

# name -> (kwargs, input). Widths repeat so that few distinct parameter
# shapes exist: eagerly, each new shape compiles its initialiser (~1 s on CPU).
CASES = {
    "mlp": (dict(in_features=8, hidden=8, num_hidden_layers=3,
                 num_classes=8),
            np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)),
    "vgg": (dict(num_classes=8, image_size=8, in_channels=4,
                 stages=((4, 4), (4,)), dense=(8,)),
            np.random.default_rng(1).normal(size=(2, 8, 8, 4)
                                            ).astype(np.float32)),
    "resnet": (dict(num_classes=8, in_channels=4, stem_width=4,
                    widths=(4, 4), depths=(1, 1)),  # stride-2 projection
               np.random.default_rng(2).normal(size=(2, 8, 8, 4)
                                               ).astype(np.float32)),
    "transformer": (dict(vocab_size=VOCAB, d_model=8, num_heads=2,
                         num_layers=2, max_len=8),
                    np.random.default_rng(3).integers(0, VOCAB, (2, 6)
                                                      ).astype(np.int32)),
}


def _run_blocks(blocks, x):
  for block in blocks:
    x = block(x)
  return x


def _num_params(make_blocks):
  """Parameter count of the blocks `make_blocks()` builds, never allocated."""
  blocks = nnx.eval_shape(make_blocks)
  return sum(int(np.prod(p.shape)) for b in blocks
             for p in jax.tree.leaves(nnx.state(b, nnx.Param)))


@functools.cache
def _model(name):
  """The blocks of CASES[name] and their output, built once per test run."""
  kwargs, x = CASES[name]
  blocks = models.make(name, **kwargs)
  return blocks, _run_blocks(blocks, x)


def test_registry_lists_every_model():
  assert set(models.names()) == set(CASES)
  with pytest.raises(ValueError, match="unknown model"):
    models.make("alexnet")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_split_composes_to_the_unsplit_model(name, num_stages):
  x = CASES[name][1]
  blocks, want = _model(name)
  staged = models.split(blocks, num_stages)
  assert len(staged.stage_fns) == num_stages
  y = x
  for fn, params in zip(staged.stage_fns, staged.stage_params):
    y = fn(params, y)
  np.testing.assert_array_equal(y, want)
  np.testing.assert_array_equal(
      models.unpipelined(staged)(staged.stage_params, x), want)


def test_uneven_boundaries_compose_under_jit():
  x = CASES["transformer"][1]
  blocks, want = _model("transformer")
  staged = models.split(blocks, (0, 1, 3))
  got = jax.jit(models.unpipelined(staged))(staged.stage_params, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("boundaries", [
    (), (1, 2), (0, 0, 2), (0, 3, 2), (0, 4), (0, -1), 0, 5])
def test_split_rejects_bad_boundaries(boundaries):
  blocks = models.make("mlp", **CASES["mlp"][0])  # 4 blocks
  with pytest.raises(ValueError):
    models.split(blocks, boundaries)


def test_blocks_hold_parameters_only():
  for name in CASES:
    for block in _model(name)[0]:
      assert not jax.tree.leaves(nnx.state(block, nnx.Not(nnx.Param))), name


def test_vgg_param_count():
  stages, dense, c_in, n = ((3, 5), (7,), (2, 4, 6)), (9, 10), 2, 4
  num_params = _num_params(lambda: models.vgg(
      n, image_size=16, in_channels=c_in, stages=stages, dense=dense))
  want, c = 0, c_in
  for widths in stages:
    for w in widths:
      want += 9 * c * w + w
      c = w
  side = 16 // 2 // 2 // 2
  features = [side * side * c, *dense, n]
  want += sum((a + 1) * b for a, b in zip(features[:-1], features[1:]))
  assert num_params == want


@pytest.mark.parametrize("bottleneck", [False, True])
def test_resnet_param_count(bottleneck):
  stem, widths, depths, c_in, n = 8, (8, 16), (2, 2), 3, 5
  num_params = _num_params(lambda: models.resnet(
      n, in_channels=c_in, stem_width=stem, widths=widths, depths=depths,
      bottleneck=bottleneck))

  def conv_norm(k, a, b):
    return k * k * a * b + 2 * b

  want, c = conv_norm(3, c_in, stem), stem
  for i, (w, depth) in enumerate(zip(widths, depths)):
    for j in range(depth):
      if bottleneck:
        want += (conv_norm(1, c, w // 4) + conv_norm(3, w // 4, w // 4)
                 + conv_norm(1, w // 4, w))
      else:
        want += conv_norm(3, c, w) + conv_norm(3, w, w)
      if c != w or (i > 0 and j == 0):  # projection shortcut
        want += conv_norm(1, c, w)
      c = w
  want += (c + 1) * n
  assert num_params == want


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_transformer_param_count(positions):
  v, d, h, n, f, max_len = 13, 8, 2, 3, 20, 9
  num_params = _num_params(lambda: models.transformer(
      v, d_model=d, num_heads=h, num_layers=n, d_ff=f, max_len=max_len,
      positions=positions))
  attention = 2 * d + (d * 3 * d + 3 * d) + (d * d + d)
  mlp = 2 * d + (d * f + f) + (f * d + d)
  table = max_len * d if positions == "learned" else 0
  want = v * d + table + n * (attention + mlp) + 2 * d + d * v + v
  assert num_params == want


@pytest.mark.slow
def test_full_size_configs_match_published_param_counts():
  # Simonyan & Zisserman Table 2 (144M, exact count as in torchvision) and
  # He et al Table 1 / torchvision; HetPipe §8.3 quotes 548 MB and 230 MB.
  assert _num_params(lambda: models.vgg(
      1000, image_size=224, stages=VGG19, dense=(4096, 4096))) == 143_667_240
  assert _num_params(lambda: models.resnet(
      1000, stem_width=64, widths=(256, 512, 1024, 2048), depths=RESNET152,
      bottleneck=True, imagenet_stem=True)) == 60_192_808


def _np_layer_norm(x, scale, bias, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale + bias


def _np_gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_rotary(x, base=10_000.0):
  """RoFormer's rotation of features (i, i + K/2) at position l by l θ_i,
  one position and one frequency at a time."""
  out = x.copy()
  half = x.shape[-1] // 2
  for pos in range(x.shape[1]):
    for i in range(half):
      angle = pos * base ** (-2 * i / x.shape[-1])
      a, b = x[:, pos, :, i], x[:, pos, :, i + half]
      out[:, pos, :, i] = a * np.cos(angle) - b * np.sin(angle)
      out[:, pos, :, i + half] = b * np.cos(angle) + a * np.sin(angle)
  return out


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_decoder_block_matches_numpy(positions):
  kwargs = CASES["transformer"][0]
  d, h = kwargs["d_model"], kwargs["num_heads"]
  block = (_model("transformer")[0][1] if positions == "learned" else
           models.transformer(**kwargs, positions="rotary")[1])
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(block, nnx.Param)))
  # The shape of the embedded CASES tokens, so the block's ops are compiled.
  x = np.random.default_rng(5).normal(size=(2, 6, d)).astype(np.float32)
  length, dh = x.shape[1], d // h
  got = block(jnp.asarray(x))
  x = x.astype(np.float64)

  qkv = (_np_layer_norm(x, **p["ln_attn"]) @ p["qkv"]["kernel"]
         + p["qkv"]["bias"])
  heads = qkv.reshape(2, length, 3 * h, dh)
  q, k, v = heads[:, :, :h], heads[:, :, h:2 * h], heads[:, :, 2 * h:]
  if positions == "rotary":
    q, k = _np_rotary(q), _np_rotary(k)
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
  future = np.triu(np.ones((length, length), bool), 1)
  scores = np.where(future, -np.inf, scores)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  attended = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(2, length, d)
  x = x + attended @ p["proj"]["kernel"] + p["proj"]["bias"]
  hidden = _np_gelu(_np_layer_norm(x, **p["ln_mlp"]) @ p["fc"]["kernel"]
                    + p["fc"]["bias"])
  want = x + hidden @ p["out"]["kernel"] + p["out"]["bias"]

  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_transformer_is_causal():
  tokens = CASES["transformer"][1]
  blocks, logits = _model("transformer")
  t = 2
  changed = tokens.copy()
  changed[:, t:] = (changed[:, t:] + 1) % VOCAB
  new_logits = _run_blocks(blocks, changed)
  np.testing.assert_allclose(new_logits[:, :t], logits[:, :t], rtol=1e-6,
                             atol=1e-6)
  assert np.abs(new_logits[:, t:] - logits[:, t:]).max() > 1e-3


def _leaves(blocks):
  return [leaf for b in blocks
          for leaf in jax.tree.leaves(nnx.state(b, nnx.Param))]


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_fused_ends_are_the_same_model_in_num_layers_blocks(num_layers):
  kwargs = {**CASES["transformer"][0], "num_layers": num_layers}
  x = CASES["transformer"][1]
  blocks = models.transformer(**kwargs)
  fused = models.transformer(**kwargs, fuse_ends=True)
  assert len(fused) == num_layers == len(blocks) - 2
  for got, want in zip(_leaves(fused), _leaves(blocks), strict=True):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(_run_blocks(fused, x), _run_blocks(blocks, x),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_stages", [4, pytest.param(
    32, marks=pytest.mark.slow)])
def test_fused_ends_cut_into_one_decoder_layer_per_stage(num_stages):
  kwargs = {**CASES["transformer"][0], "num_layers": num_stages}
  x = CASES["transformer"][1]
  want = _run_blocks(models.transformer(**kwargs), x)
  staged = models.split(models.transformer(**kwargs, fuse_ends=True),
                        num_stages)
  assert staged.boundaries == tuple(range(num_stages))
  sizes = [sum(int(np.prod(a.shape)) for a in jax.tree.leaves(p))
           for p in staged.stage_params]
  decoder = sizes[1]  # the middle stages: one decoder layer each
  assert sizes[1:-1] == [decoder] * (num_stages - 2)
  assert sizes[0] > decoder and sizes[-1] > decoder
  got = jax.jit(models.unpipelined(staged))(staged.stage_params, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_computes_in_bfloat16_on_float32_weights():
  kwargs = CASES["transformer"][0]
  x, targets = CASES["transformer"][1], np.roll(CASES["transformer"][1], -1, 1)
  blocks = models.transformer(**kwargs, dtype="bfloat16")
  assert all(leaf.dtype == jnp.float32 for leaf in _leaves(blocks))
  staged = models.split(blocks, 2)
  hidden = jax.eval_shape(staged.stage_fns[0], staged.stage_params[0], x)
  assert hidden.dtype == jnp.bfloat16  # what crosses the stage boundary

  @jax.jit
  def loss_and_grads(params):
    def loss(params):
      logits = models.unpipelined(staged)(params, x)
      return losses.lm_cross_entropy(logits, targets), logits
    return jax.value_and_grad(loss, has_aux=True)(params)

  (loss, logits), grads = loss_and_grads(staged.stage_params)
  assert logits.dtype == loss.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  _, want = _model("transformer")  # the float32 model, same seed
  # bfloat16 keeps 8 significant bits: 0.4% per rounding, compounded over
  # four blocks whose random weights grow the residual stream 30-fold.
  np.testing.assert_allclose(logits, want, atol=0.1 * np.abs(want).max())
  np.testing.assert_allclose(loss, losses.lm_cross_entropy(want, targets),
                             rtol=0.01)
  assert np.abs(logits - want).max() > 0  # it did round


def test_bad_model_arguments_raise():
  with pytest.raises(ValueError, match="num_heads"):
    models.transformer(VOCAB, d_model=8, num_heads=3)
  with pytest.raises(ValueError, match="image_size"):
    models.vgg(image_size=4, stages=((4,), (4,), (4,)))
  with pytest.raises(ValueError, match="depths"):
    models.resnet(widths=(4, 8), depths=(1,))
  with pytest.raises(ValueError, match="positions='sinusoidal' is invalid"):
    models.transformer(VOCAB, d_model=8, num_heads=2, positions="sinusoidal")
  with pytest.raises(ValueError, match="an even head width"):
    models.transformer(VOCAB, d_model=6, num_heads=2, positions="rotary")
  with pytest.raises(ValueError, match="dtype='float16' is invalid"):
    models.transformer(VOCAB, d_model=8, num_heads=2, dtype="float16")
  with pytest.raises(ValueError, match="num_layers=0 is invalid"):
    models.transformer(VOCAB, d_model=8, num_heads=2, num_layers=0,
                       fuse_ends=True)
  blocks = models.transformer(VOCAB, d_model=8, num_heads=2, max_len=4)
  with pytest.raises(ValueError, match="sequence length 5"):
    blocks[0](jnp.zeros((1, 5), jnp.int32))


def test_cross_entropy_matches_numpy():
  rng = np.random.default_rng(6)
  logits = rng.normal(size=(4, 3, 5)).astype(np.float32)
  tokens = rng.integers(0, 5, (4, 3))
  log_z = np.log(np.exp(logits).sum(-1))
  picked = np.take_along_axis(logits, tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(losses.lm_cross_entropy(logits, tokens),
                             (log_z - picked).mean(), rtol=1e-5)
  np.testing.assert_allclose(
      losses.cross_entropy(logits[:, 0], tokens[:, 0]),
      (log_z[:, 0] - picked[:, 0]).mean(), rtol=1e-5)
  np.testing.assert_allclose(
      losses.mean_squared_error(logits, 2 * logits), (logits**2).mean(),
      rtol=1e-5)
  with pytest.raises(ValueError, match="labels"):
    losses.cross_entropy(logits, tokens)
