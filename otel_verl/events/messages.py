"""Opt-in message content in the GenAI conventions' shape (``gen_ai.input.messages`` /
``gen_ai.output.messages``): JSON arrays of ``{"role", "parts": [...]}`` messages.

Agent loops keep their conversation as OpenAI-style chat messages (``role``, ``content``
as a string or a list of typed items, ``tool_calls``, ``tool_call_id``,
``reasoning_content``); :func:`chat_messages_json` turns those into GenAI messages with
``text``, ``reasoning``, ``tool_call`` and ``tool_call_response`` parts. Text the
model produced without a parsed structure (a decoded completion) becomes one ``text``
part (:func:`text_message_json`).

Bounds: every text, argument and response is cut at ``MAX_CONTENT_CHARS``; a
conversation whose JSON would pass ``MAX_MESSAGES_CHARS`` keeps its newest messages
(the earlier ones are on the earlier LLM spans of the same trajectory). The SDK's span
attribute limits (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``) apply on top.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable, List, Optional

from otel_verl import semconv as sc
from otel_verl.events._core import _content, _text
from otel_verl.ids import well_formed


def text_message_json(role: str, text: str, finish_reason: Optional[str] = None) -> str:
    """One message of one ``text`` part (plus ``finish_reason`` for an output message)."""
    return _dump([_text_message(role, text, finish_reason)])


def chat_messages_json(messages: Iterable[Any]) -> str:
    """OpenAI-style chat messages as a GenAI messages JSON array, newest kept within
    ``MAX_MESSAGES_CHARS``."""
    encoded: List[str] = []
    total = 2  # the brackets
    for message in reversed(list(messages)):
        item = _dump(_chat_message(message))
        if encoded and total + len(item) + 2 > sc.MAX_MESSAGES_CHARS:
            break  # always keeps the newest message (itself bounded per part)
        encoded.append(item)
        total += len(item) + 2
    return "[" + ", ".join(reversed(encoded)) + "]"


def _text_message(role: str, text: str, finish_reason: Optional[str] = None) -> Dict[str, Any]:
    message: Dict[str, Any] = {"role": role, "parts": [{"type": "text", "content": _content(text)}]}
    if finish_reason:
        message["finish_reason"] = _text(finish_reason)
    return message


def _chat_message(message: Any) -> Dict[str, Any]:
    if not isinstance(message, dict):
        return _text_message("user", str(message))
    role = _text(message.get("role") or "user")
    parts: List[Dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        parts.append({"type": "reasoning", "content": _content(reasoning)})
    content = message.get("content")
    if role in ("tool", "function"):
        parts.append({"type": "tool_call_response", "id": _optional_text(message.get("tool_call_id")),
                      "response": _content(_plain_text(content))})
    else:
        parts.extend(_content_parts(content))
    for call in message.get("tool_calls") or ():
        parts.append(_tool_call_part(call))
    return {"role": role, "parts": parts}


def _content_parts(content: Any) -> List[Dict[str, Any]]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": _content(content)}]
    parts = []
    for item in content if isinstance(content, (list, tuple)) else (content,):
        if isinstance(item, dict) and item.get("type", "text") == "text":
            parts.append({"type": "text", "content": _content(item.get("text", item.get("content", "")))})
        elif isinstance(item, dict):  # image, video, audio: the media itself is never captured
            parts.append({"type": _text(item.get("type"))})
        else:
            parts.append({"type": "text", "content": _content(item)})
    return parts


def _plain_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "\n".join(str(i.get("text", "")) if isinstance(i, dict) else str(i) for i in content)
    return str(content)


def _tool_call_part(call: Any) -> Dict[str, Any]:
    call = call if isinstance(call, dict) else {"function": {"name": getattr(call, "name", None),
                                                             "arguments": getattr(call, "arguments", None)}}
    function = call.get("function") or {}
    return {"type": "tool_call", "id": _optional_text(call.get("id")), "name": _text(function.get("name") or ""),
            "arguments": _arguments(function.get("arguments"))}


def _arguments(arguments: Any) -> Any:
    """Parsed arguments stay an object unless their JSON is too long; text is cut."""
    if isinstance(arguments, dict):
        encoded = _dump(arguments)
        return arguments if len(encoded) <= sc.MAX_CONTENT_CHARS else _content(encoded)
    return None if arguments is None else _content(arguments)


def _optional_text(value: Any) -> Optional[str]:
    return None if value is None else _text(value)


def _dump(value: Any) -> str:
    return well_formed(json.dumps(value, ensure_ascii=False, default=str))
