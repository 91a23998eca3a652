"""``common.files.atomic_write``: the new bytes or the old ones, never a mix, and no temporary file left behind; the
agent's progress store keeps only its newest update."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from common.files import atomic_write
from participant.progress import ProgressStore


def test_parts_are_written_in_order_into_a_new_folder(tmp_path):
    array = np.arange(6, dtype=np.float32)
    target = tmp_path / "new" / "deeper" / "model.bin"
    atomic_write(target, (b"header", memoryview(array), bytearray(b"!")), mode=0o600)
    data = target.read_bytes()
    assert data[:6] == b"header" and data[-1:] == b"!"
    np.testing.assert_array_equal(np.frombuffer(data[6:-1], np.float32), array)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["model.bin"]


def test_a_large_buffer_and_an_empty_one(tmp_path):
    big = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    atomic_write(tmp_path / "big", memoryview(big))
    assert (tmp_path / "big").read_bytes() == big.tobytes()
    atomic_write(tmp_path / "big", b"")
    assert (tmp_path / "big").read_bytes() == b""
    atomic_write(tmp_path / "big", (memoryview(np.zeros((0, 4), np.float32)), b"end"))
    assert (tmp_path / "big").read_bytes() == b"end"


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    target = tmp_path / "state.json"
    atomic_write(target, b"old")
    with pytest.raises(TypeError):
        atomic_write(target, (b"new", object()))  # type: ignore[arg-type]  # not a buffer: fails mid-write
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_progress_store_keeps_only_the_newest_update(tmp_path):
    store = ProgressStore(tmp_path)
    (tmp_path / "update-notes.txt").write_text("not an update")
    for number in (3, 4, 5):
        store.store_update(number, bytes([number]) * 8)
    assert store.stored_update(5) == bytes([5]) * 8 and store.stored_update(4) is None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("update")) == [
        "update-notes.txt",
        "update-r5.safetensors",
    ]


def test_a_reused_spare_is_written_over_in_place_and_takes_the_new_bytes_mode_and_length(tmp_path):
    spare = tmp_path / "spare"
    spare.write_bytes(b"old bytes of a released model, longer than the new ones")
    spare.chmod(0o600)
    inode = spare.stat().st_ino
    target = tmp_path / "new-folder" / "model.bin"
    atomic_write(target, (b"new", b"!"), mode=0o644, reuse=spare)
    assert target.read_bytes() == b"new!" and not spare.exists()
    assert target.stat().st_ino == inode  # the spare's blocks, not a new file's
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # never wider than the spare was
    short = tmp_path / "short"
    short.write_bytes(b"x")
    atomic_write(target, b"longer than the spare", mode=0o600, reuse=short)
    assert target.read_bytes() == b"longer than the spare"
    atomic_write(target, b"spare gone", mode=0o600, reuse=tmp_path / "taken-by-another-writer")
    assert target.read_bytes() == b"spare gone"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["model.bin", "new-folder"]
