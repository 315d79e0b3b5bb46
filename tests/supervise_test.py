"""The multi-host launcher's parent: one line for the client's fatal dump.

`stalepipe/train/supervise.py` runs a command as its child and passes its
stderr through; these run small Python children in place of the launcher's
worker, one printing the dump JAX's distributed client prints when the
coordinator dies (taken from a real run, JAX 0.10.2).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from stalepipe.train import supervise

# Process 1's stderr when process 0 was SIGKILLed (abbreviated stack).
COORDINATOR_DUMP = textwrap.dedent("""\
    F1123 11:22:05.362509   22983 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues. Check earlier logs from 1) this task, 2) the leader (usually slice 0 task 0), and 3) cluster scheduler to debug further.
    Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
    :UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}
    *** Check failure stack trace: ***
        @     0x7f9401a40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
        @     0x7f93fdb040ee  xla::CoordinationServiceAgent::SetError()
    """)
TASK_DUMP = ("F1123 11:30:00.000000 1 client.h:80] Terminating process because "
             "the JAX distributed service detected fatal errors. absl::Status: "
             "INTERNAL: Task /job:jax_worker/replica:0/task:2 heartbeat timeout"
             "\n*** Check failure stack trace: ***\n")


def _child(code: str) -> list[str]:
  return [sys.executable, "-c", textwrap.dedent(code)]


def _run(code: str, me: str = "process 1 of 2") -> tuple[int, str]:
  lines = []
  return supervise.run(_child(code), me, lines.append), "".join(lines)


def test_the_coordinators_death_is_one_line_naming_process_0():
  code, err = _run(f"""
      import os, sys
      sys.stderr.write("step 3/9  loss 0.5\\n"); sys.stderr.flush()
      sys.stderr.write({COORDINATOR_DUMP!r}); sys.stderr.flush()
      os.abort()
      """)
  assert code == 1
  first, last = err.splitlines()
  assert first == "step 3/9  loss 0.5"  # what came before passes through
  assert last == (
      "launch.py: error: process 1 of 2: lost the coordinator, process 0, "
      "which stopped or crashed (see its own output): UNAVAILABLE: Failed to "
      "send RPC to coordination service. Either the leader task was "
      "preempted/died/restarted unexpectedly or this task is experiencing "
      "network issues. Check earlier logs from 1) this t")


def test_a_child_that_said_its_error_first_gets_no_second_line():
  """A collective can fail (its peer gone) and the launcher print its line
  just before the service's abort: still one error line."""
  said = ("launch.py: error: process 1 of 2 lost contact with process 0, "
          "which stopped or crashed (see its own output): UNKNOWN: Gloo")
  code, err = _run(f"""
      import os, sys
      sys.stderr.write({said + chr(10)!r}); sys.stderr.flush()
      sys.stderr.write({COORDINATOR_DUMP!r}); sys.stderr.flush()
      os.abort()
      """)
  assert code == 1
  assert err.splitlines() == [said]


def test_a_task_the_service_reports_is_named():
  assert supervise.describe("process 0 of 4", TASK_DUMP) == (
      "process 0 of 4: the multi-host run failed: process 2 stopped or crashed "
      "(see its own output): INTERNAL: Task /job:jax_worker/replica:0/task:2 "
      "heartbeat timeout")


@pytest.mark.parametrize("exit_code", [0, 1, 3])
def test_any_other_output_and_exit_code_pass_through(exit_code):
  code, err = _run(f"""
      import sys
      sys.stderr.write("launch.py: error: --config.seed=-1 is invalid\\n")
      sys.exit({exit_code})
      """)
  assert (code, err) == (exit_code,
                         "launch.py: error: --config.seed=-1 is invalid\n")


def test_the_child_is_a_worker_and_shares_stdout():
  out = subprocess.run(
      [sys.executable, "-c", "import sys; from stalepipe.train import "
       "supervise; sys.exit(supervise.run([sys.executable, '-c', 'from "
       "stalepipe.train import supervise; print(supervise.is_worker())'], "
       "'p'))"], capture_output=True, text=True, check=True)
  assert out.stdout == "True\n"
  assert not supervise.is_worker()


def test_sigterm_reaches_the_child_which_ends_by_its_own_handler(tmp_path):
  """The trainer's handler saves and stops on SIGTERM: the parent passes the
  signal on and ends with the child's code."""
  ready = tmp_path / "ready"
  parent = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(f"""
          import sys
          from stalepipe.train import supervise
          sys.exit(supervise.run([sys.executable, "-c", '''
          import signal, sys, time, pathlib
          signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
          pathlib.Path({str(ready)!r}).touch()
          time.sleep(60)
          '''], "p"))
          """)], stderr=subprocess.PIPE, text=True)
  while not ready.exists():
    assert parent.poll() is None, parent.communicate()[1]
    time.sleep(0.05)
  parent.send_signal(signal.SIGTERM)
  assert parent.wait(timeout=30) == 7


def test_a_killed_parent_takes_its_child_along(tmp_path):
  pid_file = tmp_path / "pid"
  parent = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(f"""
          import sys
          from stalepipe.train import supervise
          supervise.run([sys.executable, "-c", '''
          import os, time, pathlib
          from stalepipe.train import supervise
          supervise.die_with_parent()
          pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
          time.sleep(60)
          '''], "p")
          """)])
  while not (pid_file.exists() and pid_file.read_text()):
    time.sleep(0.05)
  child = int(pid_file.read_text())
  parent.kill()
  parent.wait()
  for _ in range(100):
    try:
      with open(f"/proc/{child}/stat") as f:
        if f.read().split(")")[-1].split()[0] == "Z":
          break
    except FileNotFoundError:
      break
    time.sleep(0.05)
  else:
    raise AssertionError(f"child {child} outlived its killed parent")


def test_a_signal_to_the_process_group_reaches_the_child_once(tmp_path):
  """A terminal's Ctrl-C goes to the whole foreground process group: the
  child, in a session of its own, gets it once, from its parent."""
  ready = tmp_path / "ready"
  parent = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(f"""
          import sys
          from stalepipe.train import supervise
          sys.exit(supervise.run([sys.executable, "-c", '''
          import pathlib, signal, sys, time
          count = []
          signal.signal(signal.SIGINT, lambda *_: count.append(1))
          pathlib.Path({str(ready)!r}).touch()
          time.sleep(3)
          sys.exit(10 + len(count))
          '''], "p"))
          """)], start_new_session=True)
  while not ready.exists():
    assert parent.poll() is None
    time.sleep(0.05)
  os.killpg(parent.pid, signal.SIGINT)
  assert parent.wait(timeout=30) == 11


@pytest.mark.parametrize("code", [0, 3, -signal.SIGTERM, -signal.SIGKILL])
def test_the_parent_ends_as_its_child_did_even_by_sigkill(code):
  """A child the out-of-memory killer took ends in SIGKILL, which no handler
  can be set for: the parent ends by it too, without a traceback."""
  # By path, as launch.py loads it: no JAX import.
  program = textwrap.dedent(f"""
      import importlib.util
      spec = importlib.util.spec_from_file_location("s", {supervise.__file__!r})
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      module.exit_as({code})""")
  result = subprocess.run([sys.executable, "-c", program], capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == code and result.stderr == "", result.stderr
