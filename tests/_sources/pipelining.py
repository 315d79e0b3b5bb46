"""The field's per-rank action orders, rewritten from their sources for tests.

torch is not a dependency, so the pure-Python parts of the sources that
decide each rank's order of actions are rendered here, step for step, in
their own structure (not copied; names shortened), for the tests to compare
our device-level schedules with. An action is `(stage, kind, microbatch)`
with torch's kinds "F", "B" (full backward), "I" (input gradient) and "W"
(weight gradient); an overlapped unit is a tuple of two actions.

Sources:
  pytorch/pytorch `torch/distributed/pipelining/schedules.py` at commit
  00722e648b740f91d0e71494baa17891749fd291: `ScheduleLoopedBFS`,
  `_get_warmup_ops`, `_get_1f1b_rank_ops` and
  `ScheduleInterleaved1F1B._calculate_single_rank_operations`,
  `ScheduleZBVZeroBubble._calculate_single_rank_operations`,
  `ScheduleDualPipeV._calculate_single_rank_operations` (BSD-3-Clause).
  deepseek-ai/DualPipe `dualpipe/dualpipev.py` at commit
  3da1bbea53606543d7f5f232338fc58096db30e3: `DualPipeV.step` and
  `dualpipe/utils.py` `WeightGradStore` (MIT).
"""

import collections


def looped_bfs(rank, n_local, group, n_micro):
  """torch `ScheduleLoopedBFS`: all forwards chunk by chunk, then backwards
  from the last chunk, micro-batches reversed (padding Nones dropped)."""
  stages = range(rank, group * n_local, group)
  ops = [(s, "F", m) for s in stages for m in range(n_micro)]
  return ops + [(s, "B", m) for s in reversed(stages)
                for m in reversed(range(n_micro))]


def interleaved_1f1b(rank, n_local, group, n_micro):
  """torch `ScheduleInterleaved1F1B` (its `_get_1f1b_rank_ops` without zero
  bubble), with the padding Nones dropped."""
  rounds = max(1, n_micro // group)
  per_round = n_micro // rounds
  assert n_micro % rounds == 0
  warmup = min((n_local - 1) * per_round + 2 * (group - 1 - rank),
               n_micro * n_local)
  fwd_bwd = n_local * n_micro - warmup
  cooldown = n_local * n_micro - fwd_bwd

  def forward_stage(op):
    return (op // per_round) % n_local * group + rank

  def backward_stage(op):
    return (n_local - 1 - ((op - warmup) // per_round) % n_local) * group + rank

  next_f, next_b = collections.Counter(), collections.Counter()
  ops = []
  for op in range(warmup + fwd_bwd + cooldown):
    if op < warmup + fwd_bwd:
      s = forward_stage(op)
      ops.append((s, "F", next_f[s]))
      next_f[s] += 1
    if op >= warmup:
      s = backward_stage(op)
      ops.append((s, "B", next_b[s]))
      next_b[s] += 1
  return ops


def zb_v(rank, group, n_micro):
  """torch `ScheduleZBVZeroBubble` (two stages a rank, V placement)."""
  n = max(2 * group - 1, n_micro)
  c0, c1 = rank, 2 * group - 1 - rank
  f0 = f1 = b0 = b1 = 0
  ops = []
  for _ in range(2 * (group - rank) - 1):
    ops.append((c0, "F", f0))
    f0 += 1
  for _ in range(rank):
    ops += [(c1, "F", f1), (c0, "F", f0)]
    f1 += 1
    f0 += 1
  for _ in range(group - rank):
    ops += [(c1, "F", f1), (c1, "I", b1), (c1, "W", b1)]
    f1 += 1
    b1 += 1
  while f1 < f0 or f0 < n:
    if f0 < n:
      ops.append((c0, "F", f0))
      f0 += 1
    ops += [(c0, "I", b0), (c0, "W", b0), (c1, "F", f1), (c1, "I", b1),
            (c1, "W", b1)]
    b0 += 1
    f1 += 1
    b1 += 1
  w0, w1 = b0, b1
  for _ in range(rank):
    ops += [(c0, "I", b0), (c1, "I", b1)]
    b0 += 1
    b1 += 1
  for _ in range(group - rank):
    ops += [(c0, "I", b0), (c0, "W", w0)]
    b0 += 1
    w0 += 1
  ops += [(c1, "W", m) for m in range(w1, b1)]
  ops += [(c0, "W", m) for m in range(w0, b0)]
  return [a for a in ops if a[2] < n_micro]


def dualpipev_torch(rank, group, n_micro):
  """torch `ScheduleDualPipeV`: the steps with counters per (stage, kind),
  a full backward counting as an I and a W, a FIFO of pending W."""
  s0, s1 = rank, 2 * group - 1 - rank
  count = collections.Counter()
  pending = []
  ops = []

  def act(stage, kind):
    key = (stage, "I" if kind == "B" else kind)
    a = (stage, kind, count[key])
    if kind == "B":
      count[(stage, "I")] += 1
      count[(stage, "W")] += 1
    else:
      if kind == "I":
        pending.append((stage, "W", count[key]))
      count[key] += 1
    return a

  def weight():
    if pending:
      ops.append(pending.pop(0))

  for _ in range((group - rank - 1) * 2):
    ops.append(act(s0, "F"))
  for _ in range(rank + 1):
    ops += [act(s0, "F"), act(s1, "F")]
  for _ in range(group - rank - 1):
    ops.append(act(s1, "I"))
    weight()
    ops.append(act(s1, "F"))
  for i in range(n_micro - group * 2 + rank + 1):
    if i == 0 and rank == group - 1:
      ops += [act(s0, "F"), act(s1, "B")]
    else:
      ops.append((act(s0, "F"), act(s1, "B")))
    ops.append((act(s1, "F"), act(s0, "B")))
  for _ in range(group - rank - 1):
    ops.append(act(s1, "B"))
    ops.append((act(s1, "F"), act(s0, "B")))
  zb = False
  for i in range(rank + 1):
    if i == (rank + 1) // 2 and rank % 2 == 1:
      zb = True
    ops.append(act(s1, "I" if zb else "B"))
    if i == (rank + 1) // 2 and rank % 2 == 0:
      zb = True
    ops.append(act(s0, "I" if zb else "B"))
  for _ in range(group - rank - 1):
    weight()
    ops.append(act(s0, "I" if zb else "B"))
  for _ in range(rank + 1):
    weight()
  return ops


def dualpipev_deepseek(rank, group, n_micro):
  """DeepSeek's `DualPipeV.step` on one rank, its compute calls recorded.

  Phase 0 is stage `rank`, phase 1 stage `2 group - 1 - rank`. A backward
  with `enable_zb` leaves its weight gradients in `WeightGradStore` (an
  input-gradient task "I" now, its "W" when `_weight_chunk` pops the queue,
  first in first out); without, it is a full backward "B".
  `_forward_backward_chunk(p0, p1)` is one overlapped unit (F of p0, B of p1).
  """
  stage = (rank, 2 * group - 1 - rank)
  f_id, b_id = [0, 0], [0, 0]
  store = []  # WeightGradStore.funcs_queue
  ops = []

  def forward(ph):
    f_id[ph] += 1
    return (stage[ph], "F", f_id[ph] - 1)

  def backward(ph, enable_zb=False):
    b_id[ph] += 1
    if enable_zb:
      store.append((stage[ph], "W", b_id[ph] - 1))
    return (stage[ph], "I" if enable_zb else "B", b_id[ph] - 1)

  def weight_chunk():
    ops.append(store.pop(0))

  num_ranks, num_chunks = group, n_micro
  assert num_chunks >= num_ranks * 2
  for _ in range((num_ranks - rank - 1) * 2):  # Step 1: nF0
    ops.append(forward(0))
  for _ in range(rank + 1):  # Step 2: nF0F1
    ops.append(forward(0))
    ops.append(forward(1))
  for _ in range(num_ranks - rank - 1):  # Step 3: nB1W1F1
    ops.append(backward(1, enable_zb=True))
    weight_chunk()
    ops.append(forward(1))
  for i in range(num_chunks - num_ranks * 2 + rank + 1):  # Step 4
    if i == 0 and rank == num_ranks - 1:
      ops.append(forward(0))
      ops.append(backward(1))
    else:
      ops.append((forward(0), backward(1)))
    ops.append((forward(1), backward(0)))
  for _ in range(num_ranks - rank - 1):  # Step 5: nB1F1B0
    ops.append(backward(1))
    ops.append((forward(1), backward(0)))
  enable_zb = False
  step_6 = rank + 1
  for i in range(step_6):  # Step 6: nB1B0
    if i == step_6 // 2 and rank % 2 == 1:
      enable_zb = True
    ops.append(backward(1, enable_zb=enable_zb))
    if i == step_6 // 2 and rank % 2 == 0:
      enable_zb = True
    ops.append(backward(0, enable_zb=enable_zb))
  for _ in range(num_ranks - rank - 1):  # Step 7: nWB0
    weight_chunk()
    ops.append(backward(0, enable_zb=True))
  for _ in range(rank + 1):  # Step 8: nW
    weight_chunk()
  assert not store
  return ops
