"""A host whose clock is off: time.time() shifted by $IP_TEST_CLOCK_SKEW_S seconds.

Put on PYTHONPATH of the processes of one test host only (tests/test_multihost.py), so the
session measures that host's offset at setup and its timeline must be corrected by it.
"""
import os
import time

_SKEW = float(os.environ.get("IP_TEST_CLOCK_SKEW_S") or 0.0)
if _SKEW:
    _real_time = time.time
    time.time = lambda: _real_time() + _SKEW
