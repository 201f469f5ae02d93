"""What the serve client tests share: their checks and their runner."""

import signal
import sys
import time


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def bound(name, seconds):
    """Ends the script after `seconds` (exit status 2): a hang fails it instead of holding CI."""
    signal.signal(signal.SIGALRM, lambda *_: (print(f"{name}: timed out", flush=True), sys.exit(2)))
    signal.alarm(seconds)


def run(name, tests, header):
    """Runs every test, reporting each, then exits non-zero if any failed."""
    print(header, flush=True)
    failed = 0
    for t in tests:
        t0 = time.time()
        try:
            t()
            print(f"ok   {t.__name__} ({time.time() - t0:.1f} s)", flush=True)
        except Exception as e:  # report every test, then fail
            failed += 1
            print(f"FAIL {t.__name__}: {type(e).__name__}: {e}", flush=True)
    print(f"{name}: {len(tests) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)
