r"""DualPipeV: DeepSeek's V-shaped schedule, overlapped forward-and-backward.

On the V placement (device r holds chunks r and 2P - 1 - r), each device
pairs a forward of one chunk with a backward of the other in one unit (F&B)
in the steady state, in the order of DeepSeek's `DualPipeV.step`; it needs
M >= 2P micro-batches. Its bubble is (P - 1)(F&B + B - 3W) and every device
holds 2P + 1 micro-batches (DualPipe README). Synchronous: it trains what
1F1B trains.

Run:
  python launch.py --config=configs/dualpipev.py --workdir=runs/dualpipev

References:
  DeepSeek-AI, DualPipe <https://github.com/deepseek-ai/DualPipe>
  (`dualpipe/dualpipev.py`); DeepSeek-V3 Technical Report
  <https://arxiv.org/abs/2412.19437>, 2024, §3.2.1.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = default.get_config(arg)
  config.update(schedule="dualpipev", placement="v", num_stages=8,
                num_chunks=2, num_microbatches=8, microbatch_size=4,
                remat="residuals")  # M >= 2P = 8; 32 examples a replica
  config.model_kwargs.num_hidden_layers = 7  # a block a chunk
  return config
