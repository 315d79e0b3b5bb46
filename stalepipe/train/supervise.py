"""A multi-host process's worker, watched by a parent that outlives its abort.

When the coordinator of a multi-host run (process 0, which hosts JAX's
coordination service) dies, the other processes' distributed clients notice
at once (their error-polling RPC fails) and end the process from C++: a
`LOG(FATAL)` "Terminating process because the JAX distributed service
detected fatal errors", a stack dump and SIGABRT. The runtime takes a
`missed_heartbeat_callback` to replace that, but its Python binding cannot
pass the callback its `absl::Status` (it ends in `std::bad_cast`), and a
SIGABRT from a C++ thread cannot be caught in Python. So a multi-host
launcher runs its work in a child process, as torchrun's agent does:

- the child is the same command, with `STALEPIPE_WORKER=1` in its
  environment; its stdout and stdin are the parent's, its stderr passes
  through the parent line by line;
- a line carrying the client's fatal message is held back with the rest of
  the dump, and when the child has ended the parent says in one line which
  process was lost (`describe`);
- SIGTERM and SIGINT reach the child once, forwarded (it runs in a session
  of its own, out of the terminal's process group; the trainer's handler
  saves a checkpoint and stops), and the child, calling
  `die_with_parent` first, dies with its parent (Linux `PR_SET_PDEATHSIG`),
  so a killed launcher is a dead process to its peers, as before.

The child's stderr is a pipe, so a multi-host run prints the plain progress
lines of non-interactive output (`console.py`), never the live bar.
"""

import ctypes
import os
import re
import signal
import subprocess
import sys
from typing import Callable, Sequence

WORKER = "STALEPIPE_WORKER"
PARENT = "STALEPIPE_SUPERVISOR_PID"
FATAL = "Terminating process because the JAX distributed service"
ERROR = "launch.py: error:"
_PR_SET_PDEATHSIG = 1


def is_worker() -> bool:
  """Whether this process is a supervised child (or asked not to be one)."""
  return os.environ.get(WORKER) == "1"


def describe(me: str, dump: str) -> str:
  """One line for the client's fatal dump, naming the lost process.

  Args:
    me: this process, e.g. "process 1 of 2".
    dump: what the child printed from the fatal message on.
  """
  text = " ".join(dump.split())
  status = re.split(r"\*\*\* Check failure|Additional GRPC error",
                    text.split("absl::Status:", 1)[-1])[0].strip()[:200]
  if "coordination service" in text and (
      "Failed to send RPC" in text or "Socket closed" in text):
    return (f"{me}: lost the coordinator, process 0, which stopped or crashed "
            f"(see its own output): {status}")
  task = re.search(r"/task:(\d+)", text)
  lost = f"process {task.group(1)}" if task else "another process"
  return (f"{me}: the multi-host run failed: {lost} stopped or crashed (see "
          f"its own output): {status}")


def die_with_parent() -> None:
  """In the child, first thing: SIGKILL when the parent dies (Linux).

  Set by the child itself rather than between fork and exec, so that the
  parent (a test's process may have threads) can spawn without `preexec_fn`;
  a parent gone before this ran ends the child here.
  """
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    return  # not Linux: the child outlives a killed parent
  if os.getppid() != int(os.environ.get(PARENT, os.getppid())):
    os._exit(1)  # pylint: disable=protected-access


def exit_as(code: int) -> None:
  """Ends this process as the child ended: with its exit code, or by its
  signal (negative `code`), also one no handler can take (SIGKILL, e.g. from
  the kernel's out-of-memory killer)."""
  if code < 0:
    try:
      signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):
      pass  # SIGKILL and SIGSTOP keep their default action anyway
    os.kill(os.getpid(), -code)
  sys.exit(code)


def run(argv: Sequence[str], me: str,
        write: Callable[[str], None] | None = None) -> int:
  """Runs `argv` as the supervised child; returns its exit code (negative:
  the signal that ended it), or 1 after the one line for a fatal dump.

  Args:
    argv: the command (this launcher's own, with its interpreter).
    me: this process, for the one line, e.g. "process 1 of 2".
    write: where the child's stderr goes (default: this process's stderr).
  """
  write = write or (lambda s: (sys.stderr.write(s), sys.stderr.flush()))
  env = dict(os.environ, **{WORKER: "1", PARENT: str(os.getpid())})
  # A session of its own: a terminal's Ctrl-C or a signal to the parent's
  # process group reaches the child once, forwarded, not twice.
  child = subprocess.Popen(list(argv), env=env, stderr=subprocess.PIPE,
                           start_new_session=True)
  forward = lambda signum, _: child.send_signal(signum)
  previous = {s: signal.signal(s, forward)
              for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    dump, said = [], False
    for raw in iter(child.stderr.readline, b""):
      line = raw.decode(errors="replace")
      if dump or FATAL in line:
        dump.append(line)
      else:
        said = said or line.startswith(ERROR)
        write(line)
    code = child.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  if dump:
    # The child may have said first what failed (a collective that lost its
    # peer), racing the service's abort: one line, not two.
    if not said:
      write(f"{ERROR} {describe(me, ''.join(dump))}\n")
    return 1
  return code
