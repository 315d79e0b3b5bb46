"""Closed forms from the source papers that the schedules are tested against."""


def gpipe_bubble(num_stages: int, num_microbatches: int) -> float:
  r"""GPipe's bubble fraction: idle slots over all slots.

  .. math:: \frac{S - 1}{M + S - 1}

  References:
    Huang et al, GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism <https://arxiv.org/abs/1811.06965>, 2019
  """
  return (num_stages - 1) / (num_microbatches + num_stages - 1)
