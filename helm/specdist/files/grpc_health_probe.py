"""The head's probe when the public port speaks TLS: one grpc.health.v1 Check over TLS; exit 0 iff SERVING.

The kubelet's own gRPC probe speaks plaintext only, so with ``serve.tls.secretName`` the chart runs
this instead, as an exec probe in the head container. It reads the mounted kubernetes.io/tls Secret
(``--tls-dir``): the server's certificate is checked against ``ca.crt`` when the Secret has one,
else against ``tls.crt`` itself (a self-signed certificate), for the first DNS (else IP) name of
``tls.crt`` (the probe dials 127.0.0.1, which the certificate need not name). ``--client-cert``
(with ``serve.tls.clientCA``): present ``tls.crt`` / ``tls.key`` as the client certificate; it must
be signed by ``ca.crt`` and allow client authentication (extended key usage clientAuth, or none).
The health service needs no bearer token.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="the public gRPC port (serve.port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--service", default="", help='health service name ("": the whole server)')
    p.add_argument("--tls-dir", required=True, help="the mounted kubernetes.io/tls Secret")
    p.add_argument("--client-cert", action="store_true", help="present tls.crt / tls.key (mutual TLS)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for the whole check")
    return p.parse_args(argv)


def server_name(cert_file: str) -> str:
    """The first DNS name of the certificate, else its first IP address, else its common name."""
    info = ssl._ssl._test_decode_cert(cert_file)  # the standard library's PEM decoder (no extra package)
    alt = info.get("subjectAltName", ())
    for kind in ("DNS", "IP Address"):
        names = [v for k, v in alt if k == kind]
        if names:
            return names[0].strip()
    return next(v for rdn in info.get("subject", ()) for k, v in rdn if k == "commonName")


def check(args: argparse.Namespace) -> str:
    """The health status name (SERVING, NOT_SERVING, ...); raises grpc.RpcError when the call fails."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cert_file, key_file = os.path.join(args.tls_dir, "tls.crt"), os.path.join(args.tls_dir, "tls.key")
    ca_file = os.path.join(args.tls_dir, "ca.crt")
    with open(ca_file if os.path.exists(ca_file) else cert_file, "rb") as f:
        roots = f.read()
    chain = key = None
    if args.client_cert:
        with open(cert_file, "rb") as f:
            chain = f.read()
        with open(key_file, "rb") as f:
            key = f.read()
    creds = grpc.ssl_channel_credentials(roots, key, chain)
    options = [("grpc.ssl_target_name_override", server_name(cert_file))]
    with grpc.secure_channel(f"{args.host}:{args.port}", creds, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        status = check(args)
    except Exception as e:  # grpc.RpcError, a missing file: the probe fails, saying why
        print(f"grpc_health_probe: {type(e).__name__}: {getattr(e, 'details', lambda: e)()}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"grpc_health_probe: {args.service or 'server'} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
