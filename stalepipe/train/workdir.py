"""One run per workdir: an exclusive lock held for the run's lifetime.

`lock(workdir)` takes `fcntl.flock` on `<workdir>/lock`. The kernel drops it
when the process ends, however it ends, so a SIGKILLed run leaves no stale
lock; a second run on the same workdir is refused in one line naming the
holder's PID and host. A multi-host run takes it on process 0, the one that
writes.

Examples:
  >>> import tempfile
  >>> path = tempfile.mkdtemp()
  >>> with lock(path):
  ...   with lock(path):
  ...     pass
  Traceback (most recent call last):
  ...
  ValueError: --workdir=... is in use by PID ... on host ...; valid: wait for that run to end, or a new --workdir
"""

import contextlib
import fcntl
import os
import socket
from typing import Iterator

import jax


@contextlib.contextmanager
def lock(workdir: str) -> Iterator[None]:
  """Holds the workdir's lock (process 0 only) while the block runs."""
  if jax.process_index() != 0:
    yield
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "lock")
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 200, 0).decode(errors="replace").split()
      pid, host = (holder + ["?", "?"])[:2]
      raise ValueError(f"--workdir={workdir} is in use by PID {pid} on host "
                       f"{host}; valid: wait for that run to end, or a new "
                       "--workdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock
