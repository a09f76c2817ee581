"""One shared-memory segment of the one-host KV page path: a file that a sender creates and one receiver
maps, in this user's own directory of /dev/shm (`SHM_DIR`, /dev/shm/tandem-<uid>, 0700), and the host facts
that tell when two processes can share one.

Why a directory of our own: /dev/shm is writable by every user, and a sweep of it walks whatever anyone
put there (300k empty files of another uid made every receiver's sweep cost 0.26 s of CPU a second).
`segment_dir()` makes ours 0700 and refuses one that another user owns or others may enter (then the
shared-memory path is off and pages go as frames); nothing here reads or removes files outside it.

Layout: a control page of int64 words, then `capacity` bytes of page data. The words:
- MAGIC, VERSION, CAPACITY: written once by the creator before the segment is named to anyone;
- STATE (OPEN / CLOSED) and SENT (the sequence number of the last note sent): written by the sender only;
- DONE (the last note the receiver is through with): written by the receiver only.
One writer per word, so no lock is needed: an aligned 8-byte store is seen whole.

Names are "tandem-kvshm-<pid namespace>-<pid>-<start time>-<32 random hex digits>". The creator's
process identity lets this user's processes tell a dead creator's leftovers (`sweep_stale`); the 128 random
bits make a name unguessable. Files are created O_EXCL with mode 0600, so only their user can map them.

Who calls what
- The sender: `Segment.create(capacity)`, `commit(end)` before writing past what is committed, `close()`
  (marks it CLOSED, removes the name if it is still there, unmaps).
- The receiver: `Segment.open(name)`, which refuses (PageFormatError) anything that is not a segment of
  ours: a name of another form, a file of another user or mode, a symlink, a non-regular file, a wrong
  magic/version/capacity. It then removes the name at once: from there on the segment is only two
  mappings, which the kernel frees when both processes have unmapped it or died. `close()` unmaps.
- Both: `sweep_stale()` removes names in `SHM_DIR` whose creator is gone (killed before any receiver
  opened them); it visits that directory only.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

import torch

from kv_transfer.page_format import PageFormatError

SHM_ROOT = "/dev/shm"
SHM_DIR = os.path.join(SHM_ROOT, f"tandem-{os.geteuid()}")  # this user's segments; see `segment_dir`
PREFIX = "tandem-kvshm-"
CONTROL_BYTES = 4096
_NAME = re.compile(r"tandem-kvshm-(\d{1,20})-(\d{1,10})-(\d{1,20})-[0-9a-f]{32}")
_MAGIC = 0x314D48535643444E  # any constant that an unrelated file is unlikely to start with
_VERSION = 1
MAGIC, VERSION, CAPACITY, STATE, SENT, DONE = range(6)
OPEN, CLOSED = 1, 2


def host_identity() -> str | None:
    """What two processes must share to use one segment: the same booted kernel, the same /dev/shm mount
    (a container with a private /dev/shm has another device or inode there, even on this host), and the
    same user. None where there is no /dev/shm (then the shared-memory path is off)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_ROOT)
        segment_dir()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return f"{boot} {st.st_dev} {st.st_ino} {os.geteuid()}"


def segment_dir() -> str:
    """`SHM_DIR`, made now (0700) if missing; raises OSError if it is not a directory of this user's that
    only this user may enter (another user made it first, or loosened it): it is never used then."""
    try:
        os.mkdir(SHM_DIR, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(SHM_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            os.chmod(SHM_DIR, 0o700)  # ours and closed to others, only made under a stricter umask
            return SHM_DIR
        raise PermissionError(f"{SHM_DIR} is not a private directory of this user (mode "
                              f"{stat.filemode(st.st_mode)}, uid {st.st_uid}): shared-memory KV pages are off")
    return SHM_DIR


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0  # unknown: names made here are never judged dead by pid


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, an
    identity that a reused pid does not repeat. None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def new_name() -> str:
    """A fresh segment name of this process (see the module docstring)."""
    pid = os.getpid()
    return f"{PREFIX}{_pid_namespace()}-{pid}-{_start_time(pid) or 0}-{secrets.token_hex(16)}"


def process_identity() -> tuple[int, int, int]:
    """This process as `process_alive` judges it: (pid namespace, pid, start time)."""
    pid = os.getpid()
    return _pid_namespace(), pid, _start_time(pid) or 0


def process_alive(namespace: int, pid: int, start: int) -> bool | None:
    """Whether that process still runs; None when this process cannot tell (another or an unknown pid
    namespace, an unknown start time)."""
    if namespace == 0 or namespace != _pid_namespace() or start == 0:
        return None
    return _start_time(pid) == start


def creator_alive(name: str) -> bool | None:
    """Whether the process that created segment `name` still runs; None when this process cannot tell
    (another pid namespace, no /proc, not one of our names)."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    return process_alive(int(m[1]), int(m[2]), int(m[3]))


@dataclass(frozen=True)
class Swept:
    visited: int  # directory entries looked at: only this user's directory's
    removed: tuple[str, ...]


def sweep_stale() -> Swept:
    """Remove segment names in this user's directory whose creator is gone. Names of live processes and of
    other pid namespaces stay; nothing outside `SHM_DIR` is looked at."""
    try:
        with os.scandir(segment_dir()) as entries:
            names = [e.name for e in entries]
    except OSError:
        return Swept(0, ())
    removed = []
    for name in names:
        if not name.startswith(PREFIX) or creator_alive(name) is not False:
            continue
        try:
            if os.lstat(os.path.join(SHM_DIR, name)).st_uid == os.geteuid():
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
        except OSError:
            pass  # gone meanwhile
    return Swept(len(names), tuple(removed))


class Segment:
    """A mapped segment: its page area as a 1-D uint8 tensor (`data`, what a sender writes) or as byte
    buffers (`span`, what a receiver reads)."""

    def __init__(self, name: str, buf: mmap.mmap, fd: int | None):
        self.name = name
        self._map = buf
        self._fd = fd  # the creator keeps it (to commit memory); a receiver closes it once mapped
        self.capacity = len(buf) - CONTROL_BYTES
        self._view = memoryview(buf)
        self._words = self._view[:CONTROL_BYTES].cast("q")
        self.data = torch.frombuffer(buf, dtype=torch.uint8, offset=CONTROL_BYTES, count=self.capacity)
        self._committed = 0

    @classmethod
    def create(cls, capacity: int) -> Segment:
        """A fresh segment of `capacity` data bytes (a multiple of the page size); raises OSError."""
        name = new_name()
        path = os.path.join(segment_dir(), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # exactly, whatever the umask
            os.ftruncate(fd, CONTROL_BYTES + capacity)  # sparse: memory is taken by `commit`
            os.posix_fallocate(fd, 0, CONTROL_BYTES)
            seg = cls(name, mmap.mmap(fd, CONTROL_BYTES + capacity, mmap.MAP_SHARED), fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        for word, value in ((VERSION, _VERSION), (CAPACITY, capacity), (STATE, OPEN), (MAGIC, _MAGIC)):
            seg.set(word, value)
        return seg

    @classmethod
    def open(cls, name: str, keep_name: bool = False) -> Segment:
        """Map the segment a note names, then remove its name (`keep_name`: leave it, for a segment several
        processes map, such as the host KV tier's); raises PageFormatError for anything else."""
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise PageFormatError(f"shared-memory segment {name!r} is not a tandem segment name")
        try:  # the directory first: a segment of ours lies in ours, which no one else may enter
            path = os.path.join(segment_dir(), name)
        except OSError as e:
            raise PageFormatError(f"shared-memory segment {name}: {e}") from None
        try:  # O_NONBLOCK: a FIFO planted under this name must not block the receiving thread
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise PageFormatError(f"shared-memory segment {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 \
                    or st.st_size <= CONTROL_BYTES or st.st_size % mmap.PAGESIZE:
                raise PageFormatError(f"shared-memory segment {name}: not a private segment of this user "
                                      f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}, {st.st_size} bytes)")
            seg = cls(name, mmap.mmap(fd, st.st_size, mmap.MAP_SHARED), None)
        except OSError as e:
            raise PageFormatError(f"shared-memory segment {name}: cannot map it: {e.strerror}") from None
        finally:
            os.close(fd)
        if (seg.word(MAGIC), seg.word(VERSION), seg.word(CAPACITY)) != (_MAGIC, _VERSION, seg.capacity):
            seg.close()
            raise PageFormatError(f"shared-memory segment {name}: bad control block")
        if keep_name:
            return seg
        try:  # the name, if it is still this file, is no longer needed: only the two mappings keep it
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)
        except OSError:
            pass
        return seg

    def span(self, offset: int, nbytes: int) -> memoryview:
        """Data bytes [offset, offset + nbytes), which the caller checked lie in the data area."""
        return self._view[CONTROL_BYTES + offset:CONTROL_BYTES + offset + nbytes]

    def word(self, index: int) -> int:
        return self._words[index]

    def set(self, index: int, value: int) -> None:
        self._words[index] = value

    def commit(self, end: int) -> None:
        """Back data bytes [0, end) with memory now (creator only), so that writing them can never fault
        on a full /dev/shm (SIGBUS): raises OSError (ENOSPC) here instead."""
        if end > self._committed:
            end = min(self.capacity, -(-end // (1 << 20)) << 20)  # whole MiB: fewer calls
            os.posix_fallocate(self._fd, CONTROL_BYTES + self._committed, end - self._committed)
            self._committed = end

    def close(self) -> None:
        """Creator: mark CLOSED and remove the name (if no receiver did). Both: unmap. Idempotent."""
        if self._map is None:
            return
        if self._fd is not None:
            self.set(STATE, CLOSED)
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
        self._words.release()
        self._view.release()
        self.data = None
        try:
            self._map.close()
        except BufferError:
            pass  # a span view is still alive: the mapping goes when its last view does
        self._map = None
