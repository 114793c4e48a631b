"""Checkpoint blobs: a session sealed with the deployment's key, opaque to whoever holds it.

A checkpoint carries the environment's committed state, which can hold the task's reference
answer, so the caller may neither read it nor forge one. The envelope (`SealedCheckpoint`, a
versioned protobuf message: never a pickle on the trusted side) holds the key id and the tenant in
the clear and the `CheckpointBody` encrypted with AES-256-GCM; the associated data binds the
version, key id and tenant, so a blob moved to another tenant, or edited anywhere, does not open.

Keys (`Keyring`): several may be configured, each with an id, one of them primary (it seals; all
of them open), so a rotation is two phases: every replica first accepts the new key, then it
becomes primary (docs/fork.md). With no key configured checkpoints are refused with a typed error
naming the flag: a per-process random key would make blobs that no other replica, and no restart,
can open.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError

from codegym.checkpoint.v1 import checkpoint_pb2 as cp
from codegym.errors import Reason, Refusal

VERSION = 1
KEY_BYTES = 32
NONCE_BYTES = 12
# The flag named by a refusal when no key is configured.
KEY_FLAG = "--checkpoint-key"


def new_key_text() -> str:
    """A fresh key as a key file holds it (base64 of 32 random bytes, one line)."""
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode() + "\n"


def write_key_file(path: Path) -> Path:
    """Make a 0600 key file at `path` unless one is there (reused across starts)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(new_key_text())
    return path


def read_key(path: Path) -> bytes:
    """A key file's 32 bytes (base64 or hex text, or the raw bytes)."""
    raw = path.read_bytes()
    text = raw.strip()
    for decode in (base64.b64decode, binascii.unhexlify):
        try:
            key = decode(text)
        except (binascii.Error, ValueError):
            continue
        if len(key) == KEY_BYTES:
            return key
    if len(raw) == KEY_BYTES:
        return raw
    raise ValueError(f"checkpoint key file {path} does not hold a {KEY_BYTES}-byte key (base64, hex or raw)")


def key_id_of(key: bytes) -> str:
    """A key's default id: a fingerprint, so every replica reading the same file names it alike."""
    return hashlib.sha256(b"codegym-checkpoint-key\0" + key).hexdigest()[:12]


def parse_key_arg(arg: str) -> tuple[str, Path]:
    """`--checkpoint-key` value: `id=path` or `path` (the id is then the key's fingerprint, "")."""
    ident, sep, path = arg.partition("=")
    if sep and ident and "/" not in ident:
        return ident, Path(path)
    return "", Path(arg)


@dataclass(frozen=True)
class Keyring:
    """The deployment's checkpoint keys by id; `primary` seals."""

    keys: dict[str, bytes]
    primary: str

    @classmethod
    def load(cls, args: Sequence[str], primary: str = "") -> Keyring | None:
        """Keys from `--checkpoint-key` values (the first, or the one named `primary`, seals)."""
        keys: dict[str, bytes] = {}
        for arg in args:
            ident, path = parse_key_arg(arg)
            key = read_key(path)
            keys[ident or key_id_of(key)] = key
        if not keys:
            return None
        first = next(iter(keys))
        if primary and primary not in keys:
            raise ValueError(f"--checkpoint-primary {primary!r} names none of the keys ({', '.join(keys)})")
        return cls(keys, primary or first)


def _associated(version: int, key_id: str, tenant: str) -> bytes:
    return b"codegym-checkpoint\0%d\0%s\0%s" % (version, key_id.encode(), tenant.encode())


def require_keys(keyring: Keyring | None) -> Keyring:
    if keyring is None:
        raise Refusal(
            Reason.CHECKPOINTS_OFF,
            f"this runtime has no checkpoint key: start it with {KEY_FLAG} FILE (codegym up makes one)",
        )
    return keyring


def seal(keyring: Keyring | None, body: cp.CheckpointBody) -> bytes:
    """`body` sealed with the primary key, bound to its tenant."""
    ring = require_keys(keyring)
    body.key_id = ring.primary
    nonce = secrets.token_bytes(NONCE_BYTES)
    sealed = AESGCM(ring.keys[ring.primary]).encrypt(
        nonce, body.SerializeToString(), _associated(VERSION, ring.primary, body.tenant)
    )
    envelope = cp.SealedCheckpoint(
        version=VERSION, key_id=ring.primary, tenant=body.tenant, nonce=nonce, sealed=sealed
    )
    return envelope.SerializeToString()


def unseal(keyring: Keyring | None, blob: bytes, max_bytes: int) -> cp.CheckpointBody:
    """The body of a blob this deployment sealed; a typed refusal for anything else. The caller
    checks the tenant (`body.tenant`, authenticated here)."""
    ring = require_keys(keyring)
    if not blob:
        raise Refusal(Reason.BAD_CHECKPOINT, "the checkpoint is empty")
    if len(blob) > max_bytes:
        raise Refusal(Reason.BAD_CHECKPOINT, f"the checkpoint is {len(blob)} bytes (max {max_bytes})")
    envelope = cp.SealedCheckpoint()
    try:
        envelope.ParseFromString(blob)
    except DecodeError:
        raise Refusal(Reason.BAD_CHECKPOINT, "the checkpoint is not one (truncated or corrupt)") from None
    if envelope.version != VERSION:
        raise Refusal(
            Reason.BAD_CHECKPOINT,
            f"the checkpoint's envelope version {envelope.version} is not one this runtime reads ({VERSION})",
        )
    key = ring.keys.get(envelope.key_id)
    if key is None:
        raise Refusal(
            Reason.BAD_CHECKPOINT,
            f"the checkpoint was sealed with key {envelope.key_id[:40]!r}, which this runtime does not "
            "hold (another deployment's, or a retired key)",
        )
    if len(envelope.nonce) != NONCE_BYTES:
        raise Refusal(Reason.BAD_CHECKPOINT, "the checkpoint is not one (truncated or corrupt)")
    try:
        plain = AESGCM(key).decrypt(
            envelope.nonce, envelope.sealed, _associated(envelope.version, envelope.key_id, envelope.tenant)
        )
    except InvalidTag:
        raise Refusal(
            Reason.BAD_CHECKPOINT, "the checkpoint does not authenticate (truncated or altered)"
        ) from None
    body = cp.CheckpointBody()
    body.ParseFromString(plain)  # sealed by us: it parses
    if body.tenant != envelope.tenant or body.key_id != envelope.key_id:
        raise Refusal(Reason.BAD_CHECKPOINT, "the checkpoint does not authenticate (truncated or altered)")
    return body
