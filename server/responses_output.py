"""A response's output items — reasoning, the assistant message, function calls, in that order —
built whole (`output_items`) or as the stream of Responses events that builds them
(`OutputStream`).

A stream numbers its events (`sequence_number` from 0) and keeps one item open at a time: an
item is announced (`response.output_item.added`, with its content part where it has one), grows
by deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`) and is closed (the `.done` events, then
`response.output_item.done`) when the next item starts or the output ends. The items the events
describe are the ones the final response carries (same ids), as the openai SDK's stream helper
requires.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.server import sse
from jaxserve.chat.tool_parsers import FunctionCallText


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------- the items
class OutputText(_Item):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(_Item):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(_Item):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: str = "completed"

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)


OutputItem = Annotated[OutputMessage | FunctionCallItem | ReasoningItem,
                      Field(discriminator="type")]


# ---------------------------------------------------------------------------- whole outputs
def item_id(prefix: str) -> str:
    """An output item's id: "rs_..." (reasoning), "msg_..." (message), "fc_..." (function call)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(text: str, logprobs: list[dict[str, Any]] | None) -> OutputMessage:
    return OutputMessage(id=item_id("msg"), content=[OutputText(text=text, logprobs=logprobs)])


def _reasoning(text: str) -> ReasoningItem:
    return ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=text)])


def output_items(reasoning: str | None, content: str | None,
                 calls: list[tuple[str, FunctionCallText]], logprobs: list[dict[str, Any]] | None,
                 complete: bool) -> list[OutputItem]:
    """The items of a whole output: its reasoning, its content (a message, also when the output
    holds nothing else, so that it is never empty) and its calls ((call id, call) pairs). The
    last item is "incomplete" when the output was cut (`complete` false)."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(_reasoning(reasoning))
    if content or not (items or calls):
        items.append(_message(content or "", logprobs))
    items += [FunctionCallItem(id=item_id("fc"), call_id=cid, name=c.name, arguments=c.arguments)
              for cid, c in calls]
    if not complete:
        items[-1].status = "incomplete"
    return items


# ---------------------------------------------------------------------------- streamed outputs
class OutputStream:
    """The events of one streamed output and the items they build."""

    def __init__(self, logprobs: bool = False):
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self.logprobs = logprobs  # the message's text parts carry logprobs
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallItem] = {}  # the tool-call stream's index -> item

    def event(self, type_: str, **fields: Any) -> str:
        """One SSE frame, `event: <type>` then the event as JSON, numbered."""
        payload = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\n" + sse.event(payload)

    # ------------------------------------------------------------------ items
    def _start(self, item: OutputItem) -> list[str]:
        frames = self.close()
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        if isinstance(item, FunctionCallItem):
            announced = item.model_copy(update={"status": "in_progress", "arguments": ""})
        else:
            announced = item.model_copy(update={"status": "in_progress", "content": []})
        frames.append(self.event("response.output_item.added", output_index=index,
                                 item=announced.model_dump()))
        if not isinstance(item, FunctionCallItem):
            part = item.content[0].model_dump(exclude_none=True)
            if isinstance(item, OutputMessage):
                part["logprobs"] = []
            frames.append(self.event("response.content_part.added", item_id=item.id,
                                     output_index=index, content_index=0, part=part))
        return frames

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}

    def close(self, status: str = "completed") -> list[str]:
        """Close the open item (if any) with `status`: its done events."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": len(self.items) - 1}  # the open one: the last
        frames = []
        if isinstance(item, ReasoningItem):
            frames.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=item.text))
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            frames.append(self.event("response.output_text.done", **where, content_index=0,
                                     text=part.text, logprobs=part.logprobs or []))
        else:
            frames.append(self.event("response.function_call_arguments.done", **where,
                                     name=item.name, arguments=item.arguments))
        if not isinstance(item, FunctionCallItem):
            frames.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=item.content[0].model_dump(exclude_none=True)))
        frames.append(self.event("response.output_item.done", output_index=where["output_index"],
                                 item=item.model_dump()))
        return frames

    # ------------------------------------------------------------------ deltas
    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        frames = [] if isinstance(self._open, ReasoningItem) else self._start(_reasoning(""))
        self._open.content[0].text += delta  # type: ignore[union-attr]
        frames.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                 delta=delta))
        return frames

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        if not delta:
            return []
        frames = [] if isinstance(self._open, OutputMessage) else self._start(
            _message("", [] if self.logprobs else None))
        part = self._open.content[0]  # type: ignore[union-attr]
        part.text += delta
        if part.logprobs is not None:
            part.logprobs += logprobs
        frames.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                 delta=delta, logprobs=logprobs))
        return frames

    def tool_calls(self, deltas: list[dict[str, Any]]) -> list[str]:
        """The tool-call stream's deltas (server/tool_parsers: the first of a call carries its
        id and name, later ones pieces of its arguments)."""
        frames: list[str] = []
        for d in deltas:
            fn = d["function"]
            if d["index"] not in self._calls:
                item = FunctionCallItem(id=item_id("fc"), call_id=d["id"], name=fn["name"],
                                        arguments="")
                self._calls[d["index"]] = item
                frames += self._start(item)
            item = self._calls[d["index"]]
            piece = fn.get("arguments") or ""
            if piece:
                assert item is self._open, "a call's arguments arrive while it is the open item"
                item.arguments += piece
                frames.append(self.event("response.function_call_arguments.delta", **self._where(),
                                         delta=piece))
        return frames

    def finish(self, complete: bool) -> list[str]:
        """Close the output: the open item ("incomplete" when the output was cut), and an empty
        message when there was no item at all."""
        frames = [] if self.items else self._start(_message("", [] if self.logprobs else None))
        return frames + self.close("completed" if complete else "incomplete")
