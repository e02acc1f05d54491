"""An engine for the merged-burst tests, loaded by worker processes with
DIALOG_ENGINE=merge_engines:Parts: each step appends a JSON line (its msg_id, the msg_ids of its
parts, the time) to the file named by MERGE_ENGINE_LOG and answers with the texts it got. A
step whose text has "sleep" in it first writes a line with "started": true, then takes 10 s."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import anyio


class Parts:
    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        parts = [p["msg_id"] for p in message.get("parts", [])]
        if "sleep" in message["text"]:
            started = {"msg_id": message["msg_id"], "parts": parts, "started": True}
            with open(os.environ["MERGE_ENGINE_LOG"], "a", encoding="utf-8") as log:  # noqa: ASYNC230 (a short local append)
                log.write(json.dumps(started) + "\n")
            await anyio.sleep(10)
        line = {"msg_id": message["msg_id"], "parts": parts, "t": time.time()}
        with open(os.environ["MERGE_ENGINE_LOG"], "a", encoding="utf-8") as log:  # noqa: ASYNC230 (a short local append)
            log.write(json.dumps(line) + "\n")
        return state, "got: " + message["text"].replace("\n", " | ")
