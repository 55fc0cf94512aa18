"""What the tests share besides fixtures (tests/conftest.py): helpers, the model zoo, the G-test, scripts
run in subprocesses (``SUPPORT``: their folder)."""

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
