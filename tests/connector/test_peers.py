"""WarmSteps: the idle steps a prefill engine takes to warm its reads from a newly named peer."""

from __future__ import annotations

from kvferry.connector.peers import WarmSteps


def test_a_new_peer_gets_its_steps_and_a_known_one_none() -> None:
    steps = WarmSteps((0.25, 1.0))
    assert steps.next_due() is None
    assert steps.named("decode-0", now=100.0)
    assert not steps.named("decode-0", now=100.5)
    assert steps.next_due() == 100.25
    assert not steps.due(100.2)
    assert steps.due(100.3)
    # Asking again gives the same answer (the engine core asks in has_work, then again in step) until a
    # step is built.
    assert steps.due(100.3)
    steps.stepped(100.3)
    assert not steps.due(100.3)
    assert steps.next_due() == 101.0


def test_times_that_passed_together_take_one_step() -> None:
    steps = WarmSteps((0.25, 0.5, 1.0))
    steps.named("decode-0", now=0.0)
    steps.named("decode-1", now=0.1)
    assert steps.due(0.8)
    steps.stepped(0.8)
    assert steps.next_due() == 1.0
    assert steps.due(5.0)
    steps.stepped(5.0)
    assert not steps.due(6.0) and steps.next_due() is None


def test_a_step_built_before_a_time_passes_leaves_it() -> None:
    steps = WarmSteps((0.25,))
    steps.named("decode-0", now=0.0)
    steps.stepped(0.1)  # a request's step, before the warm step is due
    assert not steps.due(0.2)
    assert steps.due(0.3)
