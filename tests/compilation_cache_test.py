"""A window step loaded from JAX's persistent compilation cache trains what a
freshly compiled one does, bit for bit.

Runs resume (`launch.py` after a preemption, `runs/grid` workers, the
trainer's tests) with `jax_compilation_cache_dir` set, so the step they run is
the deserialized executable. With a `ppermute` under a `cond`, XLA:CPU's
deserialized executable paired the rows wrongly across devices (jax 0.10):
HetPipe + WSP filed each stage's own cotangent as an activation from window
two on, and PipeDream folded onto two devices trained other weights, where
the freshly compiled step matched the oracle. The standalone reproducer and
which forms fault: `experiments/cache_ppermute_cond_repro.py`,
docs/executor.md ("The persistent-cache fault, reproduced").
"""

import pathlib
import subprocess
import sys

import jax
from jax._src import compilation_cache
import numpy as np
import optax
import pytest

import stalepipe as sp
from stalepipe.models.losses import cross_entropy
from stalepipe.pipeline import executor


@pytest.fixture
def persistent_cache(tmp_path):
  """A fresh, empty persistent cache that stores every executable; the
  number of executables loaded from it, read through `hits()`."""
  old = (jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs)
  hits = []
  listener = lambda event, **_: hits.append(event)  # pylint: disable=unnecessary-lambda-assignment
  jax.monitoring.register_event_listener(listener)
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  yield lambda: hits.count("/jax/compilation_cache/cache_hits")
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
  compilation_cache.reset_cache()
  jax.monitoring.unregister_event_listener(listener)


def _run(name, D, P, S, sync, F=1, optimizer=lambda: optax.sgd(0.5),
         tick="auto"):
  """Three windows of a new Pipeline (so a new jitted step, which the
  persistent cache serves where it holds it): every leaf of the state. F >
  1: each stage sharded over 'fsdp' (its gathers and reduce-scatters)."""
  M = S if name == "1f1b" else 1 if name == "pipedream-v" else 2
  options = ({"num_devices": P} if sp.schedules.takes_num_devices(name)
             else {})
  schedule = sp.schedules.make(name, num_stages=S, num_microbatches=M,
                               num_minibatches=2, **options)
  staged = sp.models.split(sp.models.mlp(8, 6, S - 1, 4, seed=S), S)
  shape, axes = ((D, P, F), ("data", "stage", "fsdp")) if F > 1 else (
      (D, P), ("data", "stage"))
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:D * P * F])
  pipe = executor.Pipeline(staged.stage_fns, cross_entropy, schedule,
                           optimizer(), mesh,
                           sync=sync() if sync else None, tick=tick)
  state = pipe.init(staged.stage_params)
  rng = np.random.default_rng(0)
  for _ in range(3):
    x = rng.normal(size=(2, M, 2 * D * F, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=(2, M, 2 * D * F)).astype(np.int32)
    state, _ = pipe.step(state, x, y)
  return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


_CASES = {
    # S stages on P devices, D replicas
    "hetpipe_wsp": ("hetpipe", 2, 2, 2,
                    lambda: sp.sync.wsp(2, clock_distance=0,
                                        concurrent_minibatches=2)),
    "pipedream_folded": ("pipedream", 1, 2, 4, None),
    "pipedream_one_device": ("pipedream", 1, 1, 4, None),
    "1f1b_folded_replicas": ("1f1b", 2, 2, 4, None),
    # a task's all-gather and its gradient's reduce-scatter over 'fsdp'
    "pipedream_fsdp": ("pipedream", 1, 2, 4, None, 2),
    # the whole-model update's gathers over 'fsdp' and 'stage' (under the
    # update's cond)
    "1f1b_fsdp_model_scope": ("1f1b", 2, 2, 4, None, 2, lambda: optax.chain(
        optax.clip_by_global_norm(0.1), optax.adam(0.01))),
    # the lanes' tick (`lanes.py`): tagged rows sent along +1 and -1 on a V
    # placement, and along the loop with replicas
    "pipedream_v_lanes": ("pipedream-v", 1, 4, 8, None, 1,
                          lambda: optax.sgd(0.5), "lanes"),
    "interleaved_lanes_replicas": ("interleaved-1f1b", 2, 2, 4, None, 1,
                                   lambda: optax.sgd(0.5), "lanes"),
}


@pytest.mark.parametrize("case", [
    "pipedream_folded",
    pytest.param("hetpipe_wsp", marks=pytest.mark.slow),
    pytest.param("pipedream_one_device", marks=pytest.mark.slow),
    pytest.param("1f1b_folded_replicas", marks=pytest.mark.slow),
    pytest.param("pipedream_fsdp", marks=pytest.mark.slow),
    pytest.param("1f1b_fsdp_model_scope", marks=pytest.mark.slow),
    pytest.param("pipedream_v_lanes", marks=pytest.mark.slow),
    pytest.param("interleaved_lanes_replicas", marks=pytest.mark.slow)])
def test_step_from_the_persistent_cache_equals_a_fresh_compile(
    persistent_cache, case):
  fresh = _run(*_CASES[case])
  assert persistent_cache() == 0
  cached = _run(*_CASES[case])
  assert persistent_cache() > 0  # the second run's step came from the cache
  assert len(fresh) == len(cached)
  for a, b in zip(fresh, cached):
    np.testing.assert_array_equal(b, a)


@pytest.mark.slow
def test_sends_outside_any_branch_load_from_the_cache_bit_for_bit():
  """The form the executor relies on (every `ppermute` outside any cond, a
  partial and a cyclic permutation) loads from the persistent cache and
  computes what the fresh compile does, in the same process and in a new
  one (`experiments/cache_ppermute_cond_repro.py`, which prints OK or FAULT
  per form; the forms that fault on jax 0.10 are not asserted, as a later
  JAX may fix them). About 10-25 s on two cores."""
  script = pathlib.Path(__file__).parents[1] / "experiments" / (
      "cache_ppermute_cond_repro.py")
  forms = ("both_plain", "both_plain_full")
  out = subprocess.run(
      [sys.executable, str(script), "--forms", ",".join(forms),
       "--repeats", "3"], capture_output=True, text=True, timeout=300,
      check=True).stdout
  verdicts = {line.split()[1]: line.split()[0]
              for line in out.splitlines()[1:] if line.strip()}
  assert verdicts == {form: "OK" for form in forms}, out
