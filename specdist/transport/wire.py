"""Conversions between specdist's Python objects and the specdist.v1 wire messages.

Pure: messages only, no gRPC server or channel code, so the remote transports
(:mod:`specdist.transport.remote`), the workers' servicers and the tests share one definition of
every conversion between the dataclasses of :mod:`specdist.transport.protocol` and protobuf (the
items' SamplingParams by :mod:`specdist.sampling_proto`, which the public API shares), and
the sizes those messages reach (:func:`message_limit_bytes`, the gRPC message limit of the
workers and their callers, as options by :func:`grpc_message_options`).

Draft distributions (see ``DraftDistribution`` in proto/specdist/v1/common.proto):
exactness needs the target to verify against exactly the q the draft sampled from.
A draft that ships q as fp16 samples from ``r = fp16_exact(q)`` and sends
``encode_distribution(q, fmt)`` (or, equally, of r); ``decode_distribution`` then
returns r bit for bit, on any device.
"""

from __future__ import annotations

import numpy as np
import torch

from specdist import logprobs
from specdist.errors import InvalidArgument
from specdist.sampling_params import MAX_LOGPROBS
from specdist.sampling_proto import sampling_params_from_proto, sampling_params_to_proto
from specdist.transport.protocol import HIT, MISS, Prefilled, Proposal, ProposeItem, StartItem, Verified, VerifyItem
from specdist.v1 import common_pb2, draft_pb2, target_pb2

DENSE = common_pb2.DISTRIBUTION_FORMAT_DENSE_FP16
SPARSE = common_pb2.DISTRIBUTION_FORMAT_SPARSE_FP16
ONE_HOT = common_pb2.DISTRIBUTION_FORMAT_ONE_HOT
_FP16_LE = np.dtype("<f2")  # the wire is little-endian whatever the host

# ---------------------------------------------------------------- draft distributions


def fp16_exact(q: torch.Tensor) -> torch.Tensor:  # [..., V] float -> [..., V] float32, same device
    """The q a draft must sample from when it ships q as DENSE_FP16 or SPARSE_FP16.

    q scaled so that its largest entry is 1.0, rounded to fp16, renormalised. Both
    ``decode_distribution(encode_distribution(q, fmt))`` and
    ``decode_distribution(encode_distribution(fp16_exact(q), fmt))`` return exactly
    these float32 bits (row by row). Each row needs a positive entry.
    """
    return _normalise(_fp16_weights(q))


def _fp16_weights(q: torch.Tensor) -> torch.Tensor:  # [..., V] float -> [..., V] float16 in [0, 1], max 1.0
    # Scaling by the max makes this idempotent: _fp16_weights(_normalise(h)) == h, because
    # h / sum(h) / (1 / sum(h)) is within 2**-22 of h, far inside h's fp16 rounding interval.
    # Each step rounds once (float64 -> float32 -> float16), the same on every device.
    w = q.double()
    return (w / w.amax(-1, keepdim=True)).float().to(torch.float16)


def _normalise(h: torch.Tensor) -> torch.Tensor:  # [..., V] float16 in [0, 1] -> [..., V] float32, rows sum to 1
    w = h.double()
    # Every fp16 in [0, 1] is a multiple of 2**-24 and the partial sums stay far below
    # 2**29, so this float64 sum is exact in any order: every device gets the same bits.
    return (w / w.sum(-1, keepdim=True)).float()


def encode_distribution(q: torch.Tensor, fmt: int) -> common_pb2.DraftDistribution:
    """q: [V] processed draft probabilities -> message; the receiver decodes fp16_exact(q).

    SPARSE_FP16 lists the entries nonzero in fp16 (ascending ids); ONE_HOT needs a q
    with exactly one nonzero entry (it then carries no payload).
    """
    if q.dim() != 1:
        raise ValueError(f"q must be one distribution of shape [V], got shape {tuple(q.shape)}")
    if fmt == ONE_HOT:
        if int((q != 0).sum()) != 1:
            raise ValueError("ONE_HOT needs a one-hot q (exactly one nonzero entry)")
        return common_pb2.DraftDistribution(format=ONE_HOT)
    if not bool(q.max() > 0):
        raise ValueError("q needs a positive entry")
    h = _fp16_weights(q).cpu()  # [V]
    if fmt == DENSE:
        return common_pb2.DraftDistribution(format=DENSE, values=_fp16_bytes(h))
    if fmt == SPARSE:
        ids = h.nonzero().squeeze(-1)  # [S] ascending
        return common_pb2.DraftDistribution(format=SPARSE, values=_fp16_bytes(h[ids]), token_ids=ids.tolist())
    raise ValueError(f"cannot encode distribution format {fmt!r}")


def _fp16_bytes(h: torch.Tensor) -> bytes:  # [N] float16 on CPU
    return h.numpy().astype(_FP16_LE, copy=False).tobytes()


def decode_distribution(
    msg: common_pb2.DraftDistribution, vocab_size: int, drafted_token: int, field: str = "draft_probs"
) -> torch.Tensor:  # [vocab_size] float32 on CPU, sums to 1
    """The q the drafted token was sampled from. Raises InvalidArgument naming ``field.*``.

    Whether q gives the drafted token positive probability is the verifier's check, the same for
    q from the wire and from an in-process drafter (:meth:`specdist.cores.target.VerifierCore.verify`)."""
    if not 0 <= drafted_token < vocab_size:
        raise InvalidArgument(field, f"drafted token {drafted_token} is outside the vocabulary [0, {vocab_size})")
    if msg.format == ONE_HOT:
        q = torch.zeros(vocab_size)
        q[drafted_token] = 1.0
        return q
    if len(msg.values) % 2:
        raise InvalidArgument(f"{field}.values", f"must hold whole fp16 values, got {len(msg.values)} bytes")
    values = torch.from_numpy(np.frombuffer(msg.values, dtype=_FP16_LE).astype(np.float16))  # [N]
    if msg.format == DENSE:
        if len(values) != vocab_size:
            raise InvalidArgument(f"{field}.values", f"DENSE_FP16 needs {vocab_size} fp16 values, got {len(values)}")
        h = values  # [V]
    elif msg.format == SPARSE:
        ids = torch.tensor(msg.token_ids, dtype=torch.long)  # [N]
        if len(ids) != len(values):
            raise InvalidArgument(f"{field}.values", f"SPARSE_FP16 has {len(ids)} token_ids but {len(values)} values")
        if len(ids) and (ids[0] < 0 or ids[-1] >= vocab_size or bool((ids.diff() <= 0).any())):
            raise InvalidArgument(f"{field}.token_ids", f"must be strictly ascending ids in [0, {vocab_size})")
        h = torch.zeros(vocab_size, dtype=torch.float16).index_copy_(0, ids, values)  # [V]
    else:
        raise InvalidArgument(f"{field}.format", f"must be DENSE_FP16, SPARSE_FP16 or ONE_HOT, got {msg.format}")
    if not bool(((h >= 0) & (h <= 1)).all()):  # NaN fails this too
        raise InvalidArgument(f"{field}.values", "probabilities must be finite and in [0, 1]")
    return _normalise(h)


# ---------------------------------------------------------------- sizes


GRPC_DEFAULT_MESSAGE_BYTES = 4 << 20  # grpc's default receive limit
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1  # grpc's message-length options are C ints
NO_MESSAGE_LIMIT = -1  # grpc's "no limit" for a message-length option
MAX_DRAFT_TOKENS = 64  # the longest draft a config allows (draft.num_speculative_tokens <= 64)
MESSAGE_SAFETY_FACTOR = 2  # headroom over the computed largest message
_REQUEST_ID_BYTES = 1024  # a request id: at most 256 characters (the coordinator's bound), 4 UTF-8 bytes each


def message_limit_bytes(
    vocab_size: int, max_batch_size: int, max_draft_tokens: int, hidden_width: int = 0, max_model_len: int = 0
) -> int:
    """The gRPC message limit of workers (and their callers) serving these settings.

    The largest Verify request or Propose response they can exchange: ``max_batch_size``
    items, each with ``max_draft_tokens`` drafted tokens whose q is the largest row the
    drafts choose (dense fp16: 2 bytes per vocabulary entry), with the longest request ids
    and token ids, and with EAGLE-3 drafts (``hidden_width`` values per position) the hidden
    states of a whole context of ``max_model_len`` positions in float32 (a Prefill response or
    a first Propose request); times ``MESSAGE_SAFETY_FACTOR``, never below grpc's 4 MiB default
    nor above what grpc accepts.
    """
    per_item = _largest_item_bytes(vocab_size, max_draft_tokens) + 4 * hidden_width * max_model_len
    largest = max_batch_size * per_item
    return min(GRPC_MAX_MESSAGE_BYTES, max(GRPC_DEFAULT_MESSAGE_BYTES, MESSAGE_SAFETY_FACTOR * largest))


def _largest_item_bytes(vocab_size: int, k: int) -> int:
    """Serialized bytes one item adds to a VerifyRequest, VerifyResponse or ProposeResponse, at its largest
    (a result carries k + 1 tokens' log-probabilities with MAX_LOGPROBS top entries each)."""
    rid, ids, rows = "x" * _REQUEST_ID_BYTES, [vocab_size - 1] * k, [_largest_row(vocab_size)] * k
    verify = target_pb2.VerifyRequest(
        items=[target_pb2.VerifyItem(request_id=rid, draft_token_ids=ids, draft_probs=rows, seq_len=2**32 - 1)]
    )
    propose = draft_pb2.ProposeResponse(
        proposals=[
            draft_pb2.Proposal(request_id=rid, token_ids=ids, probs=rows, pipeline=draft_pb2.PIPELINE_OUTCOME_MISS)
        ]
    )
    top = tuple((vocab_size - 1, -1.0) for _ in range(min(MAX_LOGPROBS, vocab_size)))
    result = target_pb2.VerifyResponse(
        results=[
            target_pb2.VerifyResult(
                request_id=rid,
                num_accepted=k,
                next_token_id=vocab_size - 1,
                logprobs=logprobs.to_proto([logprobs.TokenLogprob(-1.0, top)] * (k + 1)),
            )
        ]
    )
    return max(verify.ByteSize(), propose.ByteSize(), result.ByteSize())


def _largest_row(vocab_size: int) -> common_pb2.DraftDistribution:
    """The larger of a dense fp16 row and the largest sparse row ``_choose_format`` picks
    (SPARSE_MAX_FRACTION of the vocabulary, with the longest ids: larger for huge vocabularies)."""
    support = int(SPARSE_MAX_FRACTION * vocab_size)
    dense = common_pb2.DraftDistribution(format=DENSE, values=bytes(2 * vocab_size))
    sparse = common_pb2.DraftDistribution(
        format=SPARSE, values=bytes(2 * support), token_ids=[vocab_size - 1] * support
    )
    return max(dense, sparse, key=lambda row: row.ByteSize())


def grpc_message_options(limit: int) -> list[tuple[str, int]]:
    """grpc server or channel options: messages up to ``limit`` bytes either way (``NO_MESSAGE_LIMIT``:
    any size); grpc refuses a larger one with RESOURCE_EXHAUSTED."""
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


# ---------------------------------------------------------------- transport dataclasses <-> messages
# ``*_to_proto`` run on the caller's side (trusted dataclasses); ``*_from_proto`` run in the
# servicers and validate what only the wire can get wrong, naming the field (items[i].params...).


def start_items_to_proto(items: list[StartItem], message):
    """[StartItem] -> PrefillRequest or StartRequest (both carry common.proto's StartItem)."""
    return message(
        items=[
            common_pb2.StartItem(
                request_id=it.request_id,
                prompt_token_ids=it.prompt_ids,
                params=sampling_params_to_proto(it.params),
                seed=it.seed,
                coupling=_COUPLING_TO_PROTO[it.coupling],
                hidden_layers=it.hidden_layers,
                tenant=it.tenant,
            )
            for it in items
        ]
    )


def start_items_from_proto(msg) -> list[StartItem]:
    return [
        StartItem(
            it.request_id,
            list(it.prompt_token_ids),
            sampling_params_from_proto(it.params, f"items[{i}].params"),
            int(it.seed),
            _coupling_from_proto(it.coupling, f"items[{i}].coupling"),
            tuple(it.hidden_layers),
            it.tenant,
        )
        for i, it in enumerate(msg.items)
    ]


# HiddenStates dtypes: torch dtype <-> wire enum (bfloat16 travels as its 2-byte pattern)
_HIDDEN_TO_PROTO = {
    torch.float32: common_pb2.HIDDEN_DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.HIDDEN_DTYPE_BFLOAT16,
    torch.float16: common_pb2.HIDDEN_DTYPE_FLOAT16,
}
_HIDDEN_FROM_PROTO = {v: k for k, v in _HIDDEN_TO_PROTO.items()}


def hidden_to_proto(h: torch.Tensor | None) -> common_pb2.HiddenStates | None:
    """[rows, width] hidden states (any device) as a message in their own dtype; None -> None."""
    if h is None:
        return None
    h = h.detach().to("cpu").contiguous()
    arr = (h.view(torch.int16) if h.dtype == torch.bfloat16 else h).numpy()  # numpy has no bfloat16
    return common_pb2.HiddenStates(
        rows=h.shape[0],
        width=h.shape[1],
        dtype=_HIDDEN_TO_PROTO[h.dtype],
        data=arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(),
    )


def hidden_from_proto(msg: common_pb2.HiddenStates, field: str) -> torch.Tensor:
    """A HiddenStates message as a [rows, width] CPU tensor of its dtype (INVALID_ARGUMENT naming
    ``field`` for an unknown dtype or a payload of the wrong length)."""
    dtype = _HIDDEN_FROM_PROTO.get(msg.dtype)
    if dtype is None:
        raise InvalidArgument(f"{field}.dtype", f"unknown hidden-state dtype {msg.dtype}")
    size = torch.empty(0, dtype=dtype).element_size()
    if len(msg.data) != msg.rows * msg.width * size:
        raise InvalidArgument(
            f"{field}.data",
            f"has {len(msg.data)} bytes; {msg.rows} x {msg.width} values of "
            f"{size} bytes need {msg.rows * msg.width * size}",
        )
    if not msg.data:
        return torch.zeros(msg.rows, msg.width, dtype=dtype)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return raw.view(dtype).reshape(msg.rows, msg.width)


def prefilled_to_proto(results: list[Prefilled]) -> target_pb2.PrefillResponse:
    asked = any(r.hidden is not None for r in results)
    return target_pb2.PrefillResponse(
        request_ids=[r.request_id for r in results],
        hidden=[hidden_to_proto(r.hidden) or common_pb2.HiddenStates() for r in results] if asked else [],
    )


def prefilled_from_proto(msg: target_pb2.PrefillResponse, items: list[StartItem]) -> list[Prefilled]:
    """One Prefilled per item: its hidden states where the item asked for them."""
    if msg.hidden and len(msg.hidden) != len(items):
        raise InvalidArgument("hidden", f"has {len(msg.hidden)} entries for {len(items)} items")
    return [
        Prefilled(
            it.request_id, hidden_from_proto(msg.hidden[i], f"hidden[{i}]") if msg.hidden and it.hidden_layers else None
        )
        for i, it in enumerate(items)
    ]


_COUPLING_TO_PROTO = {"rejection": common_pb2.COUPLING_REJECTION, "gumbel": common_pb2.COUPLING_GUMBEL}


def _coupling_from_proto(value: int, field: str) -> str:
    if value in (common_pb2.COUPLING_UNSPECIFIED, common_pb2.COUPLING_REJECTION):
        return "rejection"
    if value == common_pb2.COUPLING_GUMBEL:
        return "gumbel"
    raise InvalidArgument(field, f"unknown coupling {value}")


def propose_items_to_proto(items: list[ProposeItem]) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        items=[
            draft_pb2.ProposeItem(
                request_id=it.request_id,
                num_accepted=it.num_accepted,
                new_token_ids=it.new_token_ids,
                num_tokens=it.num_tokens,
                seq_len=it.seq_len,
                preferred_format=it.preferred_format,
                hidden=hidden_to_proto(it.hidden),
            )
            for it in items
        ]
    )


def propose_items_from_proto(msg: draft_pb2.ProposeRequest) -> list[ProposeItem]:
    out = []
    for i, it in enumerate(msg.items):
        if it.preferred_format not in (0, DENSE, SPARSE, ONE_HOT):
            raise InvalidArgument(f"items[{i}].preferred_format", f"unknown format {it.preferred_format}")
        hidden = hidden_from_proto(it.hidden, f"items[{i}].hidden") if it.HasField("hidden") else None
        out.append(
            ProposeItem(
                it.request_id,
                int(it.num_accepted),
                list(it.new_token_ids),
                int(it.num_tokens),
                int(it.seq_len),
                int(it.preferred_format),
                hidden,
            )
        )
    return out


SPARSE_MAX_FRACTION = 0.4  # sparse costs ~5 bytes per entry (fp16 + varint id), dense 2 per vocab entry


def proposal_to_proto(p: Proposal, vocab_size: int, preferred: int = 0) -> draft_pb2.Proposal:
    """One proposal as a message: ONE_HOT rows carry no payload, the others SPARSE or DENSE fp16."""
    if p.wire is not None:
        dists = list(p.wire)
    elif p.q is None:
        dists = [common_pb2.DraftDistribution(format=ONE_HOT) for _ in p.token_ids]
    else:
        q = p.q.cpu()  # [n, V]: the rows travel, so this is where they come to the host (one copy)
        dists = [encode_distribution(row, _choose_format(row, preferred, vocab_size)) for row in q]
    return draft_pb2.Proposal(
        request_id=p.request_id,
        token_ids=p.token_ids,
        probs=dists,
        pipeline=_PIPELINE_TO_PROTO[p.pipeline],
        match_lengths=p.match_lengths or (),
    )


def proposal_from_proto(msg: draft_pb2.Proposal) -> Proposal:
    """Keeps the distributions encoded (``wire``): a verifier decodes them, a remote one forwards them."""
    # the lengths only price positions (never exactness): a list that does not fit the tokens is dropped
    lengths = list(msg.match_lengths) if len(msg.match_lengths) == len(msg.token_ids) else []
    return Proposal(
        msg.request_id,
        list(msg.token_ids),
        wire=list(msg.probs),
        pipeline=_PIPELINE_FROM_PROTO.get(msg.pipeline),
        match_lengths=lengths or None,
    )


_PIPELINE_TO_PROTO = {
    None: draft_pb2.PIPELINE_OUTCOME_UNSPECIFIED,
    HIT: draft_pb2.PIPELINE_OUTCOME_HIT,
    MISS: draft_pb2.PIPELINE_OUTCOME_MISS,
}
_PIPELINE_FROM_PROTO = {v: k for k, v in _PIPELINE_TO_PROTO.items()}


def _choose_format(r: torch.Tensor, preferred: int, vocab_size: int) -> int:
    """A format that carries r (already fp16-exact) exactly; the preference when it can."""
    support = int((r > 0).sum())
    if support == 1 and preferred in (0, ONE_HOT):
        return ONE_HOT
    if preferred in (DENSE, SPARSE):
        return preferred
    return SPARSE if support < SPARSE_MAX_FRACTION * vocab_size else DENSE


def verify_items_to_proto(items: list[VerifyItem], vocab_size: int) -> target_pb2.VerifyRequest:
    out = target_pb2.VerifyRequest()
    for it in items:
        p = it.proposal
        if p is None:
            out.items.add(request_id=it.request_id, seq_len=it.seq_len)
        else:
            msg = proposal_to_proto(p, vocab_size)
            out.items.add(
                request_id=it.request_id, seq_len=it.seq_len, draft_token_ids=msg.token_ids, draft_probs=msg.probs
            )
    return out


def verify_items_from_proto(msg: target_pb2.VerifyRequest) -> list[VerifyItem]:
    return [
        VerifyItem(
            it.request_id, int(it.seq_len), Proposal(it.request_id, list(it.draft_token_ids), wire=list(it.draft_probs))
        )
        for it in msg.items
    ]


def verified_to_proto(results: list[Verified]) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        results=[
            target_pb2.VerifyResult(
                request_id=r.request_id,
                num_accepted=r.num_accepted,
                next_token_id=r.next_token,
                logprobs=logprobs.to_proto(r.logprobs or ()),
                hidden=hidden_to_proto(r.hidden),
            )
            for r in results
        ]
    )


def verified_from_proto(msg: target_pb2.VerifyResponse) -> list[Verified]:
    """A result without log-probabilities is a request that did not ask (every step emits a token)."""
    return [
        Verified(
            r.request_id,
            int(r.num_accepted),
            int(r.next_token_id),
            logprobs.from_proto(r.logprobs) or None,
            hidden_from_proto(r.hidden, f"results[{i}].hidden") if r.HasField("hidden") else None,
        )
        for i, r in enumerate(msg.results)
    ]
