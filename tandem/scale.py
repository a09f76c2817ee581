"""`tandem scale`: resize the pools of a running `tandem serve` through its admin endpoint."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(scale: argparse.ArgumentParser) -> None:
    scale.add_argument("--prefill", type=int, default=None, help="prefill replicas")
    scale.add_argument("--decode", type=int, default=None, help="decode replicas")
    scale.add_argument("--colocated", type=int, default=None, help="colocated replicas")
    scale.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    # The key never goes on the command line, where `ps` and shell history would show it.
    scale.add_argument("--admin-key-file", default=None,
                       help="a file holding the server's admin key (default: $TANDEM_ADMIN_KEY, if set, else the "
                       "key a server with no ingress.admin_key generated: ~/.cache/tandem/admin_key)")
    scale.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the resize to finish")
    scale.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    body = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode), ("colocated", args.colocated))
            if n is not None}
    if not body:
        raise ValueError("give at least one of --prefill, --decode, --colocated")
    key = os.environ.get("TANDEM_ADMIN_KEY")
    if args.admin_key_file:
        try:
            key = Path(args.admin_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --admin-key-file {args.admin_key_file}: {exc.strerror}") from None
    if not key:
        from cluster.frontend.admin_key import read_generated_key

        key = read_generated_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.post(args.url.rstrip("/") + "/admin/scale", json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"could not reach tandem serve at {args.url}: {exc}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError):
            message = resp.text
        raise ValueError(f"resize refused ({resp.status_code}): {message}")
    result = resp.json()
    print(f"tandem: pools now {', '.join(f'{r} x{n}' for r, n in result['replicas'].items())}; "
          f"added {', '.join(result['added']) or 'none'}; removed {', '.join(result['removed']) or 'none'}")
    return 0
