"""`torchpool keygen` and `torchpool make-example-repo`: files a deployment needs."""
from __future__ import annotations

import argparse
from pathlib import Path

from .errors import USAGE, CliError


def run_keygen(args: argparse.Namespace) -> int:
    from ..broker.auth import SecurityError, keygen, read_certificate

    try:
        public_file, secret_file = keygen(args.directory, args.name)
        public, _ = read_certificate(public_file, secret=False)
    except (SecurityError, OSError) as exc:
        raise CliError(USAGE, str(exc)) from None
    print(f"public key {public.decode()}\n"
          f"  {public_file}  (public: copy it into the daemon's --curve-authorized-keys directory,\n"
          f"  or give it to clients as server_key)\n"
          f"  {secret_file}  (secret, mode 600: --curve-secret-key, or a client's client_key)")
    return 0


def run_make_example_repo(args: argparse.Namespace) -> int:
    from ..examples import build_example_repository

    try:
        names = build_example_repository(Path(args.directory))
    except OSError as exc:
        raise CliError(USAGE, f"{args.directory}: {exc.strerror or exc}") from None
    print(f"built {len(names)} models in {args.directory}: {', '.join(names)}")
    return 0


__all__ = ["run_keygen", "run_make_example_repo"]
