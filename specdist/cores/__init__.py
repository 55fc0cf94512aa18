"""The cores a step drives: the target core (prefill, verify, rollback), the draft core (model,
self, n-gram, suffix and hybrid drafts) and its pipeline, the rejection rule and the Gumbel
coupling, and sampling. They run in the engine's process or inside a worker."""
