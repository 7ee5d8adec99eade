"""Response bodies in OpenAI's formats: whole responses, stream chunks, server-sent events."""

from __future__ import annotations

import json
import time
import uuid

# the pipeline's finish reasons -> OpenAI's: an EOS token or a stop string end a completion with
# "stop"; the max_tokens limit or a full context with "length"
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

STAT_KEYS = (
    "tokens_per_s",
    "ttft_s",
    "acceptance_rate",
    "mean_accepted",
    "k",
    "k_final",
    "fallbacks",
    "drafter",
    "speculative",
    "prefix_reused_tokens",
)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def extension(result, task: str, replica: int | None, queue_wait: float) -> dict:
    """The `specedge` object of a response: this request's speculation figures."""
    d = {k: result.stats.get(k) for k in STAT_KEYS}
    d.update(task=task, replica=replica, queue_wait_s=queue_wait, finish_reason=result.finish_reason)
    return d


class Formatter:
    """Bodies of one request (one id and creation time for all its chunks)."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id(chat)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, finish: str, usage_: dict, ext: dict) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            body = self._head("text_completion")
        body.update(choices=[choice], usage=usage_, specedge=ext)
        return body

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            body = self._head("text_completion")
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage_: dict, ext: dict) -> dict:
        """The chunk after the last choice (OpenAI's stream_options.include_usage form)."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage_, specedge=ext)
        return body


def event(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = event("[DONE]")
