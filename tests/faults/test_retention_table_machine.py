"""The connector's retention table (kvferry.connector.retention) as a hypothesis state machine against a
model of the registry: random retains, reports accepted / refused / lost (landed or not), registry ends
delivered late, the sidecar's word that a request is not held (whether its report landed or not), SYNC
snapshots from older revisions, EndRetention calls, lost registry, time passing.

Invariants, after every step:
- rule 1: no entry is freed as confirmed while the registry (the model) still serves it;
- the table's block count is the sum of what it still holds;
- (at teardown) with the registry gone, everything is freed by the hard cap: nothing leaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvferry.connector.retention import EndReason, RetentionTable

HARD_CAP = 100.0
GRACE = 5.0
CONVERSATIONS = ("c0", "c1", "c2")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + 5_000_000.0


@dataclass
class Record:
    request_id: str
    conversation: str
    turn: int
    revision: int


@dataclass
class RegistryModel:
    """What the registry serves, by conversation, with revisions and the ends not yet delivered."""

    revision: int = 1
    served: dict[str, Record] = field(default_factory=dict)  # conversation -> record
    ended_requests: set[str] = field(default_factory=set)
    # (request id, revision) of ends the engine has not heard of yet, oldest first.
    pending_ends: list[tuple[str, int]] = field(default_factory=list)
    # revision -> request ids served at it (SYNC snapshots from any of them may arrive late).
    history: dict[int, frozenset[str]] = field(default_factory=dict)

    def serves(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self.served.values())

    def _bump(self) -> int:
        self.revision += 1
        self.history[self.revision] = frozenset(r.request_id for r in self.served.values())
        return self.revision

    def publish(self, request_id: str, conversation: str, turn: int) -> int | None:
        """The accepted revision, or None when refused (an as-new or newer turn, or an ended request)."""
        current = self.served.get(conversation)
        if request_id in self.ended_requests or (current is not None and current.turn >= turn):
            return None
        self.served[conversation] = Record(request_id, conversation, turn, self.revision + 1)
        revision = self._bump()
        if current is not None:
            self.pending_ends.append((current.request_id, revision))
        return revision

    def end(self, request_id: str) -> tuple[bool, int]:
        """EndEngineRetention: ends the record if it names this request; marks the request ended."""
        self.ended_requests.add(request_id)
        for conversation, record in list(self.served.items()):
            if record.request_id == request_id:
                del self.served[conversation]
                return True, self._bump()
        return False, self.revision

    def expire(self, conversation: str) -> None:
        record = self.served.pop(conversation, None)
        if record is not None:
            self.pending_ends.append((record.request_id, self._bump()))


class RetentionTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.table = RetentionTable(
            max_retention_seconds=HARD_CAP, grace_seconds=GRACE, budget_blocks=12, clock=self.clock
        )
        self.registry = RegistryModel()
        self.registry.history[1] = frozenset()
        self.next_request = 0
        self.next_block = 0
        self.blocks: dict[str, int] = {}
        self.reachable = True

    # -- the engine ------------------------------------------------------------------------------------

    @rule(conversation=st.sampled_from(CONVERSATIONS), turn=st.integers(1, 4), blocks=st.integers(1, 4))
    def retain(self, conversation: str, turn: int, blocks: int) -> None:
        request_id = f"r{self.next_request}"
        self.next_request += 1
        self.table.add(
            request_id=request_id,
            tenant="t",
            conversation_id=conversation,
            turn=turn,
            block_ids=range(self.next_block, self.next_block + blocks),
            num_tokens=blocks * 16,
        )
        self.next_block += blocks
        self.blocks[request_id] = blocks
        self.table.evict_over_budget()

    @rule(seconds=st.sampled_from([0.5, 3.0, 6.0, 40.0, 120.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule()
    def engine_step(self) -> None:
        """What the engine core does each step: begin hard caps, free what is due."""
        self.table.begin_hard_caps()
        for entry in self.table.collect_due():
            if entry.confirmed:
                assert not self.registry.serves(entry.request_id), (
                    f"{entry.request_id} freed as confirmed ({entry.end_reason}) while the registry serves it"
                )
            self.blocks.pop(entry.request_id, None)

    # -- the sidecar link's calls ----------------------------------------------------------------------

    @precondition(lambda self: self.reachable)
    @rule(outcome=st.sampled_from(["answered", "answered", "answered", "lost-landed", "lost"]))
    def call(self, outcome: str) -> None:
        taken = self.table.take_call()
        if taken is None:
            return
        kind, entry = taken
        if kind == "report":
            revision = None
            if outcome != "lost":
                revision = self.registry.publish(entry.request_id, entry.conversation_id, entry.turn)
            if outcome == "answered":
                if revision is None:
                    self.table.refused(entry.request_id)
                else:
                    self.table.acknowledged(
                        entry.request_id, None, revision, tenant="t", conversation_id=entry.conversation_id
                    )
            else:
                self.table.report_failed(entry.request_id)
        else:
            if outcome == "lost":
                self.table.end_call_refused(entry.request_id)
                return
            _ended, revision = self.registry.end(entry.request_id)
            self.table.end_confirmed(entry.request_id, revision)

    # -- the registry's word ---------------------------------------------------------------------------

    @rule(conversation=st.sampled_from(CONVERSATIONS))
    def registry_ends_one(self, conversation: str) -> None:
        """Lease expiry or a client's release."""
        self.registry.expire(conversation)

    @precondition(lambda self: self.reachable and bool(self.registry.pending_ends))
    @rule()
    def deliver_end(self) -> None:
        request_id, revision = self.registry.pending_ends.pop(0)
        self.table.end(request_id, EndReason.EXPIRED, revision)

    @precondition(lambda self: self.reachable)
    @rule(data=st.data())
    def sidecar_finds_not_held(self, data: st.DataObject) -> None:
        """The sidecar's sweep or re-sync: a request the registry does not hold now is announced ENDED
        at the current revision, whether or not a report of it ever landed (one that got no answer,
        e.g. etcd out of space, is checked this way)."""
        candidates = sorted(r for r in self.table.request_ids() if not self.registry.serves(r))
        if candidates:
            request_id = data.draw(st.sampled_from(candidates))
            self.table.end(request_id, EndReason.SUPERSEDED, self.registry.revision)

    @precondition(lambda self: self.reachable)
    @rule(data=st.data())
    def deliver_sync(self, data: st.DataObject) -> None:
        """A SYNC snapshot, possibly from an older revision than what was acknowledged since."""
        revision = data.draw(st.sampled_from(sorted(self.registry.history)))
        self.table.sync(self.registry.history[revision], revision)

    @rule()
    def registry_unreachable(self) -> None:
        self.reachable = False

    @rule()
    def registry_back(self) -> None:
        self.reachable = True

    # -- invariants ------------------------------------------------------------------------------------

    @invariant()
    def held_blocks_add_up(self) -> None:
        assert self.table.held_blocks() == sum(self.blocks[r] for r in self.table.request_ids())

    def teardown(self) -> None:
        """Registry gone for good: the hard cap frees everything, unconfirmed."""
        for _ in range(6):
            self.clock.now += HARD_CAP + GRACE + 1
            self.table.begin_hard_caps()
            for entry in self.table.collect_due():
                self.blocks.pop(entry.request_id, None)
        assert len(self.table) == 0, self.table.request_ids()
        assert self.table.held_blocks() == 0


TestRetentionTable = RetentionTableMachine.TestCase
TestRetentionTable.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
