"""Run the ```python blocks of one Markdown page, each in a fresh namespace, in this process
(started by tests/project/test_docs.py in a temporary folder); one JSON line per block on stdout."""

from __future__ import annotations

import json
import sys
import traceback


def main(blocks_json: str) -> None:
    """Execute each ``{"index", "code", "skip"}`` block; print its outcome as one JSON line."""
    for block in json.loads(blocks_json):
        if block["skip"]:
            outcome = {"index": block["index"], "status": "skipped", "why": block["skip"]}
        else:
            try:
                exec(compile(block["code"], f"block {block['index']}", "exec"),
                     {"__name__": "__doc_block__"})
                outcome = {"index": block["index"], "status": "passed"}
            except BaseException:  # noqa: BLE001  reported to the test, whatever it was
                outcome = {"index": block["index"], "status": "failed",
                           "why": traceback.format_exc()}
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main(sys.stdin.read())
