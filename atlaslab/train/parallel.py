"""Data-parallel training: the N processes of a ``torch.distributed`` group train one model with the one loop.

    dist.init_process_group("gloo")         # Ray Train's TorchTrainer does this on every worker
    result = train(model, task, cfg, parallel=DataParallel())    # cfg.batch_size is the global batch

What :func:`atlaslab.train.train` does differently with ``parallel``:

* data: rank r of N trains on rows ``[r·B/N, (r+1)·B/N)`` of the batch of every step. ``task.batch`` is a
  pure function of the step, so every rank builds the same global batch ``[B, T]`` and keeps its shard
  ``[B/N, T]``; there is no sampler and nothing to resume. A task whose :meth:`Task.shard_stream` says so (a
  streamed corpus) reads only its share of the data on each rank instead and builds only the rank's ``B/N``
  rows; the checkpoint then keeps every rank's data cursor (gathered to rank 0), and a resumed run must have
  the same N.
* gradients: the module is wrapped in ``DistributedDataParallel``, which averages the gradients over the
  ranks (gloo on CPU, NCCL on GPU). Rank r's loss ``ℓ_r`` is a mean over its ``n_r`` scored tokens
  (:meth:`Task.loss_weight`); it is scaled by ``N·n_r/n`` (``n = Σ n_r``, one all-reduce before the forward
  pass), so the averaged gradient is exactly that of the global mean ``Σ_r n_r·ℓ_r / n``, the loss one process
  computes on the whole batch, whatever the shards' token counts. With ``train.micro_batch_size`` each
  micro-batch of the shard is scaled the same way by its own token count and DDP all-reduces once, after the
  last micro-batch's backward pass.
* the logged loss is that global mean, the same on every rank, so every rank sees a divergence at the same
  step; the gradient norm is taken after the all-reduce, so clipping is the same everywhere too.
* rank 0 alone evaluates (the metrics are broadcast, so every rank makes the same early-stop decision), calls
  the callback (its stop is broadcast) and writes the checkpoint; every rank resumes from the checkpoint in
  its own ``checkpoint_dir``.

Parameters are then bitwise the same on every rank; :meth:`DataParallel.digests` checks it.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from atlaslab.train.config import check_batch_split
from atlaslab.tasks.base import Batch


class DataParallel:
    """This process's place in a data-parallel group (the default group unless ``group`` is given)."""

    def __init__(self, group: Any = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DataParallel needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group, or a Ray Train worker).")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device: Optional[torch.device] = None     # set by wrap(): where collectives put their tensors

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that evaluates, reports and writes checkpoints."""
        return self.rank == 0

    def check_batch_size(self, batch_size: int, path: str = "train.batch_size") -> None:
        """The global batch must split into equal shards."""
        check_batch_split(batch_size, self.world_size, path)

    def shard(self, batch: Batch) -> Batch:
        """This rank's rows of the global batch (``[B, T]`` → ``[B/N, T]``, meta ``[B]`` → ``[B/N]``)."""
        b = len(batch) // self.world_size
        return batch.rows(slice(self.rank * b, (self.rank + 1) * b))

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``module`` in ``DistributedDataParallel`` (which broadcasts rank 0's parameters and buffers first).

        Every parameter must take part in every step's loss (DDP's ``find_unused_parameters=False``; every
        preset does)."""
        from torch.nn.parallel import DistributedDataParallel
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, process_group=self.group)

    def all_sum(self, values: Sequence[float]) -> List[float]:
        """Each of ``values`` summed over the ranks (one float64 all-reduce), e.g. the scored tokens of the global
        batch and the sum of the ranks' ``n_r·ℓ_r``, from which the training step takes the global mean loss."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self._object_device())
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a picklable object)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group, device=self._object_device())
        return box[0]

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def digests(self, module: nn.Module) -> List[str]:
        """Every rank's digest of ``module``'s state (parameters and buffers, bitwise), in rank order."""
        h = hashlib.sha256()
        for name, t in sorted(module.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return [str(d) for d in self.gather(h.hexdigest()[:16])]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _object_device(self) -> Optional[torch.device]:
        # NCCL moves pickled objects through the GPU; gloo through the CPU
        return self.device if (self.device is not None and self.device.type == "cuda") else None


__all__ = ["DataParallel"]
