"""Where one request's draft session stands, as one small state machine.

    none      --opened-->         open      opened with the target's session, as the request starts
    none      --defer-->          deferred  a model draft whose use the cost model decides (defers_draft)
    deferred  --begin_opening-->  opening   the gamma policy first wants to draft: it opens in the background
    opening   --opened-->         open      the opening finished; the next round adopts it
    opening   --give_up-->        none      it failed to open: no draft for the rest of the request
    open      --lose-->           failed    a step failed or missed its deadline
    failed    --reopening-->      failed    one more try at a new session (reopens counts them)
    failed    --opened-->         open      reopened on a healthy draft worker

none: no draft for this request (none wanted, or it could not open): its rounds run target-only to the end.
deferred, opening: rounds run target-only while the draft waits to open, then while it opens (it hears of the tokens
committed meanwhile with its first step). open: the session drafts. failed: rounds run target-only, and each tries
to reopen a session while tries are left. The request speculates in every phase but none.
"""

import asyncio
import enum

from specdec.coordinator.workers import DraftSession


class DraftPhase(enum.Enum):
    NONE = "none"
    DEFERRED = "deferred"
    OPENING = "opening"
    OPEN = "open"
    FAILED = "failed"


class IllegalTransition(RuntimeError):
    pass


class DraftState:
    def __init__(self):
        self.phase = DraftPhase.NONE
        self.session: DraftSession | None = None  # set exactly while open
        self.opening: asyncio.Future | None = None  # the deferred opening, while it runs
        self.opened_on = 0  # committed tokens the deferred opening prefills
        self.reopens = 0  # sessions reopened after a failure

    def __repr__(self) -> str:
        return f"DraftState({self.phase.value}, reopens={self.reopens})"

    @property
    def speculating(self) -> bool:
        return self.phase is not DraftPhase.NONE

    @property
    def is_open(self) -> bool:
        return self.phase is DraftPhase.OPEN

    @property
    def waiting(self) -> bool:
        """Deferred or opening: not open yet, and to open in the background rather than be reopened."""
        return self.phase in (DraftPhase.DEFERRED, DraftPhase.OPENING)

    @property
    def failed(self) -> bool:
        return self.phase is DraftPhase.FAILED

    def move(self, to: DraftPhase, *allowed_from: DraftPhase) -> None:
        if self.phase not in allowed_from:
            raise IllegalTransition(f"draft: {self.phase.value} -> {to.value}")
        self.phase = to

    def defer(self) -> None:
        self.move(DraftPhase.DEFERRED, DraftPhase.NONE)

    def begin_opening(self, opening: asyncio.Future, committed: int) -> None:
        self.move(DraftPhase.OPENING, DraftPhase.DEFERRED)
        self.opening, self.opened_on = opening, committed

    def opened(self, session: DraftSession) -> None:
        """Opened with the target's (from none), after deferring (opening), or reopened (failed)."""
        self.move(DraftPhase.OPEN, DraftPhase.NONE, DraftPhase.OPENING, DraftPhase.FAILED)
        self.session, self.opening = session, None

    def give_up(self) -> None:
        """The deferred opening failed: no draft for the rest of the request (reopening would prefill again in the
        foreground, what deferring avoids)."""
        self.move(DraftPhase.NONE, DraftPhase.OPENING)
        self.opening = None

    def lose(self) -> DraftSession:
        """The open session failed; it is returned to be closed."""
        self.move(DraftPhase.FAILED, DraftPhase.OPEN)
        session, self.session = self.session, None
        return session

    def reopening(self) -> None:
        """One more try at reopening a failed session."""
        self.move(DraftPhase.FAILED, DraftPhase.FAILED)
        self.reopens += 1

    def take_opening(self) -> asyncio.Future | None:
        """The opening still running, handed over to be cancelled as the request ends."""
        opening, self.opening = self.opening, None
        return opening
