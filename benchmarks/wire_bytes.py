"""Bytes a speculative step puts on the wire, per coupling and draft method (no timing involved).

Prints two tables (docs/performance.md, "Bytes on the wire"):

- one ``VerifyRequest`` as the transports encode it (specdist/transport/wire.py), 100-token requests with
  k drafted tokens each: under ``rejection`` every drafted token carries its q row (dense fp16 at full
  support, sparse when 64 tokens are kept by top-p or ``draft.q_top_k``), under ``gumbel`` token ids only;
- an EAGLE-3 draft's hidden states: the Verify result (target to coordinator) and the next Propose item
  (coordinator to draft worker) of one request, for 0 and 4 accepted drafts of 4.

    python benchmarks/wire_bytes.py
"""

from __future__ import annotations

import torch

from specdist.transport.protocol import Proposal, ProposeItem, Verified, VerifyItem
from specdist.transport.wire import propose_items_to_proto, verified_to_proto, verify_items_to_proto


def verify_bytes(vocab: int, k: int, batch: int, q: torch.Tensor | None) -> int:
    items = [VerifyItem(f"req-{i:06d}", 100, Proposal(f"req-{i:06d}", list(range(k)), q=q)) for i in range(batch)]
    return verify_items_to_proto(items, vocab).ByteSize()


def main() -> None:
    print("| vocabulary | k | batch | rejection, dense q | rejection, 64 tokens kept | gumbel (token ids) |")
    print("|---|---|---|---|---|---|")
    for vocab, k, batch in ((49152, 4, 1), (49152, 4, 16), (131072, 8, 64)):
        dense = torch.full((k, vocab), 1.0 / vocab)
        sparse = torch.zeros(k, vocab)
        sparse[:, :64] = 1 / 64
        print(
            f"| {vocab} | {k} | {batch} | {verify_bytes(vocab, k, batch, dense):,} | "
            f"{verify_bytes(vocab, k, batch, sparse):,} | {verify_bytes(vocab, k, batch, None):,} |"
        )
    print()
    print("| target | accepted of 4 | Verify result bytes | Propose item bytes |")
    print("|---|---|---|---|")
    for name, width, dtype in (
        ("SmolLM2-135M, float32, 3 x 576", 3 * 576, torch.float32),
        ("Llama-3.1-8B, bfloat16, 3 x 4096", 3 * 4096, torch.bfloat16),
    ):
        for accepted in (0, 4):
            h = torch.zeros(accepted + 1, width, dtype=dtype)
            verify = verified_to_proto([Verified("req-000001", accepted, 7, None, h)]).ByteSize()
            propose = propose_items_to_proto([ProposeItem("req-000001", accepted, [7], 4, 100, hidden=h)]).ByteSize()
            print(f"| {name} | {accepted} | {verify:,} | {propose:,} |")


if __name__ == "__main__":
    main()
