"""Run the ```python blocks of Markdown pages, each block in a fresh namespace (started by
tests/project/test_docs.py, one process for the pages of a session: the imports and compiled
kernels are paid once, not once a page).

Each request is one JSON line on stdin, ``{"folder", "blocks": [{"index", "code", "skip"}]}``:
the blocks run in ``folder``, and one JSON line per block gives its outcome, then ``{"done":
true}``. The blocks' own output goes to stderr and their stdin is empty, so that the requests and
these lines pass between the test and this process alone.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def run_block(block: dict) -> dict:
    """Execute one block in a fresh namespace; its outcome."""
    if block["skip"]:
        return {"index": block["index"], "status": "skipped", "why": block["skip"]}
    try:
        code = compile(block["code"], f"block {block['index']}", "exec")
        exec(code, {"__name__": "__doc_block__"})
    except BaseException:  # noqa: BLE001  reported to the test, whatever it was
        return {"index": block["index"], "status": "failed", "why": traceback.format_exc()}
    return {"index": block["index"], "status": "passed"}


def main() -> None:
    """Serve page requests from stdin until it closes."""
    requests = os.fdopen(os.dup(sys.stdin.fileno()))
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    with open(os.devnull) as nothing:  # the blocks (and programs they start) read nothing
        os.dup2(nothing.fileno(), sys.stdin.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the blocks print to stderr
    home = os.getcwd()
    for line in requests:
        request = json.loads(line)
        os.chdir(request["folder"])
        try:
            for block in request["blocks"]:
                sys.stdout.flush()
                print(json.dumps(run_block(block)), file=replies, flush=True)
        finally:
            sys.stdout.flush()
            os.chdir(home)
        print(json.dumps({"done": True}), file=replies, flush=True)


if __name__ == "__main__":
    main()
