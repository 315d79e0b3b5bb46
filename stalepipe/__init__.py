"""stalepipe: staleness-compensated pipeline training in JAX.

Three planes (see DESIGN.md): schedules as data (`stalepipe.schedules`), update
rules as optax transforms (`stalepipe.optim`), and executors that run a
schedule (`stalepipe.pipeline`), plus synchronisation across pipelines
(`stalepipe.sync`), a cluster simulator (`stalepipe.sim`) and planners
(`stalepipe.plan`).
"""

from stalepipe import data
from stalepipe import models
from stalepipe import optim
from stalepipe import pipeline
from stalepipe import plan
from stalepipe import schedules
from stalepipe import sim
from stalepipe import sync
from stalepipe import theory

__version__ = "0.1.0"
