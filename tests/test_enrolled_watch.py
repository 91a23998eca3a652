"""``security.enrolled_watch``: the keyring follows the enrolled folder (new file = enrol; vanished,
re-keyed or unparsable = drop; the same key copied again = nothing), for the server and for a peer."""

from __future__ import annotations

import logging
import os

import pytest

from security.enrolled_watch import WATCH_INTERVAL_S, EnrolledWatch, EnrolmentChanges, snapshot
from security.keys import Identity, Keyring, enroll, revoke

log = logging.getLogger("test.enrolled_watch")


@pytest.fixture
def folder(tmp_path):
    enrolled = tmp_path / "enrolled"
    for name in ("p1", "p2"):
        enroll(enrolled, Identity.generate(name).public)
    return enrolled


def touch_later(path):
    """A rewrite the size/mtime comparison must see even on a coarse clock."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def test_the_first_poll_loads_the_folder_and_later_polls_follow_it(folder):
    keyring = Keyring()
    watch = EnrolledWatch(folder, keyring, role="peer", log=log)
    first = watch.poll(0.0)
    assert sorted(p.name for p in first.enrolled) == ["p1", "p2"] and keyring.names() == ["p1", "p2"]
    assert not watch.poll(5.0)  # nothing changed

    p3 = Identity.generate("p3").public
    enroll(folder, p3)
    assert not watch.poll(5.0 + WATCH_INTERVAL_S / 2)  # at most once per interval
    assert [p.name for p in watch.poll(10.0).enrolled] == ["p3"] and "p3" in keyring

    revoke(folder, "p2")
    assert watch.poll(15.0) == EnrolmentChanges(revoked=("p2",)) and "p2" not in keyring


def test_a_preloaded_keyring_is_not_reported_again(folder):
    keyring = Keyring.load_dir(folder)
    watch = EnrolledWatch(folder, keyring, role="agent", log=log, loaded=True)
    assert not watch.poll(0.0) and keyring.names() == ["p1", "p2"]


def test_a_new_key_replaces_the_old_and_the_same_key_copied_again_changes_nothing(folder):
    keyring = Keyring()
    watch = EnrolledWatch(folder, keyring, role="peer", log=log)
    watch.poll(0.0)
    old = keyring.get("p1")
    (folder / "p1.pub").write_bytes((folder / "p1.pub").read_bytes() + b"\n")  # same key, rewritten
    touch_later(folder / "p1.pub")
    assert not watch.poll(2.0) and keyring.get("p1") == old

    new = Identity.generate("p1").public
    new.save(folder / "p1.pub")
    touch_later(folder / "p1.pub")
    changes = watch.poll(4.0)
    assert changes.rekeyed == ("p1",) and not changes.revoked and [p.name for p in changes.enrolled] == ["p1"]
    assert keyring.get("p1").raw() == new.raw() != old.raw()


def test_unparsable_or_misnamed_files_drop_the_key_and_are_refused_until_fixed(folder, caplog):
    keyring = Keyring()
    watch = EnrolledWatch(folder, keyring, role="peer", log=log)
    watch.poll(0.0)
    good = (folder / "p1.pub").read_bytes()
    (folder / "p1.pub").write_text("not a key\n")
    touch_later(folder / "p1.pub")
    with caplog.at_level(logging.ERROR, logger=log.name):
        assert watch.poll(2.0) == EnrolmentChanges(revoked=("p1",))
    assert "p1" not in keyring and "enrolment refused peer=p1" in caplog.text

    Identity.generate("intruder").public.save(folder / "p9.pub")  # a file named for another key
    with caplog.at_level(logging.ERROR, logger=log.name):
        assert not watch.poll(4.0)
    assert "p9" not in keyring and "intruder" not in keyring and "holds the key of 'intruder'" in caplog.text

    (folder / "p1.pub").write_bytes(good)  # fixed
    touch_later(folder / "p1.pub")
    assert [p.name for p in watch.poll(6.0).enrolled] == ["p1"] and "p1" in keyring


def test_a_missing_folder_holds_no_keys(tmp_path):
    keyring = Keyring()
    assert not EnrolledWatch(tmp_path / "absent", keyring, role="peer", log=log).poll(0.0) and len(keyring) == 0


def test_the_folder_snapshot_lists_the_pub_files_as_glob_would(tmp_path):
    """The watch's look at the folder (``os.scandir``, for a server polling a thousand files every second) sees
    what ``Path.glob("*.pub")`` sees: hidden ``.pub`` files and folders named so too, no temporary or other files."""
    for name in ("a.pub", "b.c.pub", ".hidden.pub", "x.txt", ".a.pub.1234.tmp", "pub"):
        (tmp_path / name).write_text("k")
    (tmp_path / "folder.pub").mkdir()
    stats = {p.stem: (p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.glob("*.pub")}
    assert snapshot(tmp_path) == stats and set(stats) == {"a", "b.c", ".hidden", "folder"}
    assert snapshot(tmp_path / "missing") == {}
