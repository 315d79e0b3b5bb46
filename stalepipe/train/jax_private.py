"""The two private JAX interfaces the launcher needs, in one place.

JAX has no public interface for either; each function says what would
replace it. Nothing else in stalepipe imports `jax._src`.
"""

from typing import Any


def distributed_client() -> Any:
  """JAX's distributed runtime client (its key-value store, for `peers`).

  Replace with a public key-value store interface when JAX has one
  (`jax.experimental.multihost_utils` offers only collectives over devices).
  """
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def quiet_native_logs() -> None:
  """C++ logs from fatal up (what TF_CPP_MIN_LOG_LEVEL=3 asked, which this
  jaxlib's absl logging no longer reads). `jax_logging_level` does the same
  but re-levels the Python loggers too; replace when a public setter of the
  native log level exists."""
  from jax._src.lib import utils  # pylint: disable=g-import-not-at-top
  utils.absl_set_min_log_level(3)
