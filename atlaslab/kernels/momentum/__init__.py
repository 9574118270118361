"""A linear memory trained by momentum GD at semantic chunk size b: the chunk kernels (:mod:`.chunk`, 2 ≤ b ≤ 64),
the token-by-token kernel (:mod:`.fused_recurrent`, any b, decoding from a cached state) and their torch
references (:mod:`.naive`)."""
from atlaslab.kernels.momentum.chunk import chunk_momentum
from atlaslab.kernels.momentum.fused_recurrent import fused_recurrent_momentum

__all__ = ["chunk_momentum", "fused_recurrent_momentum"]
