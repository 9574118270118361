"""Training and evaluation: one loop for every model and task (:func:`train`), its settings
(:class:`TrainConfig`), checkpoint/resume, and the ``atlaslab train`` command (:mod:`.cli`)."""
from atlaslab.train.config import TrainConfig, lr_at, resolve_train_config
from atlaslab.train.loop import (CHECKPOINT_NAME, TRAINING_REVISION, TrainResult, load_checkpoint, make_optimizer,
                                 resolve_device, revision_changes_training, train)

__all__ = ["CHECKPOINT_NAME", "TRAINING_REVISION", "TrainConfig", "TrainResult", "load_checkpoint", "lr_at",
           "make_optimizer", "resolve_device", "resolve_train_config", "revision_changes_training", "train"]
