"""One chunk's step of the 2-layer MLP memory (the deep-memory dual form): the fused kernels (:mod:`.chunk`) and
their torch reference (:mod:`.naive`)."""
from atlaslab.kernels.mlp.chunk import mlp_chunk_step

__all__ = ["mlp_chunk_step"]
