"""A decoder-only Transformer language model as a sequence of blocks.

Blocks: an embedding block (token plus learned position embeddings, as GPT-2;
with `positions="rotary"` tokens only, the attention rotating its queries and
keys instead), `num_layers` pre-LN causal self-attention + MLP blocks, and a
final LN + unembedding block. The unembedding is not tied to the token
embedding: tied weights would be one parameter shared by the first and last
pipeline stage. With `fuse_ends=True` the embedding rides in the first
decoder block and the unembedding in the last, so the model is `num_layers`
blocks and cuts into as many stages of one decoder layer each.

With `dtype="bfloat16"` the parameters stay float32 (the optimizer updates
master weights) while the embeddings, attention and MLP compute in bfloat16
(attention's softmax and LayerNorm's statistics in float32); the final LN and
the unembedding compute in float32, so the logits and the loss are float32.

References:
  Vaswani et al, Attention Is All You Need <https://arxiv.org/abs/1706.03762>,
  2017 (§3.2, §3.3). Radford et al, Language Models are Unsupervised Multitask
  Learners, 2019 (§2.3: pre-LN, final LN, learned positions). Su et al,
  RoFormer: Enhanced Transformer with Rotary Position Embedding
  <https://arxiv.org/abs/2104.09864>, 2021 (§3.4.2).
"""

import jax
import jax.numpy as jnp
from flax import nnx

DTYPES = ("float32", "bfloat16")  # compute dtypes; parameters are float32
POSITIONS = ("learned", "rotary")


def rotary(x_BxLxHxK: jax.Array, base: float = 10_000.0) -> jax.Array:
  """Rotary position embedding of queries or keys [b, L, heads, K].

  At position `l`, features `i` and `i + K/2` of each head turn by the angle
  `l θ_i` (the half-split pairing of GPT-NeoX), so that a query-key product
  depends on the positions only through their difference:

  .. math::
    \\theta_i = \\mathrm{base}^{-2i/K}, \\quad
    x'_i = x_i \\cos l\\theta_i - x_{i+K/2} \\sin l\\theta_i, \\quad
    x'_{i+K/2} = x_{i+K/2} \\cos l\\theta_i + x_i \\sin l\\theta_i.

  The angles are float32; the result has the dtype of `x`.
  """
  half = x_BxLxHxK.shape[-1] // 2
  theta = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  position = jnp.arange(x_BxLxHxK.shape[1], dtype=jnp.float32)
  angle = position[:, None, None] * theta  # [L, 1, K/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         axis=-1).astype(x_BxLxHxK.dtype)


class Embedding(nnx.Module):
  """Token ids [b, L] -> `E[tokens] + P[:L]` (learned positions) or
  `E[tokens]` (rotary: the attention adds them), [b, L, d]."""

  def __init__(self, vocab_size: int, d_model: int, max_len: int, *,
               learned_positions: bool = True, dtype: str = "float32",
               rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.max_len = max_len
    self.tokens = nnx.Embed(vocab_size, d_model, dtype=dtype,
                            embedding_init=init, rngs=rngs)
    self.positions = (nnx.Param(init(rngs.params(), (max_len, d_model)))
                      if learned_positions else None)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    length = tokens.shape[1]
    if length > self.max_len:
      raise ValueError(f"sequence length {length} is invalid; valid: at most "
                       f"max_len={self.max_len}")
    # Executors may carry activations in a float buffer; ids are exact there.
    x_BxLxD = self.tokens(tokens.astype(jnp.int32))
    if self.positions is None:
      return x_BxLxD
    return x_BxLxD + self.positions[:length].astype(x_BxLxD.dtype)


class DecoderBlock(nnx.Module):
  """`x + Attn(LN(x))`, then `x + MLP(LN(x))`: [b, L, d] -> [b, L, d].

  Attention is causal: position `i` attends to positions `j <= i` only,

  .. math::
    \\mathrm{Attn}(Q, K, V) = \\mathrm{softmax}\\big(QK^\\top / \\sqrt{d_h}
    + M\\big) V, \\quad M_{ij} = -\\infty \\text{ for } j > i,

  per head (with `rotary_positions`, `Q` and `K` each through `rotary`), and
  the MLP is `gelu(x W_1 + b_1) W_2 + b_2` of width `d_ff`.
  """

  def __init__(self, d_model: int, num_heads: int, d_ff: int, *,
               rotary_positions: bool = False, dtype: str = "float32",
               rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.rotary_positions = rotary_positions
    self.ln_attn = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.qkv = nnx.Linear(d_model, 3 * d_model, dtype=dtype, rngs=rngs)
    self.proj = nnx.Linear(d_model, d_model, dtype=dtype, rngs=rngs)
    self.ln_mlp = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.fc = nnx.Linear(d_model, d_ff, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(d_ff, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    b, length, d = x_BxLxD.shape
    qkv = self.qkv(self.ln_attn(x_BxLxD))
    q, k, v = jnp.split(
        qkv.reshape(b, length, 3 * self.num_heads, d // self.num_heads), 3,
        axis=2)
    if self.rotary_positions:
      q, k = rotary(q), rotary(k)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x_BxLxD = x_BxLxD + self.proj(attended.reshape(b, length, d))
    return x_BxLxD + self.out(nnx.gelu(self.fc(self.ln_mlp(x_BxLxD))))


class Unembedding(nnx.Module):
  """`LN(x) W + b`: [b, L, d] -> float32 logits [b, L, vocab], computed in
  float32 whatever the dtype of `x`."""

  def __init__(self, d_model: int, vocab_size: int, *, rngs: nnx.Rngs):
    self.ln = nnx.LayerNorm(d_model, rngs=rngs)
    self.linear = nnx.Linear(d_model, vocab_size, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.linear(self.ln(x.astype(jnp.float32)))


def transformer(vocab_size: int, *, d_model: int = 64, num_heads: int = 4,
                num_layers: int = 2, d_ff: int | None = None,
                max_len: int = 128, positions: str = "learned",
                fuse_ends: bool = False, dtype: str = "float32",
                seed: int = 0) -> list[nnx.Module]:
  """A causal Transformer LM: int32 tokens [b, L] -> logits [b, L, vocab].

  With `V = vocab_size`, `d = d_model`, `f = d_ff` (default `4 d`) and `n`
  layers, the parameter count is

  .. math::
    (V + L_{max}) d + n (4 d^2 + 2 d f + f + 9 d) + 2 d + (d + 1) V

  (without the `L_max d` of the position table for rotary positions).

  `transformer(50257, d_model=768, num_heads=12, num_layers=12, max_len=1024)`
  is GPT-2 small with an untied, biased unembedding: 163,087,441 parameters,
  GPT-2's 124,439,808 plus this block's `(d + 1) V`.

  Args:
    vocab_size: number of token ids.
    d_model: width of the residual stream.
    num_heads: attention heads; must divide `d_model`.
    num_layers: decoder blocks.
    d_ff: width of the MLP; `4 * d_model` when None.
    max_len: longest sequence (rows of the position embedding).
    positions: "learned" (a position embedding added to the tokens') or
      "rotary" (queries and keys rotated in every attention; `rotary`), one
      of `POSITIONS`. Rotary needs an even head width `d_model / num_heads`
      and has no `L_max d` position parameters.
    fuse_ends: fold the embedding into the first decoder block and the final
      LN + unembedding into the last (`nnx.Sequential`s), so that
      `num_layers` stages hold one decoder layer each.
    dtype: compute dtype, one of `DTYPES`; parameters are float32 and the
      logits float32 either way.
    seed: parameter initialisation seed.

  Returns:
    `num_layers + 2` blocks, or `num_layers` with `fuse_ends`. The parameters
    are the same for either `fuse_ends`, and so is the function.

  References:
    Vaswani et al, Attention Is All You Need
    <https://arxiv.org/abs/1706.03762>, 2017 (§3.2.1, §3.3). Radford et al,
    Language Models are Unsupervised Multitask Learners, 2019 (§2.3).

  Examples:
    >>> import jax.numpy as jnp
    >>> blocks = transformer(50, d_model=16, num_heads=2, num_layers=1)
    >>> x = jnp.zeros((2, 7), jnp.int32)
    >>> for block in blocks:
    ...   x = block(x)
    >>> x.shape
    (2, 7, 50)
  """
  if d_model % num_heads:
    raise ValueError(f"num_heads={num_heads} is invalid for d_model="
                     f"{d_model}; valid: a divisor of {d_model}")
  if positions not in POSITIONS:
    raise ValueError(f"positions={positions!r} is invalid; valid: "
                     f"{', '.join(POSITIONS)}")
  if positions == "rotary" and (d_model // num_heads) % 2:
    raise ValueError(f"d_model={d_model}, num_heads={num_heads} are invalid "
                     "with rotary positions; valid: an even head width "
                     "d_model / num_heads")
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r} is invalid; valid: "
                     f"{', '.join(DTYPES)}")
  if fuse_ends and num_layers < 1:
    raise ValueError(f"num_layers={num_layers} is invalid with fuse_ends; "
                     "valid: >= 1")
  d_ff = 4 * d_model if d_ff is None else d_ff
  rngs = nnx.Rngs(seed)
  rotary_positions = positions == "rotary"
  blocks = [Embedding(vocab_size, d_model, max_len,
                      learned_positions=not rotary_positions, dtype=dtype,
                      rngs=rngs),
            *(DecoderBlock(d_model, num_heads, d_ff,
                           rotary_positions=rotary_positions, dtype=dtype,
                           rngs=rngs)
              for _ in range(num_layers)),
            Unembedding(d_model, vocab_size, rngs=rngs)]
  if not fuse_ends:
    return blocks
  if num_layers == 1:
    return [nnx.Sequential(*blocks)]
  return [nnx.Sequential(*blocks[:2]), *blocks[2:-2],
          nnx.Sequential(*blocks[-2:])]
