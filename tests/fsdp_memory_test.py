"""experiments/fsdp_memory.py's count of collectives, on a tiny program
whose collectives' places, mesh axes and bytes are known."""

import pathlib
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import fsdp_memory  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_collectives_are_found_where_they_run_with_their_axes_and_bytes():
  mesh = jax.make_mesh((1, 2, 2), ("data", "stage", "fsdp"),
                       devices=jax.devices()[:4])

  def body(x, _):
    gathered = jax.lax.all_gather(x, "fsdp")  # f32[2, 4]: 32 B
    moved = jax.lax.ppermute(x, "stage", [(0, 1)])  # f32[4]: 16 B
    summed = jax.lax.cond(x.sum() > 0, lambda v: jax.lax.psum(v, "fsdp"),
                          lambda v: v, x)
    return gathered.sum(0) + moved + summed, None

  def program(x):
    x, _ = jax.lax.scan(body, x, None, length=3)
    return jax.lax.psum(x, "stage")

  fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P("fsdp"),
                             out_specs=P("fsdp"), check_vma=False))
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("fsdp")))
  hlo = fn.lower(x).compile().as_text()
  table = fsdp_memory.per_place(fsdp_memory.collectives(hlo, mesh))
  assert table["tick"]["all-gather"] == {"fsdp": [1, 32]}
  assert table["tick"]["collective-permute"] == {"stage": [1, 16]}
  assert table["tick, under a conditional"]["all-reduce"] == {"fsdp": [1, 16]}
  assert table["outside the loop"]["all-reduce"] == {"stage": [1, 16]}
  assert not table["tick"]["all-reduce"]
  assert not table["tick"]["reduce-scatter"]
