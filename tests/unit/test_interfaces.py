"""The interfaces callers are typed with name what they use, and the types behind them keep them.

- :class:`~specdist.models.kv.base.KVCache`: both KV caches keep every member with the protocol's parameters, and
  the prefix cache touches a cache through nothing else (on a paged cache, also the blocks it counts room in);
- ``Request.proposal`` is a ``Proposal``; ``DraftRequest.state`` is what each draft method's ``start`` stores;
- :class:`~specdist.api.admission.ServedEngine`: what the servers read of the engine, which each engine they serve has.
"""

from __future__ import annotations

import inspect
import typing

import pytest

from specdist.errors import ResourceExhausted
from specdist.models.kv.base import KVCache
from specdist.models.kv.paged import PagedKVCache
from specdist.models.kv.prefix import MIN_PREFIX_TOKENS, PrefixCache
from specdist.models.kv.slots import SlotKVCache


def _members(proto: type) -> dict[str, object]:
    """The protocol's own members: its data annotations, methods and properties."""
    out: dict[str, object] = {name: None for name in proto.__annotations__}
    out.update(
        {
            name: v
            for name, v in vars(proto).items()
            if not name.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
        }
    )
    return out


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("cls", [SlotKVCache, PagedKVCache])
def test_both_caches_keep_the_kv_cache_protocol(cls):
    cache = SlotKVCache(2, 3, 1, 2, 64) if cls is SlotKVCache else PagedKVCache(2, 3, 1, 2, 64, 49, 4)
    for name, member in _members(KVCache).items():
        assert hasattr(cache, name), f"{cls.__name__} has no {name}"
        if inspect.isfunction(member):
            assert _params(getattr(cls, name)) == _params(member), f"{cls.__name__}.{name}'s parameters"
        elif isinstance(member, property):
            assert isinstance(getattr(cls, name), property), f"{cls.__name__}.{name} is no property"


class _Watched:
    """A cache whose attribute reads are recorded."""

    def __init__(self, cache):
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._cache, name)


PAGED_ROOM = {"num_blocks", "committed_blocks", "block_size", "tables", "blocks_for"}  # read where cache.paged


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_the_prefix_cache_uses_the_protocol(kind):
    raw = SlotKVCache(2, 2, 1, 2, 64) if kind == "slots" else PagedKVCache(2, 2, 1, 2, 64, 33, 4)
    cache = _Watched(raw)
    store = PrefixCache(cache, record=lambda op: None)
    prompt = list(range(1, MIN_PREFIX_TOKENS + 4))
    slot, held = store.acquire(prompt, (), 40)
    raw.ensure(slot, len(prompt))  # a forward's writes
    raw.lengths[slot] = len(prompt)
    store.release(slot, prompt)  # kept
    other, held = store.acquire(prompt + [9], (), 40)  # takes the kept slot over
    assert (other, held) == (slot, len(prompt))
    store.acquire([7] * 5, (), 40)
    with pytest.raises(ResourceExhausted):
        store.check_room([40])
    used = cache.read - set(_members(KVCache))
    assert used <= (PAGED_ROOM if kind == "paged" else set()), f"read beyond KVCache: {sorted(used)}"
    assert cache.read & set(_members(KVCache))  # (the proxy saw the reads)


def test_a_request_holds_a_proposal():
    from specdist.engine.request import Request
    from specdist.transport.protocol import Proposal

    assert typing.get_type_hints(Request)["proposal"] == Proposal | None


def _state_type(cls) -> type:
    """The state a proposer's ``start`` declares: ``r: DraftRequest[X]`` -> X."""
    from specdist.cores.proposers.base import DraftRequest

    hint = typing.get_type_hints(cls.start)["r"]
    assert typing.get_origin(hint) is DraftRequest, f"{cls.__name__}.start takes {hint}"
    (state,) = typing.get_args(hint)
    return state


def test_each_draft_method_names_the_state_it_stores():
    from specdist.cores.proposers import proposer_class, proposer_methods
    from specdist.cores.proposers.base import DraftRequest, Proposer
    from specdist.cores.proposers.ngram import NgramProposer
    from specdist.cores.proposers.suffix import SuffixProposer
    from specdist.sampling_params import SamplingParams

    state, none = typing.get_args(typing.get_type_hints(DraftRequest)["state"])
    assert isinstance(state, typing.TypeVar) and none is type(None)  # each method binds it
    keeping = {cls for cls in map(proposer_class, proposer_methods()) if cls.start is not Proposer.start}
    assert keeping  # ngram, suffix, hybrid, eagle3
    for cls in keeping:
        assert isinstance(_state_type(cls), type)
    for proposer in (NgramProposer(16), SuffixProposer(16)):
        r = DraftRequest([1, 2, 3, 1, 2], SamplingParams(), 0)
        proposer.start(r)
        assert isinstance(r.state, _state_type(type(proposer)))


def test_every_served_engine_has_what_the_servers_read():
    from specdist.api.admission import ServedEngine
    from specdist.api.replica_set import FrontEngine
    from specdist.engine.local import Engine
    from specdist.engine.remote import RemoteEngine

    members = set(_members(ServedEngine))
    assert members == {"config", "max_model_len", "k", "traits"}
    for cls in (Engine, RemoteEngine, FrontEngine):
        missing = {m for m in members if not hasattr(cls, m) and m not in typing.get_type_hints(cls)}
        assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
