"""``common.spare_files``: the server's stores write over the files they released at the last commit instead of
new ones, hand each spare to one writer, delete the spares nobody wrote over when they next release files, and
never write over a spare another name still reaches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from broker_server.rounds.update_store import UpdateStore
from common.files import atomic_write
from common.spare_files import SpareFiles
from flcore.agent_models import ModelBank
from models.weights import TensorSpec

SPEC = (TensorSpec("w", "float32", (1000,)),)


def test_each_spare_goes_to_one_writer_and_untaken_ones_go_at_the_next_release(tmp_path):
    released = []
    for i in range(40):
        released.append(tmp_path / f"model-{i}")
        released[-1].write_bytes(b"x")
    spares = SpareFiles(tmp_path)
    spares.release(released)
    assert not any(p.exists() for p in released) and len(list(spares.directory.iterdir())) == 40
    with ThreadPoolExecutor(8) as pool:
        taken = [p for p in pool.map(lambda _: spares.take(), range(50)) if p is not None]
    assert len(taken) == len(set(taken)) == 40 and spares.take() is None
    spares.release([tmp_path / "gone"])  # a file another writer took: skipped
    later = tmp_path / "later"
    later.write_bytes(b"y")
    spares.release([later])  # the 40 handed out were not written over: deleted, only the new one is a spare
    assert [p.read_bytes() for p in spares.directory.iterdir()] == [b"y"]
    spares.release([])  # a save that releases nothing keeps the spares
    assert SpareFiles(tmp_path).take() is not None  # after a restart the folder's spares are used first


def test_the_model_bank_writes_the_next_round_over_the_models_it_released(tmp_path):
    bank = ModelBank(tmp_path)
    rng = np.random.default_rng(0)
    old = [bank.writer(1, f"agent-{i}", SPEC, {}).keep(rng.standard_normal(1000, dtype=np.float32)) for i in range(3)]
    kept_vector = np.array(bank.vector(old[0]))
    inodes = {bank.path(h).stat().st_ino for h in old}
    bank.keep_only({old[0]})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "r1"]
    vectors = [rng.standard_normal(1000, dtype=np.float32) for _ in range(3)]
    new = [bank.writer(2, f"agent-{i}", SPEC, {}).keep(vector) for i, vector in enumerate(vectors)]
    for holding, vector in zip(new, vectors, strict=True):
        np.testing.assert_array_equal(bank.vector(holding), vector)
    assert len({bank.path(h).stat().st_ino for h in new} & inodes) == 2  # the two released files, then a new one
    np.testing.assert_array_equal(bank.vector(old[0]), kept_vector)  # the model still named: untouched
    bank.keep_only(set(new))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "r2"]


def test_the_update_store_writes_the_next_round_over_the_last_ones(tmp_path):
    store = UpdateStore(tmp_path)
    store.put(1, "agent-a", b"a round-1 update")
    inode = store.path(1, "agent-a").stat().st_ino
    store.keep_only(1)  # the open round's files stay
    assert store.path(1, "agent-a").exists()
    store.keep_only(None)  # committed
    store.put(2, "agent-b", b"round 2")
    assert store.path(2, "agent-b").read_bytes() == b"round 2" and store.path(2, "agent-b").stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "round-2"]


def test_a_spare_with_another_link_is_not_written_over(tmp_path):
    """A backup made with hard links (``cp -al``) shares the store's files: writing over one would change it."""
    spare = tmp_path / "spare"
    spare.write_bytes(b"a round-1 update")
    backup = tmp_path / "backup"
    backup.hardlink_to(spare)
    target = tmp_path / "round-2" / "agent"
    atomic_write(target, b"round 2", mode=0o600, reuse=spare)
    assert target.read_bytes() == b"round 2" and backup.read_bytes() == b"a round-1 update"
    assert target.stat().st_ino != backup.stat().st_ino and not spare.exists()
