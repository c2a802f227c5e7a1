"""Ed25519 keys and signatures for evidence manifests (the `cryptography` package).

A key pair is two PEM files: the private key (PKCS#8, readable by its owner only) signs when a release
writes its manifest (`QUANTGATE_SIGNING_KEY`); the public key checks it (`QUANTGATE_VERIFY_KEY`). A
signature names its key by `key_id`, the first 16 hex digits of the sha256 of the raw public key, so a
verifier can say which key signed and whether that is the key it trusts.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALGORITHM = "ed25519"
UNSIGNED = "none"  # the record an unsigned manifest carries, so that no older signature stays beside it
PRIVATE_NAME = "quantgate-evidence.key"
PUBLIC_NAME = "quantgate-evidence.pub"


@dataclass(frozen=True)
class Signature:
    algorithm: str
    key_id: str
    signature: str  # base64 of the 64-byte ed25519 signature

    @classmethod
    def from_dict(cls, data: object) -> Signature:
        if not isinstance(data, dict) or set(data) != {"algorithm", "key_id", "signature"}:
            raise ValueError(f"not a quantgate signature record: {data!r}")
        return cls(**{k: str(v) for k, v in data.items()})

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def signed(self) -> bool:
        return self.algorithm != UNSIGNED


NO_SIGNATURE = Signature(UNSIGNED, "", "")


def key_id(public: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()[:16]


def generate_keypair(directory: Path) -> tuple[Path, Path]:
    """Write a new key pair under `directory`; refuses to replace an existing key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        NoEncryption,
        PrivateFormat,
        PublicFormat,
    )

    directory = Path(directory).expanduser()
    private_path, public_path = directory / PRIVATE_NAME, directory / PUBLIC_NAME
    for path in (private_path, public_path):
        if path.exists():
            raise ValueError(f"{path} exists; keygen never replaces a key (move it away first)")
    directory.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    public_path.write_bytes(private.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = _load(path, lambda data: load_pem_private_key(data, password=None), "private")
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"signing key {path} is a {type(key).__name__}, not an ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    key = _load(path, load_pem_public_key, "public")
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"verify key {path} is a {type(key).__name__}, not an ed25519 public key")
    return key


def _load(path: Path, parse, kind: str):
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{kind} key file not found: {path}")
    try:
        return parse(path.read_bytes())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a PEM {kind} key: {exc}") from None


def sign(payload: bytes, private: Ed25519PrivateKey) -> Signature:
    raw = private.sign(payload)
    return Signature(ALGORITHM, key_id(private.public_key()), base64.b64encode(raw).decode())


def check(payload: bytes, signature: Signature, public: Ed25519PublicKey) -> str | None:
    """None when `signature` is `public`'s over `payload`; else what is wrong, in words."""
    from cryptography.exceptions import InvalidSignature

    if signature.algorithm != ALGORITHM:
        return f"signature algorithm is {signature.algorithm!r}, not {ALGORITHM}"
    trusted = key_id(public)
    if signature.key_id != trusted:
        return f"signed by key {signature.key_id}, not by the configured verify key {trusted}"
    try:
        public.verify(base64.b64decode(signature.signature, validate=True), payload)
    except (InvalidSignature, ValueError):
        return f"the signature does not match the manifest under key {trusted}"
    return None
