"""Another local user of this host, for the tests of what one user's processes must not get from another's:
`tandemother`, made here if missing (CI runs the suite as root, so it can). Its commands run through
`runuser`, with tools of the system only (this user's Python lives where the other cannot read)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess

import pytest

OTHER_USER = "tandemother"


def other_user() -> pwd.struct_passwd:
    """The other user (created now if missing); skips where this process cannot become it."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to act as another local user")
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("needs useradd to make another local user")
    subprocess.run(["useradd", "-m", OTHER_USER], check=True, capture_output=True, timeout=60)
    return pwd.getpwnam(OTHER_USER)


def as_other(command: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """`command` (a bash command line) run as the other user, from its home directory."""
    other = other_user()
    return subprocess.run(["runuser", "-u", OTHER_USER, "--", "bash", "-c", f"cd {other.pw_dir} && {command}"],
                          capture_output=True, text=True, timeout=timeout_s)
