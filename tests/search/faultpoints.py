"""Fault points for the fault tests: a trial that stops at a training step until the test lets it go.

An experiment that lists ``imports: [faultpoints]`` (with this folder on ``PYTHONPATH`` for the driver and the Ray
workers) can use the task ``held_mqar``: MQAR whose training batch of each step in ``hold_steps`` is handed out
only once the file ``<hold_dir>/release.<step>``, written by the test, exists. The first process to reach such a step
writes ``<hold_dir>/held.<step>`` (its pid and Ray node id) and waits; a process that arrives later (the trial
resumed after the test interrupted it) goes on at once. So a test injects its fault on an event — "the trial is
at step N and cannot move" — never after a number of seconds, and the trial's data (a pure function of the step)
is the same as plain MQAR's.
"""
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from atlaslab.registry import register
from atlaslab.tasks.mqar import MQAR

POLL_S = 0.05


def hold(hold_dir: str, step: int) -> None:
    """At most once per ``hold_dir`` and step: mark ``held.<step>`` and wait for ``release.<step>``."""
    d = Path(hold_dir)
    try:
        fd = os.open(d / f"held.{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    node = ""
    try:
        import ray
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:
        pass
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "node_id": node}, f)
    while not (d / f"release.{step}").exists():
        time.sleep(POLL_S)


def release(hold_dir, step: int) -> None:
    (Path(hold_dir) / f"release.{step}").write_text("go")


def wait_held(hold_dir, step: int, proc=None, timeout: float = 600) -> dict:
    """Wait for the event "a trial is held at ``step``" (``timeout`` only guards a broken test: it fails it)
    and return what the held process wrote; fails at once if ``proc`` (the driver) has ended."""
    path = Path(hold_dir) / f"held.{step}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file():
            text = path.read_text()
            if text.endswith("}"):
                return json.loads(text)
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the driver ended (rc {proc.returncode}) before a trial reached step {step}")
        time.sleep(POLL_S)
    raise AssertionError(f"no trial reached step {step} within {timeout} s")


@register("task", "held_mqar")
class HeldMQAR(MQAR):
    """MQAR whose training batches of ``hold_steps`` wait for the test (see the module docstring)."""

    @dataclass
    class Config(MQAR.Config):
        hold_dir: str = ""
        hold_steps: List[int] = field(default_factory=list)

    def batch(self, split, step, batch_size, seed=0, length=None):
        if split == "train" and self.cfg.hold_dir and step in self.cfg.hold_steps:
            hold(self.cfg.hold_dir, step)
        return super().batch(split, step, batch_size, seed=seed, length=length)
