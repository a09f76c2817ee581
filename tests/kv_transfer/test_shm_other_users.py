"""Finding 7 of issue 52: every receiver's `sweep_stale` walked all of /dev/shm every 10 s, so another
local user's 300k empty files there raised an idle decode worker's CPU 0.95 -> 3.57 s per 10 s. Segments
now live in this user's 0700 directory (/dev/shm/tandem-<uid>) and the sweep walks only that: another
user's files in /dev/shm are neither visited nor touched, and a directory of that name another user made
first is refused (the pages then go as frames)."""

from __future__ import annotations

import os
import secrets
import stat
import time

import pytest

from kv_transfer import shm_segment
from kv_transfer.shm_segment import PREFIX, SHM_DIR, SHM_ROOT, Segment, _pid_namespace, sweep_stale
from tests.helpers.other_user import OTHER_USER, as_other, other_user

FLOOD = 50_000  # the finding's 300k, scaled down: the sweep's work must not depend on it at all


def _dead_pid() -> int:
    pid = 4_000_000  # above any pid_max this kernel allows by default: no such process
    assert not os.path.exists(f"/proc/{pid}")
    return pid


@pytest.fixture
def flood():
    """FLOOD empty files of the other user in /dev/shm, named as segments of a dead creator of our pid
    namespace (the names the old sweep judged, one /proc lookup and lstat each); removed afterwards."""
    other_user()
    stem = f"{PREFIX}{_pid_namespace()}-{_dead_pid()}-0-"
    names = [f"{stem}{i:032d}" for i in range(1, FLOOD + 1)]
    try:
        made = as_other(f"cd {SHM_ROOT} && seq -f '{stem}%032.0f' 1 {FLOOD} | xargs touch", timeout_s=300)
        assert made.returncode == 0, made.stderr[-2000:]
        assert os.path.exists(os.path.join(SHM_ROOT, names[-1]))
        yield names
    finally:
        for name in names:
            try:
                os.unlink(os.path.join(SHM_ROOT, name))
            except FileNotFoundError:
                pass


def test_a_flood_of_another_users_files_is_not_swept(flood):
    mine = Segment.create(1 << 20)  # makes our directory, as any sender does
    try:
        assert stat.S_IMODE(os.lstat(SHM_DIR).st_mode) == 0o700 and os.lstat(SHM_DIR).st_uid == os.geteuid()
        assert os.path.dirname(os.path.join(SHM_DIR, mine.name)) == SHM_DIR
        start = time.process_time()
        swept = sweep_stale()
        cpu_s = time.process_time() - start
        ours = len(os.listdir(SHM_DIR))
        assert swept.visited == ours and swept.visited < 1000, swept.visited  # none of the FLOOD
        assert swept.removed == ()
        owner = other_user().pw_uid
        assert all(os.lstat(os.path.join(SHM_ROOT, n)).st_uid == owner for n in flood[::997])  # untouched
        print(f"one sweep with {FLOOD} files of {OTHER_USER} in {SHM_ROOT}: {ours} entries, {cpu_s * 1e3:.2f} ms CPU")
    finally:
        mine.close()


def test_a_directory_another_user_made_first_is_refused(monkeypatch):
    other = other_user()
    taken = os.path.join(SHM_ROOT, f"tandem-{os.geteuid()}-taken-{secrets.token_hex(4)}")
    made = as_other(f"mkdir -m 0777 {taken}")
    assert made.returncode == 0, made.stderr
    try:
        assert os.lstat(taken).st_uid == other.pw_uid
        monkeypatch.setattr(shm_segment, "SHM_DIR", taken)  # as if it were this user's name
        with pytest.raises(PermissionError, match="not a private directory of this user"):
            shm_segment.segment_dir()
        assert shm_segment.host_identity() is None  # so no receiver offers shared memory, no sender uses it
        with pytest.raises(OSError):
            Segment.create(1 << 20)
        assert sweep_stale().visited == 0 and os.listdir(taken) == []
    finally:
        for name in os.listdir(taken):
            os.unlink(os.path.join(taken, name))
        os.rmdir(taken)


def test_our_directory_is_refused_once_loosened(monkeypatch):
    loose = os.path.join(SHM_ROOT, f"tandem-{os.geteuid()}-loose-{secrets.token_hex(4)}")
    os.mkdir(loose, 0o700)
    os.chmod(loose, 0o755)
    try:
        monkeypatch.setattr(shm_segment, "SHM_DIR", loose)
        with pytest.raises(PermissionError, match="drwxr-xr-x"):
            shm_segment.segment_dir()
        assert shm_segment.host_identity() is None
    finally:
        os.rmdir(loose)
