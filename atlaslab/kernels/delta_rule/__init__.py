"""The linear-memory delta / Hebbian rule (c = 1): chunk-parallel kernels (:mod:`.chunk`, training), the
token-by-token kernel (:mod:`.fused_recurrent`, decoding) and their torch reference (:mod:`.naive`)."""
from atlaslab.kernels.delta_rule.chunk import chunk_delta_rule
from atlaslab.kernels.delta_rule.fused_recurrent import fused_recurrent_delta_rule

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule"]
