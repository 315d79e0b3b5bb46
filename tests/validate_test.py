"""Every bad config value is refused up front, in one line naming the key,
the value and what is valid; good configs pass."""

import pathlib
import runpy
import sys

import ml_collections
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import default  # pylint: disable=g-import-not-at-top
from stalepipe import schedules  # pylint: disable=g-import-not-at-top
from stalepipe.train import validate  # pylint: disable=g-import-not-at-top

CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py")
                 if p.stem not in ("common", "rules", "__init__"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_passes(name):
  module = __import__(f"configs.{name}", fromlist=["get_config"])
  validate.check(module.get_config())


def _set(config, key, value):
  *parents, last = key.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[last] = value


# (overrides, the message's start): the cases first, then more.
BAD = [
    ({"num_stages": 0}, "num_stages=0 is invalid; valid: an integer >= 1"),
    ({"num_stages": -1}, "num_stages=-1 is invalid; valid: an integer >= 1"),
    ({"num_replicas": 0}, "num_replicas=0 is invalid; valid: an integer >= 1"),
    ({"num_replicas": -1},
     "num_replicas=-1 is invalid; valid: an integer >= 1"),
    ({"microbatch_size": 0},
     "microbatch_size=0 is invalid; valid: an integer >= 1"),
    ({"microbatch_size": -3},
     "microbatch_size=-3 is invalid; valid: an integer >= 1"),
    ({"log_every": 0}, "log_every=0 is invalid; valid: an integer >= 1"),
    ({"model_kwargs.hidden": 0}, "model_kwargs.hidden=0 is invalid; valid: "
     "positive integers"),
    ({"model_kwargs.hidden": -8}, "model_kwargs.hidden=-8 is invalid"),
    ({"optimizer": "softmax_cross_entropy"},
     "optimizer='softmax_cross_entropy' is invalid; valid: an optax "
     "optimizer: adabelief, "),
    ({"sync": "wsp"}, "sync_kwargs.clock_distance is missing: sync policy "
     "'wsp' needs it; valid: an integer >= 0"),
    ({"transforms": (("stale_gradients", {"delay": 1, "dealy": 2}),)},
     "transforms[0] stale_gradients.dealy=2 is invalid: transform "
     "'stale_gradients' takes no 'dealy'; valid keys: delay"),
    ({"dataset": "cifar10",
      "dataset_kwargs": ml_collections.ConfigDict(
          {"data_dir": "/nonexistent/cifar"})},
     "dataset_kwargs.data_dir='/nonexistent/cifar' is invalid; valid: an "
     "existing directory"),
    ({"optimizer_kwargs.learning_rate": -1.0},
     "optimizer_kwargs.learning_rate=-1.0 is invalid; valid: a number > 0"),
    ({"transforms": (("delay_compensation", {"lam": -1.0}),)},
     "transforms[0] delay_compensation.lam=-1.0 is invalid; valid: a number "
     ">= 0"),
    ({"eval_every": -1}, "eval_every=-1 is invalid; valid: an integer >= 0"),
    ({"checkpoint_every": -1},
     "checkpoint_every=-1 is invalid; valid: an integer >= 0"),
    ({"seed": -1}, "seed=-1 is invalid; valid: an integer in [0, 2**32)"),
    ({"minibatches_per_window": 0},
     "minibatches_per_window=0 is invalid; valid: an integer >= 1"),
    ({"schedule_kwargs": ml_collections.ConfigDict({"foo": 1})},
     "schedule_kwargs.foo=1 is invalid: schedule 'gpipe' takes no 'foo'; "
     "valid keys: none"),
    # More of the same kinds.
    ({"num_steps": 0}, "num_steps=0 is invalid; valid: an integer >= 1"),
    ({"num_steps": 6}, "num_steps=6 is invalid; valid: a positive multiple "
     "of minibatches_per_window=4"),
    ({"num_microbatches": 0},
     "num_microbatches=0 is invalid; valid: an integer >= 1"),
    ({"keep_checkpoints": 0},
     "keep_checkpoints=0 is invalid; valid: an integer >= 1"),
    ({"schedule": "gpipe2"}, "schedule='gpipe2' is invalid; valid: gpipe, "),
    ({"schedule": "hetpipe", "schedule_kwargs": ml_collections.ConfigDict(
        {"concurrent_minibatches": 0})},
     "schedule_kwargs.concurrent_minibatches=0 is invalid; valid: an integer "
     ">= 1"),
    ({"sync": "wsp", "sync_kwargs": ml_collections.ConfigDict(
        {"clock_distance": -1})},
     "sync_kwargs.clock_distance=-1 is invalid; valid: an integer >= 0"),
    ({"sync": "local_sgd"}, "sync_kwargs.period is missing"),
    ({"sync": "sdpipe", "sync_kwargs": ml_collections.ConfigDict(
        {"grouping": "arrival"})},
     "sync_kwargs.grouping='arrival' is invalid; valid: 'iteration' (a run "
     "trains on the lockstep executor; 'arrival' is the simulator's only)"),
    ({"sync": "gossip"}, "sync='gossip' is invalid; valid: bsp, "),
    ({"transforms": (("stale_gradients", {"delay": -1}),)},
     "transforms[0] stale_gradients.delay=-1 is invalid; valid: an integer "
     ">= 0"),
    ({"transforms": (("no_such_rule", {}),)},
     "transforms[0] name='no_such_rule' is invalid; valid: "),
    ({"transforms": (("stale_gradients",),)},
     "transforms[0]=('stale_gradients',) is invalid; valid: a (name, kwargs) "
     "pair"),
    ({"transforms": (("delay_compensation", {"lam": 0.1, "form": "half"}),)},
     "transforms[0] delay_compensation.form='half' is invalid; valid: "
     "'diagonal' or 'full'"),
    ({"optimizer": "adamm"}, "optimizer='adamm' is invalid"),
    ({"optimizer_kwargs.learning_rate": 0.0},
     "optimizer_kwargs.learning_rate=0.0 is invalid; valid: a number > 0"),
    ({"optimizer_kwargs": ml_collections.ConfigDict(
        {"learning_rate": 1e-3, "beta1": 0.9})},
     "optimizer_kwargs.beta1=0.9 is invalid: optimizer 'adam' takes no 'beta1'; "
     "valid keys: learning_rate, b1, b2,"),
    ({"dataset": "mnist"}, "dataset='mnist' is invalid; valid: digits, "),
    ({"model": "gpt"}, "model='gpt' is invalid; valid: mlp, "),
    ({"model_kwargs": ml_collections.ConfigDict({"hidden": 8, "width": 8,
                                                 "num_hidden_layers": 1})},
     "model_kwargs.width=8 is invalid: model 'mlp' takes no 'width'; valid "
     "keys: hidden, num_hidden_layers"),
    ({"loss": "mse"}, "loss='mse' is invalid; valid: cross_entropy, "),
    ({"input_shape": (8, -8, 1)}, "input_shape=(8, -8, 1) is invalid"),
    ({"stage_boundaries": (0, 2, 1, 3)},
     "stage_boundaries=(0, 2, 1, 3) is invalid; valid: () or increasing"),
    ({"dataset_kwargs": ml_collections.ConfigDict({"seed": 0, "size": 3})},
     "dataset_kwargs.size=3 is invalid: dataset 'digits' takes no 'size'"),
    ({"stage_devices": 3}, "stage_devices=3 is invalid; valid: a divisor of 4 "
     "(num_stages=4, placement='consecutive'), or 0 for num_stages"),
    ({"stage_devices": -1}, "stage_devices=-1 is invalid; valid: an integer "
     ">= 0 (0: num_stages)"),
    ({"placement": "ring"}, "placement='ring' is invalid; valid: consecutive, "
     "loop, v"),
    ({"placement": "v", "stage_devices": 3},
     "stage_devices=3 is invalid; valid: a divisor of 4 "
     "(num_stages=4, placement='v'), or 0 for num_stages"),
    ({"num_chunks": 2}, "num_chunks=2 is invalid; valid: 1 for the "
     "stage-level schedule 'gpipe' (chunks a device holds, for "
     f"{', '.join(schedules.DEVICE_LEVEL)};"),
    ({"schedule": "interleaved-1f1b", "num_chunks": 3}, "num_chunks=3 is "
     "invalid; valid: a divisor of num_stages=4 (chunks a device holds)"),
    ({"num_chunks": 0}, "num_chunks=0 is invalid"),
]


@pytest.mark.parametrize("overrides,message", BAD,
                         ids=[",".join(o) for o, _ in BAD])
def test_bad_value_is_one_line_naming_key_value_and_valid(overrides, message):
  config = default.get_config()
  with config.unlocked():
    for key, value in overrides.items():
      _set(config, key, value)
  with pytest.raises(ValueError) as e:
    validate.check(config)
  assert str(e.value).startswith(message), str(e.value)
  assert "\n" not in str(e.value)


def test_model_flags_and_nested_widths_pass():
  config = default.get_config("variant=resnet_digits")
  config.model_kwargs.bottleneck = True
  validate.check(config)
  config.model_kwargs.widths = (16, 0)
  with pytest.raises(ValueError, match=r"model_kwargs.widths=\(16, 0\) is "
                     "invalid; valid: positive integers"):
    validate.check(config)


def test_accepted_keys_come_from_the_registered_factories():
  assert validate.accepted_keys("schedule_kwargs", "hetpipe") == (
      "concurrent_minibatches",)
  assert validate.accepted_keys("sync_kwargs", "wsp") == (
      "clock_distance", "concurrent_minibatches", "delays", "server")
  assert validate.accepted_keys("schedule_kwargs", "nope") is None


@pytest.mark.parametrize("key,value,message", [
    ("weight_decay", -1e-4, "weight_decay=-0.0001 is invalid"),
    ("weight_decay_mode", "both", "weight_decay_mode='both' is invalid"),
    ("grad_clip_norm", -1.0, "grad_clip_norm=-1.0 is invalid"),
    ("lr_schedule", ("no_such_schedule", {}),
     "lr_schedule name='no_such_schedule' is invalid"),
    ("lr_schedule", ("cosine_decay_schedule", {"init_value": 0.1}),
     "decay_steps is missing"),
    ("optimizer_wrapper", ("NoSuchWrapper", {}),
     "optimizer_wrapper name='NoSuchWrapper' is invalid"),
    ("optimizer_wrapper", ("WeightPrediction", {"option": 4}),
     r"option=4 is invalid; valid: 1, 2 or 3"),
    ("optimizer_wrapper", ("PipeMare", {"decay": 0.5}),
     "warmup_steps is missing"),
    ("optimizer_wrapper", ("SpecTrain", {"lr": 0.1}), "takes no 'lr'"),
    ("sync_kwargs", {"clock_distance": 0, "server": "max"},
     "server='max' is invalid; valid: 'sum' or 'mean'"),
    ("remat", "keep", "remat='keep' is invalid; valid: 'recompute' or "
     "'residuals'"),
    ("optimizer_scope", "global", "optimizer_scope='global' is invalid; "
     "valid: 'auto' or 'model' or 'stage'"),
])
def test_optimizer_parts_are_refused_in_one_line(key, value, message):
  config = default.get_config()
  if key == "sync_kwargs":
    config.sync = "wsp"
    config.schedule, config.schedule_kwargs = "hetpipe", {
        "concurrent_minibatches": 2}
  config[key] = value
  with pytest.raises(ValueError, match=message) as info:
    validate.check(config)
  assert "\n" not in str(info.value)


def test_method_configs_with_optimizer_parts_pass():
  for name in ("sapipe", "spectrain", "pipemare"):
    validate.check(runpy.run_path(str(ROOT / "configs" / f"{name}.py"))[
        "get_config"]())


def test_a_mirroring_transform_takes_the_optimizers_learning_rate():
  """`gap_aware` (optim.MIRRORS) gets the optimizer's learning rate from
  `optimizers.make`; a transform outside MIRRORS must still name its own."""
  config = default.get_config()
  config.transforms = (("gap_aware", {}),)
  validate.check(config)
  config.transforms = (("basis_rotation_adam", {}),)
  with pytest.raises(ValueError, match="learning_rate is missing"):
    validate.check(config)
