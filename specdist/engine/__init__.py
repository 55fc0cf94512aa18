"""The speculative step and its policies: the scheduler (one step over a verifier and drafters
of :mod:`specdist.transport.protocol`; its draft pool, its output processor and its transport
calls: ``draft_pool``, ``output_processor``, ``calls``), a request's state and its output (``output_state``:
stops, incremental text), the draft-length rule and its cost model, prompt encoding; and the two engines that
build a scheduler: ``local`` (the cores in this process: :class:`specdist.Engine`) and ``remote`` (the Ray
workers over gRPC)."""
