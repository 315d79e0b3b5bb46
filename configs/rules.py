"""Update rules as config fields, each configured as its source runs it.

Not a config of its own: the experiments that compare rules
(`configs/experiments/staleness_depth.py`) take a row of `DEPTH` over their
base (PipeDream with AdamW at the experiment's step size, decoupled weight
decay 0.01, held constant). Each row cites the paper section or the file
and line of the official code behind every setting it changes.
"""

from configs import pipedream_dc
from configs import sapipe

_STALE = {"schedule_kwargs": {"weight_stashing": False}}
_ROTATED = {"mask": "attention_mlp"}

DEPTH = {
    # PipeDream-Flush (Narayanan et al. ICML 2021 §3.2): no staleness.
    "1f1b": {"schedule": "1f1b"},
    # Weight stashing (Narayanan et al. SOSP 2019 §3.3): stage k of S
    # applies gradients S - 1 - k updates old.
    "pipedream": {},
    # SAPipe's prediction option 3 with full DC, lambda 0.2 (seed 004
    # Algorithm 3, §5.1).
    "sapipe_wp": sapipe.RULES["wp3"],
    # Zero bubble's asynchronous schedule: M = S micro-batches a minibatch.
    "zb_async": {"schedule": "zb-async", "remat": "residuals"},
    # PipeMare T1 + T2, gamma 0.5, no stash (Yang et al. MLSys 2021
    # §3.1-3.2). K = 100 updates: the paper and AsyncPP
    # (`main_with_runtime.py` lines 116-119) set it in epochs.
    "pipemare": {**_STALE, "optimizer_wrapper": (
        "PipeMare", {"warmup_steps": 100, "decay": 0.5})},
    # SpecTrain over the pipeline-wide staleness, no stash (Chen et al. 2018
    # §3).
    "spectrain": {**_STALE, "optimizer_wrapper": (
        "SpecTrain", {"staleness": "pipeline"})},
    # SAPipe's full DC (eq. 1, lambda 0.2, adaptive) of the stash each
    # gradient used, per stage (configs/pipedream_dc.py).
    "dc": {"transforms": pipedream_dc.get_config().transforms,
           "optimizer_scope": "stage"},
    # Ajanthan et al.'s NAdam as PluralisResearch/AsyncPP runs it: b1 0.99
    # (`run.bash` --momentum 0.99), psi 0.004 and decoupled decay 0.01
    # (`main_with_runtime.py` lines 64, 68), each stage's raw gradient
    # clipped at 10 (`run.bash` --clip_grad 10; `optim/optimizer.py` lines
    # 196-197 clip one rank's parameters: a stage).
    "nesterov": {"transforms": (("scale_by_async_nesterov", {"b1": 0.99}),),
                 "optimizer": "sgd", "grad_clip_norm": 10.0,
                 "optimizer_scope": "stage"},
    # Basis rotation as joonkyoo/basis-rotation runs it: the attention and
    # MLP kernels rotated, everything else AdamW (`optim/optimizer.py` lines
    # 104-132), b1 0.9, b2 0.999, decay 0.01 (`main_with_runtime.py` lines
    # 64, 68), bases refreshed every 10 steps, "bi", "2nd", each parameter
    # group's raw gradient clipped at 1 per stage (README's command
    # --clip_grad 1; `optim/optimizer.py` lines 284-286).
    "basis_rotation": {
        "transforms": (("clip_by_group_norm", {"max_norm": 1.0, **_ROTATED}),
                       ("scale_by_basis_rotation", _ROTATED)),
        "optimizer": "sgd", "optimizer_scope": "stage"},
}
