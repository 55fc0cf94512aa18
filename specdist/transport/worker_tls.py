"""Mutual TLS on a Ray deployment's worker links (coordinator <-> target rank 0 and draft workers).

A deployment makes, at every bring-up and in memory only (:meth:`WorkerTLS.generate`, beside the worker secret):

- a CA of its own (an EC P-256 key and a self-signed certificate); its key signs one certificate and is then
  dropped, so nothing else can ever be signed by it;
- one certificate and key for the whole deployment, named :data:`WORKER_NAME`, good for both ends
  (``serverAuth`` and ``clientAuth``): every worker serves with it and the coordinator presents it.

A worker port (:meth:`WorkerTLS.grpc_credentials`, the credentials :mod:`specdist.transport.grpc_host` binds with)
then speaks TLS only and requires a client certificate signed by the deployment's CA: a plaintext client fails
its handshake, and so does one whose certificate another CA (another deployment's) signed. The coordinator's
channels (:meth:`WorkerTLS.channel`) trust only that CA and check the worker's certificate for
:data:`WORKER_NAME` (workers are dialled by IP address, which no certificate made before they start could name).
The worker secret still rides on every call; TLS keeps it, and the prompts, tokens and seeds, off the wire.

Who holds the certificate is trusted as a worker: a compromised draft worker can still propose what it likes,
which the rejection coupling turns into the target's tokens (docs/deployment.md, "Security").
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import grpc

WORKER_NAME = "specdist-worker"  # the name in the deployment's certificate, which clients check
VALID_DAYS = 3650  # the certificate's life: the deployment's (its CA key is gone once it is signed)


@dataclass(frozen=True)
class WorkerTLS:
    """A deployment's worker TLS: its CA certificate, and the certificate and key every worker and the coordinator
    use (PEM bytes). Pickled to the worker actors with ``start_grpc``, as the secret is; never logged."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> "WorkerTLS":
        """A fresh CA and the deployment's certificate signed by it (module doc)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)

        def certificate(subject: str, key, issuer: str, signer, ca: bool) -> x509.Certificate:
            b = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start)
                .not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
            )
            if ca:
                b = b.add_extension(
                    x509.KeyUsage(
                        digital_signature=False,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        key_cert_sign=True,
                        crl_sign=True,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
            else:
                b = b.add_extension(
                    x509.SubjectAlternativeName([x509.DNSName(WORKER_NAME)]), critical=False
                ).add_extension(
                    x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                    critical=False,
                )
            return b.sign(signer, hashes.SHA256())

        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca_name = "specdist deployment CA"
        ca_cert = certificate(ca_name, ca_key, ca_name, ca_key, ca=True)
        cert = certificate(WORKER_NAME, key, ca_name, ca_key, ca=False)
        pem = serialization.Encoding.PEM
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        return cls(ca_cert.public_bytes(pem), cert.public_bytes(pem), key_pem)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """A worker port's credentials: TLS with the deployment's certificate, a client certificate signed by the
        deployment's CA required."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The coordinator's side: the deployment's CA trusted (only it), its certificate presented."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options: the worker's certificate checked for :data:`WORKER_NAME`, whatever address is dialled."""
        return [("grpc.ssl_target_name_override", WORKER_NAME)]

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        """A blocking channel to a worker at ``address`` over this TLS (``options``: more channel options)."""
        return grpc.secure_channel(address, self.channel_credentials(), list(options or []) + self.channel_options())
