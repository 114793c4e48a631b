"""Access as `codegym up --auth [--tls-cert C --tls-key K]` hands it to a trainer: a self-signed
certificate to start `up` with, and the trainer token and CA that `up` prints for the shell to
export (`export CODEGYM_TOKEN=...`, `export CODEGYM_TLS_CA=...`), read back from its output.

Why read the printed lines rather than the tokens file: they are what a trainer is told to use, so
a stack that prints the wrong token or CA fails here, as it would for them.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, valid a day, that is its own CA, and its key:
    folder/cert.pem and folder/key.pem."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "codegym-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@dataclass(frozen=True)
class Printed:
    """What `codegym up` told a trainer to export: empty where it printed none (no `--auth`, no TLS)."""

    token: str
    tls_ca: str


def printed_access(text: str, auth: bool = False, tls: bool = False) -> Printed:
    """The trainer token and the CA in `codegym up`'s output (its lines before the ready line).
    `auth`, `tls`: `up` was started with `--auth`, `--tls-cert`: a missing line is an error that
    shows the output (a client without the CA would otherwise go on in plain text, unnoticed)."""
    token = re.search(rf"export {TOKEN_ENV}=(\S+)", text)
    ca = re.search(rf"export {TLS_CA_ENV}=(\S+)", text)
    for wanted, found, what in ((auth, token, "trainer token"), (tls, ca, "CA")):
        if wanted and found is None:
            raise RuntimeError(f"codegym up printed no {what}:\n{text[-2000:]}")
    return Printed(token.group(1) if token else "", ca.group(1) if ca else "")
