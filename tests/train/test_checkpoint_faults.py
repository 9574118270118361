"""Torn checkpoints: a truncated or corrupted ``checkpoint.pt`` resumes from the previous one, says so, and never
trains on garbage (:mod:`atlaslab.train.checkpoint`)."""
import logging
import zipfile

import pytest
import torch

from atlaslab.tasks import build_task
from atlaslab.train import train
from atlaslab.train import checkpoint as ckf
from test_train import SMALL_TASK, SMALL_TRAIN, Killed, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_tensor_byte(path):
    """One bit flipped inside the largest tensor record: the archive still opens and ``torch.load`` alone would
    load it (only the record's CRC-32 tells)."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)
    data = bytearray(path.read_bytes())
    at = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.compress_size // 2
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def killed_at(step, tmp_path):
    def kill(metrics, s):
        if s >= step:
            raise Killed()
    with pytest.raises(Killed):
        train(tiny_model(), build_task(SMALL_TASK), SMALL_TRAIN, callback=kill, checkpoint_dir=tmp_path)


@pytest.mark.parametrize("tear", [truncate, flip_a_tensor_byte])
def test_a_torn_checkpoint_resumes_from_the_previous_one_to_the_same_result(tmp_path, tear, caplog):
    task = build_task(SMALL_TASK)
    ref = train(tiny_model(), task, SMALL_TRAIN)
    killed_at(17, tmp_path)                                    # checkpoints of steps 10 (prev) and 15 (last)
    last, prev = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.prev.pt"
    assert ckf.load(last)["state"]["step"] == 15 and ckf.load(prev)["state"]["step"] == 10
    tear(last)
    with pytest.raises(ckf.CorruptCheckpoint):
        ckf.load(last)
    with caplog.at_level(logging.WARNING, logger="atlaslab.train"):
        res = train(tiny_model(seed=99), task, SMALL_TRAIN, checkpoint_dir=tmp_path)
    assert res.resumed_from == 10
    assert "checkpoint.pt" in res.checkpoint_fallback and "checkpoint.prev.pt (step 10)" in res.checkpoint_fallback
    assert any("torn checkpoint" in r.getMessage() for r in caplog.records)
    assert res.metrics == ref.metrics and res.history == ref.history          # nothing trained on the torn file
    for p, q in zip(res.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)


def test_both_checkpoints_torn_is_an_error_naming_both(tmp_path):
    killed_at(17, tmp_path)
    truncate(tmp_path / "checkpoint.pt")
    flip_a_tensor_byte(tmp_path / "checkpoint.prev.pt")
    with pytest.raises(ckf.CorruptCheckpoint, match=r"checkpoint\.pt .*the previous one is torn too: .*"
                                                    r"checkpoint\.prev\.pt.*CRC-32"):
        train(tiny_model(), build_task(SMALL_TASK), SMALL_TRAIN, checkpoint_dir=tmp_path)


def test_a_file_that_is_not_a_checkpoint_is_torn(tmp_path):
    torch.save({"model": {}}, tmp_path / "x.pt")               # a valid archive without the loop's keys
    with pytest.raises(ckf.CorruptCheckpoint, match="lacks version"):
        ckf.load(tmp_path / "x.pt", required=("version", "model"))
    torch.save([1, 2], tmp_path / "y.pt")
    with pytest.raises(ckf.CorruptCheckpoint, match="holds a list"):
        ckf.load(tmp_path / "y.pt")


def test_save_keeps_the_previous_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "checkpoint.pt"
    for step in range(3):
        ckf.save({"step": step}, path)
    assert ckf.load(path)["step"] == 2 and ckf.load(ckf.previous_path(path))["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]
    ckf.remove(path)
    assert not any(tmp_path.iterdir())
