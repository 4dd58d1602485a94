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
from .merge import merge_state as merge_state
from .page_ops import compact_copy as compact_copy
from .page_ops import copy_single_page as copy_single_page
from .page_ops import debug_get_kv as debug_get_kv
from .page_ops import transpose_append as transpose_append
from .rotary import split_rotary as split_rotary
from .schedules import CopySchedule as CopySchedule
from .schedules import choose_copy_schedule as choose_copy_schedule
from .prefill import paged_prefill as paged_prefill
from .prefill import ragged_prefill as ragged_prefill
from .schedules import PrefillSchedule as PrefillSchedule
from .schedules import choose_prefill_schedule as choose_prefill_schedule
