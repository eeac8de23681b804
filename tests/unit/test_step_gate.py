"""The step gate: one device step at a time, handed over in turns, the order decided when a step ends among
the schedulers then waiting (each test holds a step open with an event and waits until the others are
queued before letting it end)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from edge_agent.serving.llm.step_gate import StepGate


class Steps:
    """Schedulers, one thread each, stepping through one gate; ``order`` is who entered a step, in order."""

    def __init__(self) -> None:
        self.gate = StepGate()
        self.order: list[str] = []
        self.inside = 0
        self.most_inside = 0
        self._lock = threading.Lock()

    def scheduler(
        self, who: str, steps: int, hold: threading.Event | None = None, until_queued: Callable[[], bool] = bool
    ) -> threading.Thread:
        """``who`` runs ``steps`` steps back to back; the first stays open until ``hold`` is set, and each until
        another scheduler waits at the gate while ``until_queued()`` says one will."""

        def run() -> None:
            for i in range(steps):
                with self.gate.step(who):
                    with self._lock:
                        self.order.append(who)
                        self.inside += 1
                        self.most_inside = max(self.most_inside, self.inside)
                    if i == 0 and hold is not None:
                        assert hold.wait(10)
                    if until_queued():
                        assert self.gate.queued(1, 10)
                    with self._lock:
                        self.inside -= 1

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


def test_a_scheduler_alone_steps_at_once_every_time():
    steps = Steps()
    steps.scheduler("alone", 3).join(10)
    assert steps.order == ["alone"] * 3 and steps.gate.waits == 0


def test_two_schedulers_take_turns_until_one_has_no_more_steps():
    steps = Steps()
    hold = threading.Event()
    left = {"old": 3, "new": 4}

    def other_has_steps(me: str) -> Callable[[], bool]:
        def check() -> bool:
            left[me] -= 1  # this step's
            return left["new" if me == "old" else "old"] > 0

        return check

    # each step ends only once the other scheduler, when it has steps left, waits at the gate
    old = steps.scheduler("old", 3, hold, other_has_steps("old"))  # the draining tier, in a step
    new = steps.scheduler("new", 4, until_queued=other_has_steps("new"))
    assert steps.gate.queued(1, 10)
    hold.set()
    old.join(10)
    new.join(10)
    assert steps.order == ["old", "new", "old", "new", "old", "new", "new"]


def test_the_longest_waiting_steps_next():
    steps = Steps()
    hold = threading.Event()
    first = steps.scheduler("a", 1, hold)
    b = steps.scheduler("b", 1)
    assert steps.gate.queued(1, 10)
    c = steps.scheduler("c", 1)
    assert steps.gate.queued(2, 10)
    hold.set()
    for t in (first, b, c):
        t.join(10)
    assert steps.order == ["a", "b", "c"]


def test_no_two_steps_ever_run_at_once():
    steps = Steps()
    threads = [steps.scheduler(name, 50) for name in ("a", "b", "c")]
    for t in threads:
        t.join(30)
    assert len(steps.order) == 150 and steps.most_inside == 1
