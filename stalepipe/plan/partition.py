"""HetPipe's memory-aware partitioner over heterogeneous devices (seed 001 §4, §7).

A virtual worker of k devices runs a model cut into k contiguous stages, one
per device. The partitioner chooses the device order and the cut points that
minimise the slowest stage, where a stage's time is its computation plus the
time to receive activations (forward) and gradients (backward) over its links,
subject to every stage's memory holding its weights, its weight stash and the
activations of the minibatches in flight at its pipeline position (seed 001 §4:
the first GPU holds the most, the last only one).

The search is exact. Orders are enumerated as sequences of device *classes*
(type and node), so identical devices are never permuted: a dynamic programme
over (devices used per class, class of the last stage, whether the next stage
shares its node, cut point) visits every distinct order and every contiguous
split once. Guessing the next link ahead of time lets a stage's time include
its outgoing transfer before the next device is chosen; the guess is checked
when it is.
"""

from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from stalepipe.plan.devices import HETPIPE_NETWORK, GIB, Device, Network
from stalepipe.plan.profile import Profile


class Plan(NamedTuple):
  """A partition of a model over the devices of one virtual worker.

  `boundaries` feeds `stalepipe.models.split(blocks, plan.boundaries)`; stage
  `s` runs on `devices[s]`. Times are seconds per minibatch.
  """

  boundaries: tuple[int, ...]  # first block of each stage, starting at 0
  devices: tuple[Device, ...]  # device of each stage, in pipeline order
  forward_s: tuple[float, ...]  # forward computation per stage
  backward_s: tuple[float, ...]  # backward computation per stage
  recv_activation_s: tuple[float, ...]  # receiving the input (0 at stage 0)
  recv_gradient_s: tuple[float, ...]  # receiving the output's gradient (0 last)
  memory_bytes: tuple[int, ...]  # memory each stage needs
  param_bytes: tuple[int, ...]  # parameters of each stage
  activation_bytes: tuple[int, ...]  # output each stage sends on (last: 0)
  concurrent: int  # N_m, the minibatches in flight the memory is sized for

  @property
  def stage_times(self) -> tuple[float, ...]:
    return tuple(map(sum, zip(self.forward_s, self.backward_s,
                              self.recv_activation_s, self.recv_gradient_s)))

  @property
  def bottleneck_s(self) -> float:
    """The slowest stage's time: the pipeline's seconds per minibatch."""
    return max(self.stage_times)


class InfeasiblePlanError(ValueError):
  """No partition fits the devices' memory."""


def activations_in_flight(position: int, concurrent: int) -> int:
  """Minibatches whose activations the stage at `position` keeps at once.

  With :math:`N_m` minibatches in flight, the stage at (0-based) position
  :math:`i` keeps the forward results of

  .. math::
    m_i = \\max(1, N_m - i)

  minibatches: a minibatch's forward and backward on stage :math:`i` are
  :math:`i` stages of the pipeline closer together than on stage 0, which
  holds every minibatch in flight, and the last stage fuses forward and
  backward (seed 001 §4, Figure 1).

  Args:
    position: 0-based pipeline position.
    concurrent: :math:`N_m`.

  Returns:
    :math:`m_i`.

  References:
    Park et al, HetPipe, 2020, §4 ("Model Partitioning", Figure 1).

  Examples:
    >>> [activations_in_flight(i, 4) for i in range(5)]
    [4, 3, 2, 1, 1]
  """
  return max(1, concurrent - position)


def stage_memory(profile: Profile, begin: int, end: int, position: int,
                 concurrent: int, optimizer_slots: int = 2) -> int:
  """Bytes the stage running blocks `[begin, end)` at `position` needs.

  .. math::
    M = P \\cdot (m_i + c) + m_i \\cdot A

  with :math:`P` the stage's parameter bytes, :math:`m_i` the minibatches in
  flight there (`activations_in_flight`), each reading its own stashed weight
  version (seed 001 §4: :math:`w_p` stays in memory until the backward of
  :math:`p`), :math:`c` the parameter-sized optimizer buffers (gradient and
  momentum: 2) and :math:`A` the bytes the blocks keep for backward.

  Args:
    profile: the model's profile.
    begin: first block of the stage.
    end: one past its last block.
    position: 0-based pipeline position.
    concurrent: :math:`N_m`.
    optimizer_slots: :math:`c`.

  Returns:
    The stage's memory in bytes.

  References:
    Park et al, HetPipe, 2020, §4 ("Model Partitioning", "Considering
    Staleness").

  Examples:
    >>> p = Profile("V", 1, (1., 1.), (1., 1.), (10, 20), (5, 5), (3, 4))
    >>> stage_memory(p, 0, 2, position=0, concurrent=2)
    134
  """
  m = activations_in_flight(position, concurrent)
  params = sum(profile.param_bytes[begin:end])
  kept = sum(profile.kept_bytes[begin:end])
  return params * (m + optimizer_slots) + m * kept


def _prefix(values: Sequence[float]) -> np.ndarray:
  return np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])


def _span(prefix: np.ndarray) -> np.ndarray:
  """`[b, e] -> prefix[e] - prefix[b]` for `b < e`, `inf` elsewhere."""
  n = len(prefix) - 1
  b, e = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
  return np.where(b < e, prefix[None, :] - prefix[:, None], np.inf)


# cost(position, class, same_node_in, same_node_out) -> [begin, end] matrix;
# same_node_in is None for the first stage, same_node_out None for the last.
CostFn = Callable[[int, int, bool | None, bool | None], np.ndarray]


def _minmax_search(num_blocks: int, counts: Sequence[int],
                   same_node: np.ndarray, cost: CostFn
                   ) -> tuple[float, list[tuple[int, int, int]]]:
  """Minimises the largest stage cost over class orders and contiguous cuts.

  Returns the optimum and its stages as `(class, begin, end)`; the optimum is
  `inf` (and the stages empty) when no choice has finite cost.
  """
  n, k, num_classes = num_blocks, sum(counts), len(counts)
  out_flags = lambda s: (None,) if s == k - 1 else (True, False)
  # A layer maps (devices used per class, last class, next on same node) to
  # (best largest cost per end cut, predecessor's index, begin cut).
  layers = [{}]
  for t in range(num_classes):
    if counts[t]:
      used = tuple(int(i == t) for i in range(num_classes))
      for so in out_flags(0):
        values = np.full(n + 1, np.inf)
        values[1:] = cost(0, t, None, so)[0, 1:]
        layers[0][(used, t, so)] = (values, None, None)
  for s in range(1, k):
    layer = {}
    for index, (key, (values, _, _)) in enumerate(layers[-1].items()):
      used, p, si = key
      rows = np.flatnonzero(np.isfinite(values))
      if not rows.size:
        continue
      for t in range(num_classes):
        if used[t] == counts[t] or bool(same_node[p, t]) != si:
          continue
        new_used = used[:t] + (used[t] + 1,) + used[t + 1:]
        for so in out_flags(s):
          totals = np.maximum(values[rows, None], cost(s, t, si, so)[rows])
          arg = totals.argmin(axis=0)
          best = totals[arg, np.arange(n + 1)]
          new_key = (new_used, t, so)
          if new_key not in layer:
            layer[new_key] = (best, np.full(n + 1, index), rows[arg])
            continue
          old, prev, begin = layer[new_key]
          better = best < old
          old[better] = best[better]
          prev[better] = index
          begin[better] = rows[arg][better]
    layers.append(layer)
  finals = [(values[n], key) for key, (values, _, _) in layers[-1].items()]
  best, key = min(finals, key=lambda f: f[0], default=(np.inf, None))
  if best == np.inf:
    return np.inf, []
  stages, end = [], n
  for s in range(k - 1, -1, -1):
    _, prev, begin = layers[s][key]
    b = 0 if begin is None else int(begin[end])
    stages.append((key[1], b, end))
    if s:
      key, end = list(layers[s - 1])[prev[end]], b
  return float(best), stages[::-1]


class _Problem(NamedTuple):
  classes: list[tuple[str, int]]  # (type name, node)
  counts: list[int]
  members: list[list[Device]]
  same_node: np.ndarray


def _classes(devices: Sequence[Device]) -> _Problem:
  groups = {}
  for d in devices:
    groups.setdefault((d.spec.name, d.node), []).append(d)
  classes = sorted(groups)
  nodes = np.array([node for _, node in classes])
  return _Problem(classes=classes, counts=[len(groups[c]) for c in classes],
                  members=[sorted(groups[c]) for c in classes],
                  same_node=nodes[:, None] == nodes[None, :])


def _check(profiles: Mapping[str, Profile], devices: Sequence[Device],
           concurrent: int, optimizer_slots: int) -> int:
  if not devices:
    raise ValueError("devices is empty; valid: at least one Device")
  missing = sorted({d.spec.name for d in devices} - set(profiles))
  if missing:
    raise ValueError(f"no profile for device types {missing}; valid: "
                     f"profiles keyed by {sorted(profiles)}")
  sizes = {profiles[d.spec.name].num_blocks for d in devices}
  if len(sizes) != 1:
    raise ValueError(f"profiles have different block counts {sorted(sizes)}; "
                     "valid: one model, one block count")
  n = sizes.pop()
  if len(devices) > n:
    raise ValueError(f"{len(devices)} devices for {n} blocks; valid: at most "
                     "one device per block")
  if len(set(devices)) != len(devices):
    raise ValueError("devices repeat; valid: distinct (spec, node, slot)")
  if not isinstance(concurrent, int) or concurrent < 1:
    raise ValueError(f"concurrent={concurrent!r} is invalid; valid: int >= 1")
  if optimizer_slots < 0:
    raise ValueError(f"optimizer_slots={optimizer_slots} is invalid; "
                     "valid: >= 0")
  return n


def _memory_matrix(profile: Profile, position: int, concurrent: int,
                   optimizer_slots: int) -> np.ndarray:
  m = activations_in_flight(position, concurrent)
  return (_span(_prefix(profile.param_bytes)) * (m + optimizer_slots)
          + m * _span(_prefix(profile.kept_bytes)))


def _infeasible(problem: _Problem, profiles: Mapping[str, Profile], n: int,
                concurrent: int, optimizer_slots: int) -> InfeasiblePlanError:
  """Names the device that lacks memory in the least-short partition."""
  specs = [m[0].spec for m in problem.members]

  def excess(s, t, si, so):
    del si, so
    need = _memory_matrix(profiles[specs[t].name], s, concurrent,
                          optimizer_slots)
    return need - specs[t].memory_bytes

  short, stages = _minmax_search(n, problem.counts, problem.same_node, excess)
  worst = max(range(len(stages)), key=lambda s: excess(s, stages[s][0], 0, 0)[
      stages[s][1], stages[s][2]])
  t, b, e = stages[worst]
  spec = specs[t]
  need = short + spec.memory_bytes
  return InfeasiblePlanError(
      f"no partition of {n} blocks over {len(stages)} devices holds "
      f"{concurrent} concurrent minibatches: at best {spec.name} on node "
      f"{problem.classes[t][1]} (stage {worst}, blocks {b}..{e - 1}) needs "
      f"{need / GIB:.2f} GiB of {spec.memory_bytes / GIB:.2f} GiB, "
      f"{short / GIB:.2f} GiB missing; valid: fewer concurrent minibatches, "
      "more or larger devices")


def partition(profiles: Mapping[str, Profile], devices: Sequence[Device], *,
              concurrent: int = 1, network: Network = HETPIPE_NETWORK,
              optimizer_slots: int = 2) -> Plan:
  """Partitions a model over a virtual worker's devices, fastest first.

  Minimises the slowest stage over every distinct order of `devices` and
  every contiguous split into one stage per device:

  .. math::
    \\min_{\\pi, b} \\max_s \\Big( \\sum_{j=b_s}^{b_{s+1}-1}
    (f_j + g_j)^{(\\pi_s)} + [s>0]\\, c(a_{b_s - 1}, \\pi_{s-1}, \\pi_s)
    + [s<k-1]\\, c(a_{b_{s+1}-1}, \\pi_s, \\pi_{s+1}) \\Big)

  subject to `stage_memory` fitting each device, with :math:`f, g` the
  forward and backward times on the stage's device type, :math:`a` the output
  bytes of the block before a cut and :math:`c` the transfer time over the
  link (`Network.seconds`).

  Args:
    profiles: a profile of the model per device type name (see `scale`).
    devices: the virtual worker's devices (k of them; k stages).
    concurrent: :math:`N_m`, minibatches in flight the memory must hold.
    network: link speeds within and across nodes.
    optimizer_slots: parameter-sized optimizer buffers per stage.

  Returns:
    The best plan.

  Raises:
    InfeasiblePlanError: no partition fits; the message names the device
      short of memory in the partition that comes closest, and by how much.

  References:
    Park et al, HetPipe, 2020, §4 ("Model Partitioning") and §7.

  Examples:
    >>> from stalepipe.plan.devices import Device, TITAN_V, RTX_2060
    >>> from stalepipe.plan.profile import scale
    >>> p = Profile("V", 32, (1., 1., 1., 1.), (2., 2., 2., 2.), (4,) * 4,
    ...             (0,) * 4, (4,) * 4)
    >>> profiles = {"V": p, "G": scale(p, TITAN_V, RTX_2060)}
    >>> plan = partition(profiles, [Device(RTX_2060, 0), Device(TITAN_V, 1)])
    >>> plan.boundaries, [d.spec.name for d in plan.devices]
    ((0, 1), ['G', 'V'])
  """
  n = _check(profiles, devices, concurrent, optimizer_slots)
  problem = _classes(devices)
  specs = [m[0].spec for m in problem.members]
  out_bytes = np.asarray(profiles[specs[0].name].output_bytes, np.float64)
  masked = {}

  def base(s, t):
    key = (activations_in_flight(s, concurrent), specs[t].name)
    if key not in masked:
      profile = profiles[specs[t].name]
      compute = _span(_prefix(np.add(profile.forward_s, profile.backward_s)))
      fits = (_memory_matrix(profile, s, concurrent, optimizer_slots)
              <= specs[t].memory_bytes)
      masked[key] = np.where(fits, compute, np.inf)
    return masked[key]

  def link(same):
    edge = np.array([0.0] + [network.seconds(a, same) for a in out_bytes])
    return edge  # edge[i]: moving block i-1's output; cut i

  links = {True: link(True), False: link(False)}
  none_in, none_out = np.zeros(n + 1), np.zeros(n + 1)
  no_exit = np.full(n + 1, np.inf)

  def cost(s, t, si, so):
    recv_in = none_in if si is None else links[si]
    recv_out = none_out if so is None else np.where(
        np.arange(n + 1) < n, links[so], no_exit)
    return base(s, t) + recv_in[:, None] + recv_out[None, :]

  best, stages = _minmax_search(n, problem.counts, problem.same_node, cost)
  if not stages:
    raise _infeasible(problem, profiles, n, concurrent, optimizer_slots)
  return _plan(stages, problem, profiles, network, concurrent,
               optimizer_slots)


def _plan(stages, problem, profiles, network, concurrent,
          optimizer_slots) -> Plan:
  taken = [iter(m) for m in problem.members]
  devices = tuple(next(taken[t]) for t, _, _ in stages)
  k = len(stages)
  columns = {"forward_s": [], "backward_s": [], "recv_activation_s": [],
             "recv_gradient_s": [], "memory_bytes": [], "param_bytes": [],
             "activation_bytes": []}
  for s, ((_, b, e), d) in enumerate(zip(stages, devices)):
    p = profiles[d.spec.name]
    columns["forward_s"].append(float(sum(p.forward_s[b:e])))
    columns["backward_s"].append(float(sum(p.backward_s[b:e])))
    columns["recv_activation_s"].append(
        0.0 if s == 0 else network.seconds(p.output_bytes[b - 1],
                                           devices[s - 1].node == d.node))
    columns["recv_gradient_s"].append(
        0.0 if s == k - 1 else network.seconds(p.output_bytes[e - 1],
                                               devices[s + 1].node == d.node))
    columns["memory_bytes"].append(
        stage_memory(p, b, e, s, concurrent, optimizer_slots))
    columns["param_bytes"].append(sum(p.param_bytes[b:e]))
    columns["activation_bytes"].append(0 if s == k - 1
                                       else p.output_bytes[e - 1])
  return Plan(boundaries=tuple(b for _, b, _ in stages), devices=devices,
              concurrent=concurrent,
              **{k: tuple(v) for k, v in columns.items()})


def max_concurrent_minibatches(profiles: Mapping[str, Profile],
                               devices: Sequence[Device], *,
                               network: Network = HETPIPE_NETWORK,
                               optimizer_slots: int = 2,
                               limit: int = 64) -> int:
  """:math:`Max_m`: the most minibatches in flight some partition can hold.

  Memory per stage grows with :math:`N_m` (`stage_memory`), so feasibility
  is monotone and a bisection over :math:`1..limit` finds the largest
  :math:`N_m` for which `partition` succeeds (seed 001 §4: "Max_m is
  basically determined by the memory requirement").

  Args:
    profiles: a profile of the model per device type name.
    devices: the virtual worker's devices.
    network: link speeds (they do not change feasibility).
    optimizer_slots: parameter-sized optimizer buffers per stage.
    limit: the largest :math:`N_m` considered.

  Returns:
    :math:`Max_m`, at most `limit`.

  Raises:
    InfeasiblePlanError: not even one minibatch fits.

  References:
    Park et al, HetPipe, 2020, §4 ("Number of Minibatches in the Pipeline").

  Examples:
    >>> from stalepipe.plan.devices import Device, DeviceType
    >>> small = DeviceType("S", 1.0, memory_bytes=100, memory_bandwidth=1.0)
    >>> p = Profile("S", 1, (1.,) * 2, (1.,) * 2, (10,) * 2, (1,) * 2, (10,) * 2)
    >>> two = [Device(small, 0, 0), Device(small, 0, 1)]
    >>> max_concurrent_minibatches({"S": p}, two)
    4
  """
  if limit < 1:
    raise ValueError(f"limit={limit} is invalid; valid: >= 1")

  def fits(m):
    try:
      partition(profiles, devices, concurrent=m, network=network,
                optimizer_slots=optimizer_slots)
    except InfeasiblePlanError:
      return False
    return True

  partition(profiles, devices, concurrent=1, network=network,
            optimizer_slots=optimizer_slots)  # raises with the diagnosis
  low, high = 1, limit + 1  # fits(low), not fits(high) or high beyond limit
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low
