"""The decode connector's scheduler side: requests whose prompt KV comes from another engine.

A handed-off request enters as WAITING_FOR_REMOTE_KVS (the scheduler queues it
for blocks with the other requests). If its KV was pushed here, it adopts the
push's landed blocks when it is added; when it gets its blocks, the ones that
neither the prefix cache nor the push filled are what the worker side must
still fetch (a ``KVSlot``). A request whose blocks need nothing fetched (and
that takes no draft KV) joins the running batch at once, in the very step after
its blocks were allocated. Requests added as early starts (before their Decode
came) must be claimed; the rest of their lifetime is the scheduler's.
"""

from __future__ import annotations

import logging

from pdserve.engine.kv.connector.host import ConnectorParts
from pdserve.engine.kv.connector.pushes import PushTable
from pdserve.engine.sequence import Sequence
from pdserve.engine.types.handoff import KVHandoff, KVSlot
from pdserve.engine.types.outputs import RequestOutput
from pdserve.engine.types.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class ConnectorScheduler:
    """Which requests wait for remote KV, the blocks they get, and when they may run (engine thread only)."""

    def __init__(self, parts: ConnectorParts, pushes: PushTable) -> None:
        self._parts = parts
        self.pushes = pushes
        # Requests that join the batch as soon as their blocks hold all their KV (pushed or cached here),
        # without the trip through whoever fetches KV.
        self._land_when_present: set[str] = set()

    def add_remote_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handoff: KVHandoff,
        pushed: bool = False,
    ) -> int:
        """Queue a request prefilled elsewhere; returns how many of its blocks it adopted from a push.

        ``pushed``: the prefill worker pushed its KV here (under the handoff's request id) and saw it
        confirmed: the request adopts the landed push's blocks. Otherwise it pulls, and a push of it
        here (one confirmed too late, or whose request was sent elsewhere) is dropped, and refused if
        it opens later. Raises ``ValueError`` naming the field when ``handoff`` cannot be served here.
        """
        reservation = self.pushes.claim(handoff) if pushed else None
        if not pushed:
            self.pushes.drop(handoff.request_id, refuse_later=True)
        try:
            seq = self._parts.host.remote_sequence(request_id, prompt_token_ids, params, handoff)
        except BaseException:
            if reservation is not None:
                self.pushes.free(reservation)
            raise
        seq.kv_reservation = reservation
        if not self.accepts_draft_kv(handoff):
            self._land_when_present.add(seq.request_id)
        self._parts.host.admit_remote(seq)
        return 0 if reservation is None else len(reservation.block_ids)

    def accepts_draft_kv(self, handoff: KVHandoff) -> bool:
        """Whether ``handoff`` carries draft KV that this engine's draft model can use: then the request waits
        for it to be fetched too (else it is ignored, and the draft recomputes the prompt when the request
        first proposes)."""
        draft = self._parts.draft
        return (
            handoff.draft_layout is not None
            and draft is not None
            and draft.accepts(handoff.draft_layout, handoff.draft_model_id)
        )

    def take_slots(self) -> tuple[list[KVSlot], list[RequestOutput]]:
        """Since the last call: the requests whose blocks must still be filled (fetch their KV from
        ``first_block`` on), and the outputs of those that joined the batch because nothing was missing."""
        to_fill: list[KVSlot] = []
        joined: list[RequestOutput] = []
        for slot in self._parts.queue.drain_kv_slots():
            if slot.request_id in self._land_when_present:
                self._land_when_present.discard(slot.request_id)
                output = self.join_if_present(slot)
                if output is not None:
                    joined.append(output)
                    continue
            to_fill.append(slot)
        return to_fill, joined

    def join_if_present(self, slot: KVSlot) -> RequestOutput | None:
        """Join a remote request to the running batch now if its slot needs nothing copied in (every block
        was cached here or pushed into it); the state at landing. None when blocks must still be filled
        or the request no longer waits for its KV."""
        seq = self.receiving(slot.request_id)
        if seq is None or slot.first_block < len(seq.block_table):
            return None
        return self.join_running(seq)

    def join_running(self, seq: Sequence) -> RequestOutput:
        """Every block of ``seq`` holds its KV: it runs from the next step on; its state at landing."""
        self._parts.block_manager.cache_computed_blocks(seq)
        self._parts.queue.kv_received(seq)
        return self._parts.host.output_of(seq)

    def recompute(self, request_id: str) -> RequestOutput | None:
        """A remote request's KV will never land: compute its prompt and first token here instead.

        The path a preempted sequence takes; a seeded request resumes its random
        stream after the first token's draw. The state with the first token, or
        None when the request is no longer waiting for its KV.
        """
        seq = self.receiving(request_id)
        if seq is None:
            return None
        self._parts.queue.kv_lost(seq)
        return self._parts.host.output_of(seq)

    def receiving(self, request_id: str) -> Sequence | None:
        """The request ``request_id`` while it holds blocks and waits for its KV; None otherwise."""
        return self._parts.queue.receiving.get(request_id)

    def request_finished(self, request_id: str) -> None:
        """``request_id`` ended (an abort): nothing is kept for it."""
        self._land_when_present.discard(request_id)
