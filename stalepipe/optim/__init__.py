"""stalepipe.optim: staleness and its compensation as optax transforms.

Stale gradients (PipeSGD), delay compensation (DC-ASGD, SAPipe eq. 1), weight
prediction (SAPipe Algorithm 3, SpecTrain), HetPipe wave accumulation, the
staleness-aware learning rate, SDPipe's variance-reduced Adam, SAPipe's
partial-staleness solver, the asynchronous-pipeline Nesterov method and
basis rotation. Chain them with any optax optimizer; none of them knows
about pipelines.
"""

from stalepipe import registry
from stalepipe.optim._adam_variance import scale_by_variance_reduced_adam
from stalepipe.optim._adam_variance import ScaleByVarianceReducedAdamState
from stalepipe.optim._basis_rotation import basis_rotation_adam
from stalepipe.optim._basis_rotation import scale_by_basis_rotation
from stalepipe.optim._basis_rotation import ScaleByBasisRotationState
from stalepipe.optim._clipping import clip_by_group_norm
from stalepipe.optim._delay_compensation import compensate
from stalepipe.optim._delay_compensation import dc_asgd_ema
from stalepipe.optim._delay_compensation import delay_compensation
from stalepipe.optim._delay_compensation import DelayCompensationState
from stalepipe.optim._gap_aware import gap_aware
from stalepipe.optim._gap_aware import GapAwareState
from stalepipe.optim._masks import attention_mlp
from stalepipe.optim._masks import mask
from stalepipe.optim._masks import MASKS
from stalepipe.optim._nesterov import delay_aware_momentum
from stalepipe.optim._nesterov import scale_by_async_nesterov
from stalepipe.optim._nesterov import ScaleByAsyncNesterovState
from stalepipe.optim._partial_staleness import minimal_stale_prefix
from stalepipe.optim._pipemare import PipeMare
from stalepipe.optim._pipemare import PipeMareState
from stalepipe.optim._spectrain import SpecTrain
from stalepipe.optim._spectrain import SpecTrainState
from stalepipe.optim._stale import stale_gradients
from stalepipe.optim._stale import stale_optimizer
from stalepipe.optim._stale import StaleGradientsState
from stalepipe.optim._stale import StaleOptimizerState
from stalepipe.optim._staleness_lr import scale_by_staleness
from stalepipe.optim._staleness_lr import ScaleByStalenessState
from stalepipe.optim._waves import wave_accumulation
from stalepipe.optim._waves import wave_complete
from stalepipe.optim._waves import WaveAccumulationState
from stalepipe.optim._weight_prediction import spectrain_prediction
from stalepipe.optim._weight_prediction import WeightPrediction
from stalepipe.optim._weight_prediction import WeightPredictionState

__all__ = (
    "attention_mlp",
    "basis_rotation_adam",
    "clip_by_group_norm",
    "compensate",
    "dc_asgd_ema",
    "delay_compensation",
    "delay_aware_momentum",
    "DelayCompensationState",
    "gap_aware",
    "GapAwareState",
    "mask",
    "MASKS",
    "minimal_stale_prefix",
    "PipeMare",
    "PipeMareState",
    "scale_by_async_nesterov",
    "scale_by_basis_rotation",
    "scale_by_staleness",
    "scale_by_variance_reduced_adam",
    "ScaleByAsyncNesterovState",
    "ScaleByBasisRotationState",
    "ScaleByStalenessState",
    "ScaleByVarianceReducedAdamState",
    "SpecTrain",
    "SpecTrainState",
    "spectrain_prediction",
    "stale_gradients",
    "stale_optimizer",
    "StaleGradientsState",
    "StaleOptimizerState",
    "wave_accumulation",
    "wave_complete",
    "WaveAccumulationState",
    "WeightPrediction",
    "WeightPredictionState",
)

# What a config may name: transforms chain before the optimizer; a wrapper
# takes the whole chain as its `optimizer`.
TRANSFORMS = registry.Registry("transform", {
    "stale_gradients": stale_gradients,
    "clip_by_group_norm": clip_by_group_norm,
    "delay_compensation": delay_compensation,
    "dc_asgd_ema": dc_asgd_ema,
    "scale_by_staleness": scale_by_staleness,
    "scale_by_variance_reduced_adam": scale_by_variance_reduced_adam,
    "scale_by_async_nesterov": scale_by_async_nesterov,
    "scale_by_basis_rotation": scale_by_basis_rotation,
    "basis_rotation_adam": basis_rotation_adam,
    "wave_accumulation": wave_accumulation,
    "gap_aware": gap_aware,
})
# The transforms that turn a gradient into an update direction (an
# optimizer's scaling), and Gap-Aware, whose source divides the L2 term by
# its penalty too; the others correct the gradient itself. A config's L2
# decay joins the gradient before the first of these.
DIRECTIONS = frozenset({
    "scale_by_variance_reduced_adam", "scale_by_async_nesterov",
    "scale_by_basis_rotation", "basis_rotation_adam", "gap_aware"})
# Transforms that keep the optimizer's own statistics: a config gives them
# the optimizer's learning rate and moment settings (`train.optimizers.make`).
MIRRORS = frozenset({"gap_aware"})
WRAPPERS = registry.Registry("optimizer wrapper", {
    "WeightPrediction": WeightPrediction,
    "SpecTrain": SpecTrain,
    "PipeMare": PipeMare,
    "stale_optimizer": stale_optimizer,
}, filled=("optimizer",))


def names() -> tuple[str, ...]:
  """The transforms `make` builds."""
  return TRANSFORMS.names()


def make(name: str, **kwargs):
  """The transform registered under `name`, e.g. `make("stale_gradients",
  delay=1)`."""
  return TRANSFORMS.make(name, **kwargs)
