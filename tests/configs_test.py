"""Every config in configs/ builds, names valid parts, and runs two steps."""

import pathlib
import pickle
import re
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import common  # pylint: disable=g-import-not-at-top
from configs import default  # pylint: disable=g-import-not-at-top
from stalepipe import data  # pylint: disable=g-import-not-at-top
from stalepipe import models  # pylint: disable=g-import-not-at-top
from stalepipe.models import losses  # pylint: disable=g-import-not-at-top
from stalepipe import schedules  # pylint: disable=g-import-not-at-top
from stalepipe import sync  # pylint: disable=g-import-not-at-top
from stalepipe.train import input_pipeline  # noqa: E402
from stalepipe.train import optimizers  # pylint: disable=g-import-not-at-top
from stalepipe.train import trainer  # pylint: disable=g-import-not-at-top
from stalepipe.train import validate  # pylint: disable=g-import-not-at-top

METHODS = ("gpipe", "1f1b", "pipedream", "2bw", "hetpipe_wsp", "timeprest",
           "sapipe", "pipesgd", "sdpipe", "bsp", "zb_h1", "zb_h2", "zb_async",
           "pipedream_dc", "spectrain", "pipemare", "interleaved_1f1b", "zb_v",
           "dualpipev", "pipedream_v")
CONFIG_FILES = sorted(p.name for p in (ROOT / "configs").glob("*.py")
                      if p.name not in ("common.py", "rules.py"))


def get_config(filename, arg=None):
  return runpy.run_path(str(ROOT / "configs" / filename))["get_config"](arg)


def test_one_config_file_per_method():
  assert sorted(CONFIG_FILES) == sorted(f"{m}.py" for m in METHODS + (
      "default",))


@pytest.mark.parametrize("filename", CONFIG_FILES)
def test_config_names_valid_parts(filename):
  config = get_config(filename)
  assert config.schedule in schedules.names()
  assert config.sync in sync.names()
  assert config.model in models.names()
  assert config.dataset in data.names()
  assert config.loss in losses.names()
  optimizers.make(config.transforms, config.optimizer, config.optimizer_kwargs,
                  num_replicas=config.num_replicas)
  assert config.num_replicas * validate.stage_devices(config) <= 8
  # The module docstring holds the exact command that runs it.
  doc = runpy.run_path(str(ROOT / "configs" / filename))["__doc__"]
  assert f"--config=configs/{filename}" in doc


@pytest.mark.parametrize("filename", CONFIG_FILES)
def test_method_configs_override_default_not_copy_it(filename):
  text = (ROOT / "configs" / filename).read_text()
  if filename != "default.py":  # builds on default.py or another method's
    assert re.search(r"from configs import \w+", text)
    assert re.search(r"\w+\.get_config\(", text)
    assert len(text.splitlines()) < 40


@pytest.mark.slow
@pytest.mark.parametrize("filename", CONFIG_FILES)
def test_every_config_runs_two_steps(tmp_path, filename):
  config = get_config(filename)
  config.minibatches_per_window, config.num_steps = 1, 2
  config.eval_every, config.plots = 0, False
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  assert summary["steps"] == 2
  assert 0.0 <= summary["test_accuracy"] <= 1.0


@pytest.mark.parametrize("variant", list(default.VARIANTS))
def test_every_variant_builds_its_model_for_its_data(variant, tmp_path):
  config = default.get_config(f"variant={variant}")
  kwargs = dict(config.dataset_kwargs)
  if config.dataset == "cifar10":
    kwargs["data_dir"] = write_cifar10(tmp_path, images_per_batch=2)
  if config.dataset == "chars":
    kwargs["text"] = "abcdefghij" * 400
  if config.dataset == "stdlib":
    kwargs["cache_dir"] = str(tmp_path)
  ds = input_pipeline.load(config.dataset, kwargs, 0, config.num_replicas,
                           config.input_shape)
  blocks = nnx.eval_shape(lambda: models.make(  # shapes only: fast
      config.model, **config.model_kwargs,
      **models.data_kwargs(config.model, ds.x_test[0], ds.num_classes)))
  staged = models.split(blocks, 1)
  y = jax.eval_shape(staged.stage_fns[0], staged.stage_params[0],
                     ds.x_test[:2])
  assert y.shape == ds.y_test[:2].shape + (ds.num_classes,)
  assert len(blocks) >= config.num_stages


def write_cifar10(directory, images_per_batch):
  """Five training batches and a test batch in CIFAR-10's pickle format."""
  rng = np.random.default_rng(0)
  names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
  for name in names:
    batch = {b"data": rng.integers(0, 256, (images_per_batch, 3072),
                                   dtype=np.uint8),
             b"labels": rng.integers(0, 10, images_per_batch).tolist()}
    with open(directory / name, "wb") as f:
      pickle.dump(batch, f)
  return str(directory)


@pytest.mark.slow
def test_cifar10_variant_trains_from_a_local_directory(tmp_path):
  config = default.get_config("variant=vgg_cifar10")
  config.dataset_kwargs.data_dir = write_cifar10(tmp_path, images_per_batch=40)
  config.model_kwargs.stages = ((8,), (8,))
  config.model_kwargs.dense = (16,)
  config.minibatches_per_window, config.num_steps = 1, 2
  config.microbatch_size, config.eval_every, config.plots = 2, 0, False
  summary = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["steps"] == 2


@pytest.mark.parametrize("arg,want", [
    (None, {"variant": "mlp_digits", "steps": 0, "fast": False}),
    ("vgg_digits", {"variant": "vgg_digits", "steps": 0, "fast": False}),
    ("steps=8,fast=True", {"variant": "mlp_digits", "steps": 8, "fast": True}),
])
def test_parse_arg(arg, want):
  got = common.parse_arg(arg, variant="mlp_digits", steps=0, fast=False)
  assert got.to_dict() == want


@pytest.mark.parametrize("arg", ["size=3", "fast=maybe"])
def test_parse_arg_rejects_bad_input(arg):
  with pytest.raises(ValueError, match="config argument"):
    common.parse_arg(arg, variant="mlp_digits", fast=False)


def test_unknown_variant_is_rejected():
  with pytest.raises(ValueError, match="variant 'nope' is invalid; valid: "):
    default.get_config("variant=nope")


def test_transform_chain_matches_numpy_stale_sgd():
  """stale_gradients(1) before sgd: x_{t+1} = x_t - lr g(x_{t-1}), g = 2x."""
  opt = optimizers.make((("stale_gradients", {"delay": 1}),), "sgd",
                        {"learning_rate": 0.1})
  x = jnp.array([1.0, -2.0])
  state = opt.init(x)
  history = [np.array([1.0, -2.0])]
  for _ in range(4):
    updates, state = opt.update(2 * x, state, x)
    x = optax.apply_updates(x, updates)
    history.append(np.asarray(x))
  want = [np.array([1.0, -2.0])] * 2
  for _ in range(3):
    want.append(want[-1] - 0.1 * 2 * want[-2])
  np.testing.assert_allclose(np.stack(history), np.stack(want), rtol=1e-6)


def test_transform_chain_passes_stale_params_to_delay_compensation():
  lam, lr = 0.5, 0.1
  opt = optimizers.make((("delay_compensation", {"lam": lam}),), "sgd",
                        {"learning_rate": lr})
  x, stale, g = jnp.array([1.0, 2.0]), jnp.array([0.5, 1.0]), jnp.array(
      [0.3, -0.4])
  updates, _ = opt.update(g, opt.init(x), x, stale_params=stale)
  g_np, dx = np.asarray(g), np.asarray(x - stale)
  want = -lr * (g_np + lam * g_np**2 * dx)
  np.testing.assert_allclose(updates, want, rtol=1e-6)


@pytest.mark.parametrize("transforms,optimizer,match", [
    ((("nope", {}),), "sgd", "unknown transform 'nope'; valid: "),
    ((), "nope", "unknown optimizer 'nope'; valid: "),
    ((("stale_gradients",),), "sgd", "is invalid; valid: a \\(name, kwargs\\)"),
])
def test_bad_optimizer_config_is_rejected(transforms, optimizer, match):
  with pytest.raises(ValueError, match=match):
    optimizers.make(transforms, optimizer, {"learning_rate": 0.1})


def test_jax_sees_eight_devices():
  assert jax.device_count() == 8
