"""Sign a judged run's record with your OpenSSH key, as git signs commits with SSH keys.

    k3load sign runs/r1 --key ~/.ssh/id_ed25519                 # the operator
    k3load sign runs/r1 --key ~/.ssh/id_ed25519.pub --identity lead@example.com   # the lead, key in ssh-agent
    k3load verify runs/r1 --allowed-signers team_allowed_signers --require-signature

The signature (`ssh-keygen -Y sign`, namespace `k3load`) is over manifest.sha256, which covers every evidence
file, and is kept beside it in manifest.sha256.sig, after any earlier signer's; manifest.sha256.signers.json
keeps each signer's identity (--identity, else the key's comment), key fingerprint and time. A run whose
evidence no longer matches its manifest is not signed.

Exit codes: 0 signed; 1 signed, but the reports could not be updated to say so (a full disk); 2 nothing
signed: not a judged run, its evidence changed, no ssh-keygen, an unreadable key, or a passphrase-protected key
that no ssh-agent holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3load.analysis.cli import run_dir_problem
from k3load.analysis.outputs.manifest import verify
from k3load.signing import keygen, record

EXIT_SIGNED, EXIT_SIGNED_REPORTS_STALE, EXIT_NOT_SIGNED = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN", help="a judged run directory (with manifest.sha256)")
    parser.add_argument("--key", required=True, type=Path, metavar="PATH",
                        help="your OpenSSH private key (ed25519, RSA, ECDSA), or its .pub when ssh-agent holds it")
    parser.add_argument("--identity", metavar="PRINCIPAL",
                        help="who signs, as the team's allowed-signers file names you (default: the key's comment)")


def run(args: argparse.Namespace) -> int:
    try:
        signer = sign_run(args.run_dir, args.key, args.identity)
    except keygen.SigningError as exc:
        print(f"k3load sign: {exc}; nothing signed", file=sys.stderr)
        return EXIT_NOT_SIGNED
    except OSError as exc:  # the reports could not be refreshed (a full disk): the signature itself was kept
        print(f"k3load sign: signed, but the reports could not say so ({exc.strerror or exc}): k3load verify "
              "fails on them until k3load sign runs again with room on the disk", file=sys.stderr)
        return EXIT_SIGNED_REPORTS_STALE
    print(f"k3load sign: signed {args.run_dir / record.MANIFEST} as {signer.identity} ({signer.key_type} "
          f"{signer.fingerprint}) at {signer.signed_at}; kept in {args.run_dir / record.SIGNATURES}")
    return EXIT_SIGNED


def sign_run(run_dir: Path, key: Path, identity: str | None) -> record.Signer:
    if problem := run_dir_problem(run_dir):
        raise keygen.SigningError(problem)
    record.manifest_bytes(run_dir)  # a run never judged has none: said before the key is touched
    changed = verify(run_dir)
    if changed:
        raise keygen.SigningError(f"{run_dir}: its evidence no longer matches {record.MANIFEST} ({changed[0]}"
                                  f"{f' and {len(changed) - 1} more' if len(changed) > 1 else ''})")
    return record.add_signature(run_dir, keygen.signing_key(key.expanduser()), identity)
