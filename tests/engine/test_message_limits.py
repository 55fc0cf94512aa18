"""gRPC message limits of the workers and their callers (specdist.transport.wire.message_limit_bytes).

A draft ships q dense (fp16, 2 bytes per vocabulary entry) for every drafted token, so one
Verify request or Propose response can pass grpc's 4 MiB default. The round trips here go
through the real servicers, worker hosts (ServedCores: specdist.transport.grpc_host.GrpcHostThread) and
remote transports with messages just above 4 MiB (vocabulary 32768, k = 8, batch 9), over
stand-in cores; the production size (vocabulary 128k, batch 64) is checked against the wire
encoding of one item.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.helpers import ServedCores

from specdist.engine.remote import RemoteEngine
from specdist.transport.protocol import CallTiming, Proposal, ProposeItem, TransportError, Verified, VerifyItem
from specdist.transport.remote import RemoteDrafter, RemoteVerifier
from specdist.transport.wire import (
    GRPC_DEFAULT_MESSAGE_BYTES,
    GRPC_MAX_MESSAGE_BYTES,
    decode_distribution,
    grpc_message_options,
    message_limit_bytes,
    proposal_to_proto,
    verify_items_to_proto,
)
from specdist.v1 import draft_pb2
from workers.servicing import core_message_limit

VOCAB, BATCH, K = 32768, 9, 8  # 9 x 8 dense rows of 64 KiB: 4.7 MB, above grpc's 4 MiB default


def _dense_q(k: int, vocab: int) -> torch.Tensor:  # [k, vocab]: full support, so it travels DENSE_FP16
    return torch.full((k, vocab), 1.0 / vocab)


def _verify_items(n: int, k: int, vocab: int) -> list[VerifyItem]:
    q = _dense_q(k, vocab)
    return [VerifyItem(f"r{i}", 5, Proposal(f"r{i}", list(range(k)), q=q)) for i in range(n)]


class _Verifier:
    """A VerifierCore stand-in with ``slots`` KV slots: decodes every q it gets, accepts every draft."""

    def __init__(self, vocab_size: int, slots: int):
        self.vocab_size = vocab_size
        self.cache = SimpleNamespace(num_slots=slots)
        self.hidden_width, self.max_model_len = 0, 2048  # no EAGLE-3 hidden states
        self.rows = 0  # q rows decoded

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]:
        for it in items:
            for msg, token in zip(it.proposal.wire, it.proposal.token_ids):
                assert decode_distribution(msg, self.vocab_size, token)[token] > 0
                self.rows += 1
        return [Verified(it.request_id, len(it.proposal.token_ids), 0) for it in items], CallTiming()


class _Drafter:
    """A DrafterCore stand-in with ``slots`` KV slots: proposes ``num_tokens`` tokens with dense q."""

    def __init__(self, vocab_size: int, slots: int):
        self.vocab_size = vocab_size
        self.cache = SimpleNamespace(num_slots=slots)
        self.hidden_width, self.max_model_len = 0, 2048  # no EAGLE-3 hidden states

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]:
        return [
            Proposal(it.request_id, list(range(it.num_tokens)), q=_dense_q(it.num_tokens, self.vocab_size))
            for it in items
        ], CallTiming()


# ---------------------------------------------------------------- round trips above 4 MiB


def _verify_round_trip(vocab: int, batch: int, k: int) -> None:
    """One Verify of ``batch`` items with ``k`` dense q rows each through a worker server and the
    remote verifier, both with the limit of these settings: every row arrives and decodes."""
    core = _Verifier(vocab, batch)
    items = _verify_items(batch, k, vocab)
    with ServedCores(core) as served:
        verifier = RemoteVerifier(
            served.target_address, vocab, timeout_s=120, message_limit=message_limit_bytes(vocab, batch, k)
        )
        try:
            results, _ = verifier.verify(items)
        finally:
            verifier.close()
    assert [r.num_accepted for r in results] == [k] * batch
    assert core.rows == batch * k


def test_verify_above_grpc_default_round_trips():
    assert verify_items_to_proto(_verify_items(BATCH, K, VOCAB), VOCAB).ByteSize() > GRPC_DEFAULT_MESSAGE_BYTES
    _verify_round_trip(VOCAB, BATCH, K)


def test_propose_above_grpc_default_round_trips():
    items = [ProposeItem(f"r{i}", 0, [], K, 5) for i in range(BATCH)]
    with ServedCores(_Verifier(VOCAB, BATCH), [_Drafter(VOCAB, BATCH)]) as served:
        drafter = RemoteDrafter(
            served.draft_addresses[0], timeout_s=30, message_limit=message_limit_bytes(VOCAB, BATCH, K)
        )
        try:
            proposals, _ = drafter.propose(items)
        finally:
            drafter.close()
    assert [len(p.wire) for p in proposals] == [K] * BATCH
    assert sum(len(m.values) for p in proposals for m in p.wire) == BATCH * K * 2 * VOCAB


def test_a_message_above_the_limit_fails_its_requests():
    with ServedCores(_Verifier(VOCAB, BATCH)) as served:
        verifier = RemoteVerifier(served.target_address, VOCAB, timeout_s=30, message_limit=GRPC_DEFAULT_MESSAGE_BYTES)
        try:
            with pytest.raises(TransportError) as err:
                verifier.verify(_verify_items(BATCH, K, VOCAB))
        finally:
            verifier.close()
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert sorted(err.value.request_ids) == sorted(f"r{i}" for i in range(BATCH))


# ---------------------------------------------------------------- the limit


def test_limit_covers_a_full_batch_at_128k_vocabulary():
    """Vocabulary 128k, k = 8, batch 64: 64 items as the transports encode them (dense q), ~134 MB."""
    vocab, batch, k = 131072, 64, 8
    one = verify_items_to_proto(_verify_items(1, k, vocab), vocab)
    proposal = proposal_to_proto(Proposal("r0", list(range(k)), q=_dense_q(k, vocab)), vocab)
    verify_bytes = batch * one.ByteSize()  # VerifyRequest holds only its items: n items, n times the bytes
    propose_bytes = batch * draft_pb2.ProposeResponse(proposals=[proposal]).ByteSize()
    assert verify_bytes > 2 * k * vocab * batch == 32 * GRPC_DEFAULT_MESSAGE_BYTES  # the q rows alone: 134 MB
    limit = message_limit_bytes(vocab, batch, k)
    assert max(verify_bytes, propose_bytes) <= limit <= 3 * max(verify_bytes, propose_bytes)


def test_limit_grows_with_vocabulary_batch_and_draft_length():
    base = message_limit_bytes(32768, 16, 8)
    assert base > GRPC_DEFAULT_MESSAGE_BYTES
    assert message_limit_bytes(65536, 16, 8) > base
    assert message_limit_bytes(32768, 32, 8) > base
    assert message_limit_bytes(32768, 16, 16) > base


def test_limit_stays_within_what_grpc_takes():
    assert message_limit_bytes(1000, 1, 1) == GRPC_DEFAULT_MESSAGE_BYTES  # never below grpc's default
    assert message_limit_bytes(262144, 1024, 64) == GRPC_MAX_MESSAGE_BYTES  # grpc's options are C ints


def test_options_and_worker_defaults():
    assert grpc_message_options(123) == [
        ("grpc.max_receive_message_length", 123),
        ("grpc.max_send_message_length", 123),
    ]
    assert core_message_limit(_Verifier(VOCAB, BATCH), K) == message_limit_bytes(VOCAB, BATCH, K)
    model_free = SimpleNamespace(
        vocab_size=VOCAB, cache=None, hidden_width=0, max_model_len=2048
    )  # n-gram and suffix drafts: one-hot q only
    assert core_message_limit(model_free, K) == message_limit_bytes(VOCAB, 1, K)


def test_remote_engine_gives_its_transports_the_configs_limit():
    cfg = {
        "target": {"model": "unused"},
        "draft": {"method": "ngram", "num_speculative_tokens": K},
        "engine": {"max_batch_size": BATCH, "device": "cpu"},
    }
    engine = RemoteEngine(cfg, "127.0.0.1:1", ["127.0.0.1:2"], vocab_size=VOCAB)
    try:
        want = message_limit_bytes(VOCAB, BATCH, K)
        assert engine.scheduler.verifier.message_limit == want
        assert [rep.drafter.message_limit for rep in engine.scheduler.replicas] == [want]
    finally:
        engine.close()


@pytest.mark.slow
def test_a_full_verify_at_128k_vocabulary_k8_batch64_succeeds():
    """The issue's size, sent: 64 requests x 8 drafted tokens with dense fp16 q at vocabulary 131,072
    (the rejection coupling's wire form), one Verify of about 134 MB through a worker server and the
    remote verifier with the limits the config gives them; every q row arrives and decodes."""
    _verify_round_trip(131072, 64, 8)
