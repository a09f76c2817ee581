"""One `tandem serve` subprocess per layout: started on a free port, ready when /ready says so, and
stopped completely before the next layout starts.

A subprocess (not an in-process `Cluster`) gives each layout its own Ray instance, so nothing of one
layout (actors, object store, Ray's CPU accounting) can leak into the next. It runs in its own session:
Ray's daemons inherit that session, which is how `stop` finds anything still alive after the graceful
Ctrl-C shutdown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (zombies excluded: they hold nothing)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


class _PortTaken(RuntimeError):
    """The server could not bind its port: another process took it."""


class ServeProcess:
    def __init__(self, config_path: Path, host: str, port: int, log_path: Path, expected_workers: int):
        self.config_path, self.host, self.port = config_path, host, port
        self.log_path, self.expected_workers = log_path, expected_workers
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 300.0, attempts: int = 3) -> None:
        """Start and wait until ready. The port was free when chosen, but the server binds it only after
        its Ray instance is up, and Ray's own connections take ports from the same range meanwhile: a
        server that loses its port that way is started again on another (`attempts` in all)."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except _PortTaken as exc:
                self.stop()
                if attempt == attempts - 1:
                    raise RuntimeError(f"tandem serve lost its port {attempts} times; the last:\n{exc}") from None
                self.port = free_port(self.host)

    def _start_once(self, timeout_s: float) -> None:
        if not port_is_free(self.host, self.port):
            raise _PortTaken(f"port {self.port} is taken before the server started")
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--config", str(self.config_path),
               "--host", self.host, "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._tail()
                error = _PortTaken if "address already in use" in tail else RuntimeError
                raise error(f"tandem serve exited with {self.proc.returncode} before it was ready:\n{tail}")
            if self._ready():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tandem serve was not ready after {timeout_s:.0f} s:\n{self._tail()}")

    def _ready(self) -> bool:
        try:
            r = httpx.get(f"{self.url}/ready", timeout=5)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and len(r.json().get("workers", [])) >= self.expected_workers

    def stop(self, timeout_s: float = 60.0) -> dict:
        """Ctrl-C, wait, then make sure: returns how it went (leftovers killed, port free)."""
        if self.proc is None:
            return {"returncode": None, "leftover_pids": [], "port_free": port_is_free(self.host, self.port)}
        sid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        leftovers = reap_session(sid)
        deadline = time.monotonic() + 10
        while not port_is_free(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {"returncode": self.proc.returncode, "leftover_pids": leftovers,
                "port_free": port_is_free(self.host, self.port)}

    def _tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def reap_session(sid: int, grace_s: float = 10.0) -> list[int]:
    """Give a session's processes `grace_s` to exit on their own, then kill what is left; returns the
    pids that were left (a clean stop leaves none)."""
    deadline = time.monotonic() + grace_s
    while (pids := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids
