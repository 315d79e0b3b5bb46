"""A decoder-only Transformer language model as a sequence of blocks.

Blocks: an embedding block (token plus learned position embeddings, as GPT-2),
`num_layers` pre-LN causal self-attention + MLP blocks, and a final LN +
unembedding block. The unembedding is not tied to the token embedding: tied
weights would be one parameter shared by the first and last pipeline stage.
With `fuse_ends=True` the embedding rides in the first decoder block and the
unembedding in the last, so the model is `num_layers` blocks and cuts into
as many stages of one decoder layer each.

With `dtype="bfloat16"` the parameters stay float32 (the optimizer updates
master weights) while the embeddings, attention and MLP compute in bfloat16
(attention's softmax and LayerNorm's statistics in float32); the final LN and
the unembedding compute in float32, so the logits and the loss are float32.

References:
  Vaswani et al, Attention Is All You Need <https://arxiv.org/abs/1706.03762>,
  2017 (§3.2, §3.3). Radford et al, Language Models are Unsupervised Multitask
  Learners, 2019 (§2.3: pre-LN, final LN, learned positions).
"""

import jax
import jax.numpy as jnp
from flax import nnx

DTYPES = ("float32", "bfloat16")  # compute dtypes; parameters are float32


class Embedding(nnx.Module):
  """Token ids [b, L] -> `E[tokens] + P[:L]`, [b, L, d]."""

  def __init__(self, vocab_size: int, d_model: int, max_len: int, *,
               dtype: str = "float32", rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.tokens = nnx.Embed(vocab_size, d_model, dtype=dtype,
                            embedding_init=init, rngs=rngs)
    self.positions = nnx.Param(init(rngs.params(), (max_len, d_model)))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    length = tokens.shape[1]
    if length > self.positions.shape[0]:
      raise ValueError(f"sequence length {length} is invalid; valid: at most "
                       f"max_len={self.positions.shape[0]}")
    # Executors may carry activations in a float buffer; ids are exact there.
    x_BxLxD = self.tokens(tokens.astype(jnp.int32))
    return x_BxLxD + self.positions[:length].astype(x_BxLxD.dtype)


class DecoderBlock(nnx.Module):
  """`x + Attn(LN(x))`, then `x + MLP(LN(x))`: [b, L, d] -> [b, L, d].

  Attention is causal: position `i` attends to positions `j <= i` only,

  .. math::
    \\mathrm{Attn}(Q, K, V) = \\mathrm{softmax}\\big(QK^\\top / \\sqrt{d_h}
    + M\\big) V, \\quad M_{ij} = -\\infty \\text{ for } j > i,

  per head, and the MLP is `gelu(x W_1 + b_1) W_2 + b_2` of width `d_ff`.
  """

  def __init__(self, d_model: int, num_heads: int, d_ff: int, *,
               dtype: str = "float32", rngs: nnx.Rngs):
    self.num_heads = num_heads
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
                max_len: int = 128, fuse_ends: bool = False,
                dtype: str = "float32", seed: int = 0) -> list[nnx.Module]:
  """A causal Transformer LM: int32 tokens [b, L] -> logits [b, L, vocab].

  With `V = vocab_size`, `d = d_model`, `f = d_ff` (default `4 d`) and `n`
  layers, the parameter count is

  .. math::
    (V + L_{max}) d + n (4 d^2 + 2 d f + f + 9 d) + 2 d + (d + 1) V.

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
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r} is invalid; valid: "
                     f"{', '.join(DTYPES)}")
  if fuse_ends and num_layers < 1:
    raise ValueError(f"num_layers={num_layers} is invalid with fuse_ends; "
                     "valid: >= 1")
  d_ff = 4 * d_model if d_ff is None else d_ff
  rngs = nnx.Rngs(seed)
  blocks = [Embedding(vocab_size, d_model, max_len, dtype=dtype, rngs=rngs),
            *(DecoderBlock(d_model, num_heads, d_ff, dtype=dtype, rngs=rngs)
              for _ in range(num_layers)),
            Unembedding(d_model, vocab_size, rngs=rngs)]
  if not fuse_ends:
    return blocks
  if num_layers == 1:
    return [nnx.Sequential(*blocks)]
  return [nnx.Sequential(*blocks[:2]), *blocks[2:-2],
          nnx.Sequential(*blocks[-2:])]
