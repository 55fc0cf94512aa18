"""Generated protobuf / gRPC code for the specdist.v1 wire contracts. Do not edit.

The sources are ``proto/specdist/v1/*.proto``. Regenerate every ``*_pb2*`` file here
after editing them (needs grpcio-tools; ``--check`` only reports stale files):

    python -m specdist.protogen [--check]

which runs, from the repository root,
``python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/specdist/v1/*.proto``.
"""
