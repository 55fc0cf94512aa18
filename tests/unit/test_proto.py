"""The specdist.v1 wire contracts: generated code, proto style rules, and specdist.transport.wire."""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import descriptor_pb2

from specdist import protogen
from specdist.api.codecs import finish_reason_to_proto
from specdist.cores.sampling import process_logits
from specdist.errors import InvalidArgument
from specdist.sampling_params import SamplingParams
from specdist.sampling_proto import sampling_params_from_proto, sampling_params_to_proto
from specdist.transport.protocol import Proposal
from specdist.transport.wire import (
    DENSE,
    ONE_HOT,
    SPARSE,
    decode_distribution,
    encode_distribution,
    fp16_exact,
    proposal_from_proto,
    proposal_to_proto,
)
from specdist.v1 import common_pb2, draft_pb2, specdist_pb2_grpc, target_pb2, target_pb2_grpc

# ---------------------------------------------------------------- (a) generated code


def test_generated_code_is_current_from_any_cwd(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "specdist.protogen", "--check"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, f"stale generated code; run `python -m specdist.protogen`\n{done.stdout}{done.stderr}"


def test_check_lists_changed_missing_and_leftover_files(tmp_path, monkeypatch):
    copy = tmp_path / "v1"
    shutil.copytree(protogen.OUT_DIR, copy)
    (copy / "common_pb2.py").write_text("# edited by hand\n")
    (copy / "draft_pb2.pyi").unlink()
    (copy / "gone_pb2.py").write_text("# its .proto was deleted\n")
    monkeypatch.setattr(protogen, "OUT_DIR", copy)
    assert protogen.stale_files() == ["common_pb2.py", "draft_pb2.pyi", "gone_pb2.py"]
    assert protogen.main(["--check"]) == 1
    assert protogen.main([]) == 0  # regenerates into the copy
    assert protogen.stale_files() == []
    assert not (copy / "gone_pb2.py").exists()


def test_generated_imports_stay_inside_the_package():
    for path in protogen.OUT_DIR.glob("*_pb2*.py"):
        for line in path.read_text().splitlines():
            if re.match(r"\s*(from|import) ", line) and "_pb2" in line:
                assert line.lstrip().startswith("from specdist.v1 import"), f"{path.name}: {line}"
            assert not re.match(r"\s*(from|import) proto\b", line), f"{path.name}: {line}"


def test_services_have_stubs():
    assert hasattr(specdist_pb2_grpc, "SpecDecodeStub") and hasattr(target_pb2_grpc, "TargetWorkerStub")
    svc = common_pb2.DESCRIPTOR.pool.FindServiceByName("specdist.v1.DraftWorker")
    assert [m.name for m in svc.methods] == ["Start", "Propose", "Release"]


# ---------------------------------------------------------------- (b) proto style


@pytest.fixture(scope="module")
def proto_files() -> list[descriptor_pb2.FileDescriptorProto]:
    """Every .proto, parsed by protoc itself, with comments (source info)."""
    protos = sorted(p.relative_to(protogen.ROOT).as_posix() for p in protogen.PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", "--include_source_info",
               f"--descriptor_set_out={out}", *protos]  # fmt: skip
        subprocess.run(cmd, cwd=protogen.ROOT, check=True)
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert {f.name for f in files} == {f"specdist/v1/{n}.proto" for n in ("common", "specdist", "target", "draft")}
    return list(files)


def _declarations(fd: descriptor_pb2.FileDescriptorProto):
    """(source path, dotted name) of every message, field, oneof, enum, enum value, service, rpc."""

    def message(m, path, name):
        yield path, name
        for i, f in enumerate(m.field):
            yield path + (2, i), f"{name}.{f.name}"
        for i, o in enumerate(m.oneof_decl):
            synthetic = any(f.proto3_optional and f.oneof_index == i for f in m.field if f.HasField("oneof_index"))
            if not synthetic:  # the hidden oneof of an `optional` field has no source
                yield path + (8, i), f"{name}.{o.name}"
        for i, n in enumerate(m.nested_type):
            yield from message(n, path + (3, i), f"{name}.{n.name}")
        for i, e in enumerate(m.enum_type):
            yield from enum(e, path + (4, i), f"{name}.{e.name}")

    def enum(e, path, name):
        yield path, name
        for i, v in enumerate(e.value):
            yield path + (2, i), f"{name}.{v.name}"

    for i, m in enumerate(fd.message_type):
        yield from message(m, (4, i), m.name)
    for i, e in enumerate(fd.enum_type):
        yield from enum(e, (5, i), e.name)
    for i, s in enumerate(fd.service):
        yield (6, i), s.name
        for j, rpc in enumerate(s.method):
            yield (6, i, 2, j), f"{s.name}.{rpc.name}"


def test_every_declaration_has_a_comment(proto_files):
    missing, seen = [], 0
    for fd in proto_files:
        assert fd.package == "specdist.v1", fd.name
        locations = {tuple(loc.path): loc for loc in fd.source_code_info.location}
        for path, name in _declarations(fd):
            seen += 1
            loc = locations.get(path)
            if loc is None or not (loc.leading_comments.strip() or loc.trailing_comments.strip()):
                missing.append(f"{fd.name}: {name}")
    assert seen > 100  # the walk really reached the fields
    assert not missing, "no comment directly above or after:\n" + "\n".join(missing)


def _all_enums(proto_files):
    for fd in proto_files:
        yield from fd.enum_type
        stack = list(fd.message_type)
        while stack:
            m = stack.pop()
            yield from m.enum_type
            stack.extend(m.nested_type)


def test_enums_start_with_unspecified_and_carry_their_prefix(proto_files):
    enums = list(_all_enums(proto_files))
    assert {e.name for e in enums} == {
        "FinishReason",
        "DistributionFormat",
        "PipelineOutcome",
        "Coupling",
        "HiddenDtype",
    }
    for e in enums:
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", e.name).upper() + "_"
        assert e.value[0].number == 0 and e.value[0].name == prefix + "UNSPECIFIED", e.name
        assert all(v.name.startswith(prefix) for v in e.value), e.name


def test_no_two_messages_repeat_the_same_fields(proto_files):
    """A shape two services carry is one message of common.proto (the target's Prefill and a draft's Start
    both admit common.proto's StartItem), not two copies that can drift apart. Messages of up to two fields
    (a list of ids, a list of items) may coincide."""
    shapes: dict[tuple, list[str]] = {}
    for fd in proto_files:
        for m in fd.message_type:
            if len(m.field) > 2:
                shape = tuple(sorted((f.name, f.number, f.type, f.type_name, f.label) for f in m.field))
                shapes.setdefault(shape, []).append(f"{fd.name}:{m.name}")
    assert [names for names in shapes.values() if len(names) > 1] == []
    start = common_pb2.StartItem.DESCRIPTOR
    for request in (target_pb2.PrefillRequest, draft_pb2.StartRequest):
        assert request.DESCRIPTOR.fields_by_name["items"].message_type is start


# ---------------------------------------------------------------- (c) sampling params


def test_unset_fields_take_sampling_params_defaults():
    sp = sampling_params_from_proto(common_pb2.SamplingParams())
    assert sp == SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.seed) == (1.0, 1.0, 0, 16, None)


def test_explicit_zero_temperature_is_greedy_not_default():
    assert sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0)).greedy
    assert not sampling_params_from_proto(common_pb2.SamplingParams()).greedy


def test_round_trip_through_bytes():
    sp = SamplingParams(
        max_tokens=7, temperature=0.8, top_k=40, top_p=0.95, seed=2**64 - 1,
        stop=["\n\n", "END"], stop_token_ids=[0, 2], ignore_eos=True,
    )  # fmt: skip
    wire = common_pb2.SamplingParams.FromString(sampling_params_to_proto(sp).SerializeToString())
    assert sampling_params_from_proto(wire) == sp  # 0.8 comes back as 0.8, not its float32 expansion
    unseeded = sampling_params_to_proto(SamplingParams())
    assert not unseeded.HasField("seed") and unseeded.HasField("temperature")


def test_every_sampling_field_travels():
    # one message for SamplingParams, field for field: each field off its default comes back as it was sent
    sp = SamplingParams(
        max_tokens=7, temperature=0.5, top_k=40, top_p=0.5, seed=3, stop=["END"], stop_token_ids=[2],
        ignore_eos=True, logprobs=5,
    )  # fmt: skip
    assert all(getattr(sp, f.name) != f.default for f in dataclasses.fields(SamplingParams)), "set every field"
    wire = common_pb2.SamplingParams.FromString(sampling_params_to_proto(sp).SerializeToString())
    assert sampling_params_from_proto(wire) == sp


@pytest.mark.parametrize(
    "fields, bad",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ],
)
def test_each_invalid_field_is_named(fields, bad):
    with pytest.raises(InvalidArgument) as err:
        sampling_params_from_proto(common_pb2.SamplingParams(**fields))
    assert err.value.field == f"params.{bad}"
    assert str(err.value).startswith(f"params.{bad}: ")
    with pytest.raises(InvalidArgument) as err:
        sampling_params_from_proto(common_pb2.SamplingParams(**fields), field="items[2].params")
    assert err.value.field == f"items[2].params.{bad}"


def test_finish_reasons():
    assert finish_reason_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED
    assert finish_reason_to_proto("stop") == common_pb2.FINISH_REASON_STOP
    assert finish_reason_to_proto("length") == common_pb2.FINISH_REASON_LENGTH
    assert finish_reason_to_proto("abort") == common_pb2.FINISH_REASON_ABORT
    assert finish_reason_to_proto("error") == common_pb2.FINISH_REASON_ERROR
    with pytest.raises(ValueError):
        finish_reason_to_proto("done")


# ---------------------------------------------------------------- (d) draft distributions


def _q(vocab: int, seed: int, scale: float = 5.0, top_k: int = 0, top_p: float = 1.0, temp: float = 0.8):
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return process_logits(logits, torch.tensor([temp]), torch.tensor([top_k]), torch.tensor([top_p]))[0]  # [V]


# Peaked, flat, top-k, top-p, and a large vocabulary; seeds 0..3 each.
CASES = [(1000, {}), (1000, {"scale": 0.3}), (1000, {"top_k": 50}), (1000, {"top_p": 0.9}), (49152, {"scale": 8.0})]


@pytest.mark.parametrize("vocab, kw", CASES)
@pytest.mark.parametrize("fmt", [DENSE, SPARSE])
def test_fp16_round_trip_is_bit_exact(vocab, kw, fmt):
    for seed in range(4):
        q = _q(vocab, seed, **kw)
        r = fp16_exact(q)  # what the draft samples from
        tok = int(torch.multinomial(r, 1, generator=torch.Generator().manual_seed(seed)))
        assert r.dtype == torch.float32 and abs(float(r.double().sum()) - 1) < 1e-6
        for sent in (q, r):  # encoding q or the already-rounded r sends the same bits
            msg = common_pb2.DraftDistribution.FromString(encode_distribution(sent, fmt).SerializeToString())
            assert torch.equal(decode_distribution(msg, vocab, tok), r)


def test_round_trip_holds_where_plain_rounding_is_not_idempotent():
    # q_max just below 1 - 2**-12: fp16(q / sum) flips the top entry between 1.0 and
    # 1 - 2**-11 for some d. Scaling by the max before rounding keeps it fixed.
    for d in torch.linspace(1e-4, 4e-4, 300).tolist():
        q = torch.full((1000,), d / 999)
        q[0] = 1 - d
        r = fp16_exact(q)
        assert torch.equal(decode_distribution(encode_distribution(r, DENSE), 1000, 0), r), d


def test_fp16_exact_is_the_same_in_any_summation_order():
    q = _q(49152, 7, scale=1.0)
    perm = torch.randperm(49152, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fp16_exact(q[perm]), fp16_exact(q)[perm])


def test_sparse_carries_exactly_the_top_k_support():
    q = _q(1000, 3, top_k=50)
    msg = encode_distribution(q, SPARSE)
    support = q.nonzero().squeeze(-1)
    assert list(msg.token_ids) == support.tolist() and len(msg.values) == 2 * 50
    dense = decode_distribution(encode_distribution(q, DENSE), 1000, int(support[0]))
    assert torch.equal(decode_distribution(msg, 1000, int(support[0])), dense)
    assert torch.equal(dense.nonzero().squeeze(-1), support)


def test_values_are_little_endian_fp16():
    q = torch.tensor([0.0, 0.25, 0.75])
    msg = encode_distribution(q, DENSE)
    assert msg.values == np.array([0.0, 0.25 / 0.75, 1.0], dtype="<f2").tobytes()  # scaled so the max is 1.0
    assert msg.values[-2:] == b"\x00\x3c"  # 1.0 is 0x3C00, low byte first


def test_one_hot_has_no_payload():
    q = process_logits(torch.randn(1, 100), torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]))[0]  # greedy
    tok = int(q.argmax())
    msg = encode_distribution(q, ONE_HOT)
    assert msg.values == b"" and len(msg.token_ids) == 0 and msg.ByteSize() == 2
    assert torch.equal(decode_distribution(msg, 100, tok), q)
    assert torch.equal(fp16_exact(q), q)  # a one-hot q survives fp16 too
    with pytest.raises(ValueError, match="one-hot"):
        encode_distribution(_q(100, 0), ONE_HOT)


def _dist(fmt=DENSE, values=(), ids=()):
    return common_pb2.DraftDistribution(format=fmt, values=np.array(values, dtype="<f2").tobytes(), token_ids=ids)


@pytest.mark.parametrize(
    "msg, tok, bad",
    [
        (_dist(common_pb2.DISTRIBUTION_FORMAT_UNSPECIFIED), 0, "format"),
        (_dist(DENSE, [0.5, 0.5]), 0, "values"),  # 2 values, vocabulary of 4
        (common_pb2.DraftDistribution(format=DENSE, values=b"\x00" * 7), 0, "values"),  # odd byte count
        (_dist(DENSE, [0.5, -0.1, 0.5, 0.1]), 0, "values"),
        (_dist(DENSE, [0.5, math.nan, 0.5, 0.1]), 0, "values"),
        (_dist(DENSE, [0.5, 2.0, 0.5, 0.1]), 0, "values"),
        (_dist(SPARSE, [0.5, 0.5], [1]), 1, "values"),  # ids and values differ in length
        (_dist(SPARSE, [0.5, 0.5], [2, 1]), 1, "token_ids"),  # not ascending
        (_dist(SPARSE, [0.5, 0.5], [1, 1]), 1, "token_ids"),  # duplicate
        (_dist(SPARSE, [0.5, 0.5], [1, 4]), 1, "token_ids"),  # outside the vocabulary
        (_dist(SPARSE, [0.5, 0.5], [-1, 1]), 1, "token_ids"),
        (_dist(ONE_HOT), 4, ""),  # drafted token outside the vocabulary
    ],
)
def test_malformed_distributions_are_named(msg, tok, bad):
    with pytest.raises(InvalidArgument) as err:
        decode_distribution(msg, 4, tok, field="items[0].draft_probs[1]")
    assert err.value.field == "items[0].draft_probs[1]" + (f".{bad}" if bad else "")


# ---------------------------------------------------------------- (e) bytes on the wire


def _propose_bytes(vocab_size: int, k: int, support: int) -> dict[str, int]:
    """Serialized ProposeResponse bytes for one request drafting k tokens, per format.

    The request id is a 36-character UUID; token ids sit at the top of the vocabulary
    (3-byte varints for V >= 16384); the sparse q has ``support`` entries spread over
    the vocabulary. Keys: "DENSE_FP16", "SPARSE_FP16", "ONE_HOT".
    """
    ids = torch.linspace(vocab_size - 1, 0, support).round().long()  # [support], ids[0] = V - 1
    spread = torch.zeros(vocab_size).index_fill_(0, ids, 1.0 / support)  # [V]
    one_hot = torch.zeros(vocab_size).index_fill_(0, ids[:1], 1.0)  # [V]
    sizes = {}
    for name, fmt, q in (("DENSE_FP16", DENSE, spread), ("SPARSE_FP16", SPARSE, spread), ("ONE_HOT", ONE_HOT, one_hot)):
        probs = [encode_distribution(q, fmt)] * k
        proposal = draft_pb2.Proposal(request_id="0" * 36, token_ids=[vocab_size - 1] * k, probs=probs)
        sizes[name] = draft_pb2.ProposeResponse(proposals=[proposal]).ByteSize()
    return sizes


def test_wire_bytes_per_step():
    sizes = _propose_bytes(49152, 4, 50)
    assert sizes["ONE_HOT"] < sizes["SPARSE_FP16"] < sizes["DENSE_FP16"]
    assert sizes["DENSE_FP16"] == pytest.approx(4 * 49152 * 2, rel=0.01)
    assert _propose_bytes(49152, 4, 1000)["SPARSE_FP16"] > sizes["SPARSE_FP16"]
    assert _propose_bytes(49152, 4, 1000)["ONE_HOT"] == sizes["ONE_HOT"]
    assert draft_pb2.ProposeResponse().ByteSize() == 0


def test_start_items_carry_the_coupling_both_ways():
    """The coupling reaches both cores over the wire; an unset one (an older caller) is rejection."""
    from specdist.sampling_params import SamplingParams
    from specdist.transport.protocol import StartItem
    from specdist.transport.wire import start_items_from_proto, start_items_to_proto
    from specdist.v1 import common_pb2, draft_pb2, target_pb2

    items = [StartItem("a", [1, 2], SamplingParams(), 5, "gumbel"), StartItem("b", [3], SamplingParams(), 6)]
    for message in (target_pb2.PrefillRequest, draft_pb2.StartRequest):
        back = start_items_from_proto(message.FromString(start_items_to_proto(items, message).SerializeToString()))
        assert [it.coupling for it in back] == ["gumbel", "rejection"]
    unset = target_pb2.PrefillRequest(items=[common_pb2.StartItem(request_id="c", prompt_token_ids=[1], seed=1)])
    assert start_items_from_proto(unset)[0].coupling == "rejection"
    bad = target_pb2.PrefillRequest(items=[common_pb2.StartItem(request_id="c", prompt_token_ids=[1], coupling=7)])
    with pytest.raises(Exception, match=r"items\[0\]\.coupling"):
        start_items_from_proto(bad)


def test_proposals_carry_match_lengths_and_cut_as_a_prefix():
    """A suffix proposal's match lengths travel with it (the scheduler prices its positions by them); a list
    that does not fit its tokens is dropped, as they never affect exactness; a cut keeps every field's prefix."""
    p = Proposal("r0", [5, 6, 7], match_lengths=[12, 13, 2])
    back = proposal_from_proto(draft_pb2.Proposal.FromString(proposal_to_proto(p, 50).SerializeToString()))
    assert (back.token_ids, back.match_lengths) == ([5, 6, 7], [12, 13, 2])
    assert proposal_from_proto(proposal_to_proto(Proposal("r1", [5, 6]), 50)).match_lengths is None
    odd = draft_pb2.Proposal(request_id="r2", token_ids=[5, 6], match_lengths=[3])
    assert proposal_from_proto(odd).match_lengths is None
    cut = back.truncated(2)
    assert (cut.token_ids, cut.match_lengths, len(cut.wire)) == ([5, 6], [12, 13], 2)
    q = torch.full((3, 50), 0.02)
    assert back.truncated(3) is back and Proposal("r3", [1, 2, 3], q=q).truncated(1).q.shape == (1, 50)
