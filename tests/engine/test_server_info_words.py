"""What server info and token files say and take.

- ``/v1/models`` and GetServerInfo name the CPU kernels in a fixed vocabulary
  (:func:`specdist.api.admission.public_kernels`): a refused kernel library's absolute path, which the backend's
  own line names, never reaches a client.
- ``read_token``: lines starting with ``#`` are comments, a token has at least 16 characters; anything else is a
  one-line error naming the flag.
"""

from __future__ import annotations

import grpc
import pytest

try:  # the [http] extra's client (as tests/engine/test_security.py)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, tiny_config

from specdist import Engine
from specdist.api.serving import Backend, start_serving
from specdist.transport.security import SecurityConfigError, read_token
from specdist.v1 import specdist_pb2, specdist_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")

REFUSED = (
    "torch's kernels: /home/alice/.venv/lib/python3.11/site-packages/specdist/models/kernels/"
    "_specdist_kernels.so is writable by others (mode 777): not loaded"
)


def test_the_kernels_are_named_in_a_fixed_vocabulary():
    from specdist.api.admission import KERNELS_CPU, KERNELS_NOT_BUILT, KERNELS_OFF, KERNELS_REFUSED, public_kernels

    assert public_kernels("specdist's C kernels (AVX2, FMA, F16C)") == "specdist's C kernels (AVX2, FMA, F16C)"
    assert public_kernels(KERNELS_OFF) == KERNELS_OFF and public_kernels("") == ""
    assert public_kernels("torch's kernels: this CPU lacks AVX2, which the C kernels need") == KERNELS_CPU
    assert (
        public_kernels(
            "torch's kernels: the C kernels were not built with this install (no C compiler, or "
            "not x86-64); reinstall with one: pip install -e ."
        )
        == KERNELS_NOT_BUILT
    )
    for line in (
        REFUSED,
        "torch's kernels: /opt/x.so does not load (/opt/x.so: undefined symbol: f)",
        "specdist's C kernels (/tmp/evil)",
    ):
        assert public_kernels(line) == KERNELS_REFUSED


def test_server_info_carries_no_path_of_a_refused_kernel_library(tiny_models):
    refused = "torch's kernels: the C kernels were refused (the server log says why)"  # admission.KERNELS_REFUSED
    lt = LoopThread()
    engine = Engine.from_config(tiny_config(tiny_models, "none"))
    engine.cpu_kernels = REFUSED  # as cpu_kernels.backend() words a library it refused
    serving = lt.run(start_serving(backend=Backend(engine), host="127.0.0.1", port=0, drain_seconds=0, http_port=0))
    try:
        with grpc.insecure_channel(serving.address) as channel:
            info = specdist_pb2_grpc.SpecDecodeStub(channel).GetServerInfo(specdist_pb2.GetServerInfoRequest())
        assert info.cpu_kernels == refused
        with httpx.Client(trust_env=False, timeout=30) as http:
            card = http.get(f"http://{serving.http.address}/v1/models").json()["data"][0]
        assert card["specdist"]["cpu_kernels"] == refused
        assert "/home/alice" not in str(info) and "/home/alice" not in str(card)
    finally:
        lt.run(serving.stop())
        lt.close()


def test_read_token_skips_comments_and_refuses_short_tokens(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# tenant A\ntenant-a-0123456789abcdef\n\n  # tenant B\ntenant-b-0123456789abcdef\n")
    assert read_token(str(f)) == ("tenant-a-0123456789abcdef", "tenant-b-0123456789abcdef")
    f.write_text("# the one token\n0123456789abcdef\n")
    assert read_token(str(f)) == "0123456789abcdef"  # 16 characters: enough
    for text, why in (
        ("x\n", "token 1 has 1 characters"),
        ("tenant-a-0123456789abcdef\nshort\n", "token 2 has 5"),
        ("# only a comment\n\n", "no token in the file"),
    ):
        f.write_text(text)
        with pytest.raises(SecurityConfigError, match=why) as e:
            read_token(str(f))
        assert "\n" not in str(e.value) and "--auth-token-file" in str(e.value)
