"""The admin key an ingress generates when none is configured, and where the `tandem` commands that call
`/admin/*` (`tandem scale`, `tandem plan profile --from-server`) find it.

Why a key always: on loopback every local user is "local", so an ingress with no key answered any user of
the host (another uid resized the pools and read every worker's steps). With no `ingress.admin_key` (or
`admin_key_file`), the ingress reads this user's key from `GENERATED_KEY_PATH`, making it at first start:
a 0600 file in a 0700 directory of this user, so only this user (and root) can read it. Every server of
one user shares it; delete the file to get a new one at the next start.

Who calls what: the ingress calls `ensure_generated_key()` once, at start (admin.AdminAccess); the commands
call `read_generated_key()` when given no key. Neither ever accepts a file or directory another user
could have written or read: that is a ValueError naming the path.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

GENERATED_KEY_PATH = "~/.cache/tandem/admin_key"


def generated_key_path() -> Path:
    return Path(GENERATED_KEY_PATH).expanduser()


def ensure_generated_key(path: Path | None = None) -> str:
    """This user's generated admin key, made (0600, in a 0700 directory) if there is none yet."""
    path = path or generated_key_path()
    _private_dir(path.parent)
    key = _read_private(path)
    if key is not None:
        return key
    key = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # another server of this user made it first: use theirs
        key = _read_private(path)
        if key is None:
            raise ValueError(f"admin key file {path} is empty") from None
        return key
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # exactly, whatever the umask
        f.write(key + "\n")
    return key


def read_generated_key(path: Path | None = None) -> str | None:
    """The key a local ingress generated; None if it has made none (then it runs with a configured key)."""
    return _read_private(path or generated_key_path())


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ValueError(f"{path} is not a directory of this user's; remove it, or set ingress.admin_key_file")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)  # ours: made before this rule, or with a loose umask


def _read_private(path: Path) -> str | None:
    """The key in `path`; None if there is no such file. A file another user owns, or one others may read,
    is refused: its key may be known to them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read the admin key file {path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise ValueError(f"admin key file {path} is not a private file of this user (mode "
                             f"{stat.filemode(info.st_mode)}, uid {info.st_uid}): remove it and start again")
        key = f.read(4096).strip()
    return key or None
