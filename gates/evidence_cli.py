"""Verbs: `verify RUN_ID` (re-check a release's evidence), `keygen DIR` (an ed25519 key pair),
`evidence RUN_ID` (write a recorded release's evidence bundle again, e.g. after signing was configured)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    verify = subparsers.add_parser("verify", help="re-check a release's evidence: hashes, signature, "
                                   "verdicts re-derived from the per-item records")
    verify.add_argument("run_id", metavar="RUN_ID", help="the release run (or one of its variant runs)")
    verify.add_argument("--key", type=Path, help="ed25519 public key (PEM); default: QUANTGATE_VERIFY_KEY")
    verify.add_argument("--verbose", "-v", action="store_true", help="list every check that agreed")
    verify.set_defaults(func=_verify)

    keygen = subparsers.add_parser("keygen", help="write an ed25519 key pair for signing release evidence")
    keygen.add_argument("directory", type=Path, help="folder for quantgate-evidence.key and .pub")
    keygen.set_defaults(func=_keygen)

    write = subparsers.add_parser("evidence", help="write (again) the evidence manifest of a recorded release")
    write.add_argument("run_id", metavar="RUN_ID", help="the release run")
    write.add_argument("--key", type=Path, help="ed25519 private key (PEM); default: QUANTGATE_SIGNING_KEY")
    write.set_defaults(func=_write)


def _verify(args: argparse.Namespace) -> int:
    from gates.evidence.verify import render, verify

    report = verify(args.run_id, verify_key=args.key)
    print(render(report, verbose=args.verbose))
    return 0 if report.ok else 1


def _keygen(args: argparse.Namespace) -> int:
    from gates.evidence.signing import generate_keypair, key_id, load_public_key

    private, public = generate_keypair(args.directory)
    print(f"private key {private} (keep it secret; QUANTGATE_SIGNING_KEY={private} where releases run)")
    print(f"public key  {public} (QUANTGATE_VERIFY_KEY={public} where releases are verified)")
    print(f"key id      {key_id(load_public_key(public))}")
    return 0


def _write(args: argparse.Namespace) -> int:
    from gates.evidence.manifest import MANIFEST_PATH, write_evidence

    written = write_evidence(args.run_id, signing_key=args.key)
    signed = f"signed with key {written.key_id}" if written.key_id else "unsigned (no signing key configured)"
    print(f"{MANIFEST_PATH} on run {written.release_run_id}: sha256 {written.manifest_sha256}, {signed}; "
          f"model cards: {', '.join('v' + v for v in written.versions) or 'none'}")
    return 0
