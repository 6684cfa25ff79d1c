"""The client of the launcher tests' `Session.start` runs: on the controller's host, it starts a
session through a site launcher and reports, as JSON, where the ranks landed (host, launcher
rank) and one all-reduce from the doctor, or the error the start raised and how long it took.

Run: python launcher_driver.py OUT_JSON KWARGS_JSON   (KWARGS_JSON: Session.start's arguments)

Knows nothing of namespaces or of the site's daemons.
"""
from __future__ import annotations

import json
import sys
import time
import traceback


def drive(kwargs: dict) -> dict:
    from interactive_parallel import Session

    began = time.monotonic()
    try:
        s = Session.start(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads which error, and its words
        return {"error_type": type(exc).__name__, "error": str(exc), "elapsed_s": time.monotonic() - began}
    with s:
        return {"info": [{k: getattr(r, k) for k in ("rank", "host", "local_rank", "launcher_rank")}
                         for r in s.ranks_info],
                "doctor": [r.to_dict() for r in s.doctor()], "elapsed_s": time.monotonic() - began}


def main(argv: list[str]) -> int:
    out, kwargs = argv[0], json.loads(argv[1])
    try:
        result, code = drive(kwargs), 0
    except BaseException:  # noqa: BLE001 - the test reads the traceback from the file
        result, code = {"traceback": traceback.format_exc()}, 1
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
