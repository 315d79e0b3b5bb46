"""Noticing a lost peer process of a multi-host run, in one line.

When a process of a multi-host run dies, the others block in their next
collective until JAX's coordinator misses its heartbeats and aborts them
with a C++ dump ("another task died"). This watch speaks first: every
process bumps a counter of its own in JAX's distributed key-value store each
second and reads the others'; a peer whose counter stands still (and that has
not said it is done) is reported through `on_lost`, which is expected to end
the process, within half the heartbeat timeout of its last beat.

`done` stops the watch and waits for its thread before the process exits:
a daemon thread still calling into the runtime's client while the
interpreter finalizes is ended by `pthread_exit`, whose unwinding through
the binding's C++ aborts the process ("terminate called after throwing an
instance of ''", "FATAL: exception not rethrown") after a finished run.
"""

import threading
import time
from typing import Callable

import jax

from stalepipe.train import jax_private

_PREFIX = "stalepipe/peers"
_stop = threading.Event()
_threads: list[threading.Thread] = []


def _client():
  return jax_private.distributed_client()


def watch(heartbeat_timeout: float, on_lost: Callable[[str], None],
          interval: float = 1.0) -> None:
  """Starts the watch in a daemon thread; nothing on a single process.

  Args:
    heartbeat_timeout: JAX's, in seconds. The process stops within half of
      it of the peer's last beat: the peer's counter is seen to change at
      most `interval` after that beat and is checked every `interval`, and
      ending the process takes about one more, so a peer is reported after
      standing still for half the timeout less three intervals (at least
      one interval: under 8 s the stop may come up to 3 s later).
    on_lost: called with a one-line description naming the lost process.
    interval: seconds between beats.
  """
  if jax.process_count() == 1:
    return
  me, client = jax.process_index(), _client()
  limit = max(heartbeat_timeout / 2 - 3 * interval, interval)

  def beat_and_check():
    seen = {p: (None, time.monotonic()) for p in range(jax.process_count())
            if p != me}
    while not _stop.is_set():
      try:
        client.key_value_increment(f"{_PREFIX}/alive/{me}", 1)
        for p, (last, since) in list(seen.items()):
          if _try_get(client, f"{_PREFIX}/done/{p}") is not None:
            del seen[p]
            continue
          value, now = _try_get(client, f"{_PREFIX}/alive/{p}"), time.monotonic()
          if value != last:
            seen[p] = (value, now)
          elif now - since > limit:
            on_lost(f"process {me} of {jax.process_count()}: process {p} "
                    f"{'never started' if value is None else 'stopped'} "
                    f"(no sign of it for {now - since:.0f} s; see its own "
                    "output); stopping")
      except Exception as e:  # pylint: disable=broad-except
        on_lost(f"process {me} of {jax.process_count()}: lost the "
                f"coordinator, process 0 (see its own output): "
                f"{' '.join(str(e).split())[:200]}")
      _stop.wait(interval)

  _stop.clear()
  _threads.append(threading.Thread(target=beat_and_check, daemon=True))
  _threads[-1].start()


def same_config(config_json: str, timeout: float) -> str | None:
  """None where every process runs this config; else one line naming the
  fields that differ from another process's. Nothing to check on one process.

  Each process publishes its resolved config (JSON) in JAX's distributed
  key-value store and reads every other's, so each refuses on its own.

  Args:
    config_json: this process's config, `config.to_json(sort_keys=True)`.
    timeout: seconds to wait for the others'.
  """
  if jax.process_count() == 1:
    return None
  import json  # pylint: disable=g-import-not-at-top
  me, client = jax.process_index(), _client()
  client.key_value_set(f"{_PREFIX}/config/{me}", config_json,
                       allow_overwrite=True)
  mine, line = json.loads(config_json), None
  for p in range(jax.process_count()):
    if p == me:
      continue
    theirs = json.loads(client.blocking_key_value_get(
        f"{_PREFIX}/config/{p}", int(timeout * 1000)))
    differ = sorted(k for k in mine.keys() | theirs.keys()
                    if mine.get(k) != theirs.get(k))
    if differ and line is None:
      shown = ", ".join(f"{k}={mine.get(k)!r} (process {p}: "
                        f"{theirs.get(k)!r})" for k in differ[:3])
      line = (f"process {me} of {jax.process_count()} runs another config "
              f"than process {p}: {shown}{' ...' if len(differ) > 3 else ''}"
              "; valid: the same --config and --config.* flags on every "
              "process")
  # No process leaves (and takes the coordinator with it) before all have
  # read all the configs.
  client.wait_at_barrier("stalepipe_config_checked", int(timeout * 1000))
  return line


def refused(timeout: float) -> None:
  """Leaves a run that every process refuses in order: configs that differ
  (`same_config`), or one config that cannot be built.

  Process 0 hosts the coordination service: leaving first, it took the
  service along while another process was still between the barrier and its
  own line, which then died on the lost service instead of saying why. The
  others say they are leaving; process 0 waits (up to `timeout` s) for them.
  Call after this process's line is out. Nothing on a single process.
  """
  if jax.process_count() == 1:
    return
  me, client = jax.process_index(), _client()
  if me != 0:
    client.key_value_set(f"{_PREFIX}/refused/{me}", "1", allow_overwrite=True)
    return
  for p in range(1, jax.process_count()):
    client.blocking_key_value_get(f"{_PREFIX}/refused/{p}",
                                  int(timeout * 1000))


def _try_get(client, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception as e:  # pylint: disable=broad-except
    if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
      return None
    raise


def done(timeout: float = 30.0) -> None:
  """Tells the others this process has finished: not lost when it exits;
  then stops the watch and waits (up to `timeout` s) for its thread to end.
  """
  if jax.process_count() > 1:
    _client().key_value_set(f"{_PREFIX}/done/{jax.process_index()}", "1",
                            allow_overwrite=True)
  _stop.set()
  while _threads:
    _threads.pop().join(timeout)
