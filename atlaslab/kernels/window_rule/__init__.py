"""The Omega-window rule (c ≥ 1 window slots per token, b = 1): chunk-parallel kernels (:mod:`.chunk`), the
token-by-token kernel (:mod:`.fused_recurrent`), the slot gather and the torch reference (:mod:`.naive`)."""
from atlaslab.kernels.window_rule.chunk import chunk_window_rule
from atlaslab.kernels.window_rule.fused_recurrent import fused_recurrent_window_rule
from atlaslab.kernels.window_rule.naive import MAX_WINDOW, window_slots

__all__ = ["MAX_WINDOW", "chunk_window_rule", "fused_recurrent_window_rule", "window_slots"]
