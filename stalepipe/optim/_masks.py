"""Named leaf selections, for rules that treat some leaves apart (basis rotation, Muon).

A config names a mask as data (`{"mask": "attention_mlp"}`); `mask(name)`
turns it into the callable optax takes (`params -> pytree of bools`). The
selection reads each leaf's path, so it picks the same leaves in a whole
model, in one pipeline stage's tree and in a `cut` stage's flat dict.
"""

from typing import Any

import jax
import jax.numpy as jnp

from stalepipe import registry

# Module names of the hidden linear layers: stalepipe's `transformer`
# (`qkv`, `proj`, `fc`, `out`) and those the basis-rotation code matches
# (`optim/optimizer.py` line 108 there: "attn", "mlp", "sa", "ffwd").
ATTENTION_MLP_MODULES = ("qkv", "proj", "fc", "out", "attn", "mlp", "sa",
                         "ffwd")
# What a linear layer calls its matrix: Flax `kernel`, PyTorch `weight`.
MATRIX_NAMES = ("kernel", "weight")


def _keys(path) -> list[str]:
  """A leaf's path as names; a flat dict's dotted keys split at the dots."""
  names = []
  for entry in path:
    name = getattr(entry, "key", getattr(entry, "name", getattr(
        entry, "idx", entry)))
    names.extend(str(name).split("."))
  return names


def all_matrices(params: Any) -> Any:
  """True on every 2-D leaf."""
  return jax.tree.map(lambda p: jnp.ndim(p) == 2, params)


def attention_mlp(params: Any) -> Any:
  """True on the matrices of attention and MLP linear layers, as the official code selects them.

  A leaf is selected when it is 2-D, its own name is `kernel` or `weight`,
  and a module on its path is named one of `ATTENTION_MLP_MODULES`. The
  token and position embeddings, the unembedding (head), norms and biases
  are not.

  Examples:
    >>> import jax.numpy as jnp
    >>> tree = {"blocks.0.qkv.kernel": jnp.ones((4, 12)),
    ...         "blocks.0.qkv.bias": jnp.ones(12),
    ...         "head": {"linear": {"kernel": jnp.ones((4, 9))}},
    ...         "embed": {"embedding": jnp.ones((9, 4))}}
    >>> attention_mlp(tree)["blocks.0.qkv.kernel"], attention_mlp(tree)["head"]
    (True, {'linear': {'kernel': False}})

  References:
    github.com/joonkyoo/basis-rotation, `optim/optimizer.py` lines 104-132:
    the `nn.Linear` weights of modules named "attn", "mlp", "sa" or "ffwd"
    are rotated; every other parameter goes to AdamW.
  """
  def one(path, p):
    names = _keys(path)
    return bool(jnp.ndim(p) == 2 and names and names[-1] in MATRIX_NAMES
                and any(n in ATTENTION_MLP_MODULES for n in names[:-1]))
  return jax.tree_util.tree_map_with_path(one, params)


MASKS = registry.Registry("mask", {
    "all_matrices": all_matrices,
    "attention_mlp": attention_mlp,
})


def mask(name_or_mask: Any) -> Any:
  """A mask as optax takes it: a name from `MASKS` becomes its function;
  None, a pytree of bools or a callable pass through.

  Examples:
    >>> mask("attention_mlp") is attention_mlp
    True
  """
  if isinstance(name_or_mask, str):
    return MASKS.factory(name_or_mask)
  return name_or_mask

