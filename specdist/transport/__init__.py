"""How a step reaches its cores: the ``Verifier`` / ``Drafter`` protocols and their messages
(``protocol``), the gRPC transports to the workers (``remote``), the protobuf codecs (``wire``),
the one gRPC server host, status codes, and TLS and tokens (``security``)."""
