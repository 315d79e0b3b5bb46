"""Which stage sits on which device: see `stalepipe.schedules.placement`.

The placement is schedule data (a device-level schedule names its own, and
schedules never import JAX), so it lives with the schedules; the executor
reads it from here.
"""

from stalepipe.schedules.placement import Hop
from stalepipe.schedules.placement import PARTS
from stalepipe.schedules.placement import Placement
from stalepipe.schedules.placement import consecutive
from stalepipe.schedules.placement import for_schedule
from stalepipe.schedules.placement import loop
from stalepipe.schedules.placement import make
from stalepipe.schedules.placement import names
from stalepipe.schedules.placement import v
