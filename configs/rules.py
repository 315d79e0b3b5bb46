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
    # PipeDream's rules per chunk on device-level placements, two chunks a
    # device (docs/schedules.md: chunk s applies gradients d_s updates old,
    # d_s = P - ceil(s/2) on the V, about half of stage-level PipeDream's
    # S - 1 - s; the loop's map there too). Only at S >= 2.
    "pipedream_v": {"schedule": "pipedream-v", "placement": "v",
                    "num_chunks": 2},
    "pipedream_interleaved": {"schedule": "pipedream-interleaved",
                              "placement": "loop", "num_chunks": 2},
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
    # Gap-Aware (Barkai et al. ICLR 2020) as saareliad/FTPipe runs it on its
    # language models: the AdamW form over weight stashing
    # (`pipe/configs/lm/wt2/gpt2/tied/ws_ga.json` lines 5-11; its last stage
    # is fresh, so phi = 1 there), weight decay 0 and eps 1e-8
    # (`common.json` lines 24-31), betas (0.9, 0.999)
    # (`optimizers/adamw_record.py` line 33). The transform mirrors the
    # optimizer's learning rate and moments.
    "gap_aware": {"transforms": (("gap_aware", {}),), "weight_decay": 0.0},
    # Muon with optax.contrib.muon's defaults (0.2.8 `contrib/_muon.py`:
    # quintic coefficients line 42, 5 steps and beta 0.95 lines 531-532,
    # Nesterov line 540, Adam betas 0.9/0.999 lines 545-546 for the leaves
    # it leaves out): Newton-Schulz on the attention and MLP kernels, the
    # embeddings, head, norms and biases to Adam, as the Muon recipe runs
    # it. Per stage: it reduces over one leaf at most.
    "muon": {"optimizer": "muon", "optimizer_kwargs": {
        "mask": "attention_mlp"}, "optimizer_scope": "stage"},
    # marin's dc_asgd_ema corrector (marin-community/marin `delay_optim.py`
    # lines 26-29, 235-238): g + lam * EMA(g^2) * (x_now - x_stash), lam 1.0
    # and decay 0.99 (lines 157-158, 318-319), before the inner optimizer
    # (lines 250-258).
    "dc_asgd_ema": {"transforms": (("dc_asgd_ema", {}),)},
    # marin's weight_pred corrector (`delay_optim.py` lines 35-43, 353-382):
    # the weights extrapolated along the last applied update over the
    # staleness, pred_scale 1.0 (line 323), on the stashing pipeline.
    "weight_pred": {"optimizer_wrapper": ("SpecTrain", {
        "staleness": "minibatch", "horizon_scale": 1.0})},
}
