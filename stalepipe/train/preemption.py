"""Stopping cleanly on SIGTERM or SIGINT (a cluster's preemption, Ctrl-C).

The handler only records the signal; the loop asks `requested()` after each
window, saves a checkpoint and returns. With several processes they must
stop after the same window (the save is collective), so `requested()` is
true everywhere once any process has been signalled: an all-gather of one
flag per process.
"""

import signal

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Preemption:
  """A context manager catching SIGTERM/SIGINT while a run is in progress.

  Examples:
    >>> import os
    >>> with Preemption() as preemption:
    ...   os.kill(os.getpid(), signal.SIGTERM)
    ...   preemption.requested(), preemption.signal_name
    (True, 'SIGTERM')
  """

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self) -> "Preemption":
    for signum in SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum, frame) -> None:
    del frame
    self.signum = signum

  @property
  def signal_name(self) -> str | None:
    return None if self.signum is None else signal.Signals(self.signum).name

  def requested(self) -> bool:
    """Whether any process has been signalled (a collective if several)."""
    local = self.signum is not None
    if jax.process_count() == 1:
      return local
    flags = multihost_utils.process_allgather(np.int32(local))
    return bool(np.any(flags))
