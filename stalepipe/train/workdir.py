"""One run per workdir, and a run's results never overwritten.

A run holds an exclusive lock on its workdir for its lifetime.

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
import re
import socket
from typing import Iterator

import jax

# What stays when a fresh start moves an earlier run aside: the lock the
# run holds, and the runs moved aside before.
_KEPT = re.compile(r"lock|previous-\d+")


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


def check_no_results(workdir: str) -> str | None:
  """Refuses a fresh start over an earlier run's results (one line).

  Called when there is no checkpoint to resume: the files there belong to a
  run that cannot be continued, and a fresh start would overwrite them. A
  run that ended before its first checkpoint and wrote no result (a NaN
  loss at step 1, a kill) left only its records: process 0 moves them to
  `previous-N/` and returns that directory, and the new run starts.
  """
  found = [name for name in ("metrics.jsonl", "summary.json", "params.npz")
           if os.path.exists(os.path.join(workdir, name))]
  if found == ["metrics.jsonl"]:
    return move_aside(workdir) if jax.process_index() == 0 else None
  if found:
    raise ValueError(
        f"--workdir={workdir} holds a run's results ({', '.join(found)}) but "
        "no checkpoint to resume; valid: a new --workdir, or --fresh to move "
        "them to previous-N/ there and start afresh")
  return None


def move_aside(workdir: str) -> str | None:
  """Moves everything an earlier run wrote (its hooks' files too) into
  `<workdir>/previous-N/` (N = 1, 2, ...); returns that directory, or None
  when there was nothing to move."""
  found = sorted(n for n in os.listdir(workdir) if not _KEPT.fullmatch(n))
  if not found:
    return None
  n = 1
  while os.path.exists(os.path.join(workdir, f"previous-{n}")):
    n += 1
  aside = os.path.join(workdir, f"previous-{n}")
  os.makedirs(aside)
  for name in found:
    os.rename(os.path.join(workdir, name), os.path.join(aside, name))
  return aside
