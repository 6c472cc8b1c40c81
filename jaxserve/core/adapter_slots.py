"""Which LoRA adapter holds which device slot: the scheduler's one adapter-slot resource.

The device has `max_loras` slots (1..max_loras; 0 is the base model). A request runs only while
its adapter holds a slot: the scheduler asks `can_admit` before admitting it, `admit` gives it
its slot, and `release` drops its hold when it stops running (finished, aborted, preempted). A
slot whose adapter no running request uses is free to be taken, least recently used first; a
newly assigned slot is queued in `loads` for the runner to write before the step that first
reads it. At most max_loras distinct adapters therefore run in one step, and a slot is never
rewritten while a running request reads it.

With LoRA off the resource has no slots (`AdapterSlots(0)`): requests of the base model pass
through it unchanged and one that names an adapter is refused, so the scheduler never asks
whether LoRA is on. The runner's side (the adapters' weights in those slots, each token's slot)
is runner/lora_weights.py and runner/step_packing.py's `adapter_slots`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from jaxserve.lora_request import LoRARequest
from jaxserve.request import Request


class AdapterSlots:
    def __init__(self, max_loras: int = 0) -> None:
        self.max_loras = max_loras
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first
        self.users: dict[int, int] = {}  # adapter id -> running requests using it
        self.loads: list[tuple[int, LoRARequest]] = []  # slots to write before the next step
        self._holders: dict[str, int] = {}  # request id -> adapter id
        self._names: dict[int, str] = {}
        self._free = list(range(max_loras, 0, -1))  # slots no adapter holds, lowest last

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    # ------------------------------------------------------------------ the scheduler's calls
    def check(self, request: Request) -> None:
        """Refuse a request naming an adapter when there are no slots (LoRA is off)."""
        if request.lora_request is not None and not self.enabled:
            raise ValueError("A LoRA adapter was requested but LoRA is not enabled (enable_lora).")

    def can_admit(self, request: Request) -> bool:
        """Whether `request` can run now: the base model always; an adapter while it holds a
        slot or one can be given to it."""
        lora = request.lora_request
        return lora is None or self.can_acquire(lora)

    def admit(self, request: Request) -> None:
        """Give an admitted request its adapter's slot (`request.lora_slot`; 0: the base model)."""
        if request.lora_request is not None:
            request.lora_slot = self.acquire(request.request_id, request.lora_request)

    def discard_loads(self, loads: Iterable[tuple[int, LoRARequest]]) -> None:
        """The slots a discarded step was to load hold nothing trustworthy: free them."""
        for _, lora in loads:
            self.forget(lora.lora_int_id)

    def waiting_names(self, waiting: Iterable[Request]) -> tuple[str, ...]:
        """The adapters of the waiting requests (for lora_requests_info)."""
        if not self.enabled:
            return ()
        return tuple(sorted({r.lora_request.lora_name for r in waiting if r.lora_request is not None}))

    # ------------------------------------------------------------------ slots
    def can_acquire(self, lora: LoRARequest) -> bool:
        aid = lora.lora_int_id
        return (aid in self.slot_of or bool(self._free)
                or any(self.users.get(a, 0) == 0 for a in self.slot_of))

    def acquire(self, request_id: str, lora: LoRARequest) -> int:
        """The slot of `lora` for request `request_id` (assigned now if need be; the caller has
        checked `can_acquire`)."""
        aid = lora.lora_int_id
        slot = self.slot_of.get(aid)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(a for a in self.slot_of if self.users.get(a, 0) == 0)
                slot = self.slot_of.pop(victim)
                self.users.pop(victim, None)
            self.slot_of[aid] = slot
            self.loads.append((slot, lora))
        self.slot_of.move_to_end(aid)
        self.users[aid] = self.users.get(aid, 0) + 1
        self._holders[request_id] = aid
        self._names[aid] = lora.lora_name
        return slot

    def release(self, request_id: str) -> None:
        aid = self._holders.pop(request_id, None)
        if aid is not None:
            self.users[aid] -= 1

    def forget(self, lora_int_id: int) -> bool:
        """Free an adapter's slot (its contents are not to be trusted: its load failed) unless a
        running request uses it."""
        if self.users.get(lora_int_id, 0):
            return False
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free.append(slot)
        self.users.pop(lora_int_id, None)
        return True

    def take_loads(self) -> tuple[tuple[int, LoRARequest], ...]:
        if not self.loads:
            return ()
        loads, self.loads = tuple(self.loads), []
        return loads

    def running_names(self) -> list[str]:
        """The names of the adapters running requests use (for lora_requests_info)."""
        return sorted({self._names[a] for a in self._holders.values()})
