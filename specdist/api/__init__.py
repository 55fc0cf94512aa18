"""What clients talk to: the gRPC ``SpecDecode`` server, the OpenAI-compatible HTTP API, the
request checks both share, the coordinator that runs many streams over one engine, Prometheus
metrics, and ``serving``, which assembles them over an engine (``specdist serve``)."""
