"""TIR attention kernels: generators from a validated config to a TIR PrimFunc.

Each generator takes an `AttentionConfig` (and optionally a schedule) and returns a PrimFunc
whose parameters follow the attention-backend contract (docs/interface.md).
"""

from .build import build as build
from .common import EMPTY_LSE as EMPTY_LSE
from .config import AttentionConfig as AttentionConfig
from .config import RopeScaling as RopeScaling
from .config import default_sm_scale as default_sm_scale
from .decode import paged_decode as paged_decode
from .schedules import DecodeSchedule as DecodeSchedule
from .schedules import choose_decode_schedule as choose_decode_schedule
