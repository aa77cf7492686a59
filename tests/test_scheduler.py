"""The scheduler without a model: budgets, orders and pages on a state built through the one admission."""

from __future__ import annotations

from engine_builder import ModelFreeEngine


def test_decodes_go_first_and_a_prompt_takes_the_rest_of_the_budget_as_a_chunk():
    engine = ModelFreeEngine(budget=16)
    engine.add(0, prompt_len=10)
    assert engine.takes(engine.step()) == [10, 0, 0, 0]  # the whole prompt: it fits the budget
    engine.add(1, prompt_len=40)
    assert engine.takes(engine.step()) == [1, 15, 0, 0]  # slot 0 decodes; slot 1 prefills a chunk
    assert engine.takes(engine.step()) == [1, 15, 0, 0]
    assert engine.takes(engine.step()) == [1, 10, 0, 0]  # the rest of the prompt
    assert engine.takes(engine.step()) == [1, 1, 0, 0]  # both decode


def test_fcfs_serves_arrival_order_and_priority_the_lower_value():
    for policy, expected in (("fcfs", [16, 0, 0, 0]), ("priority", [0, 16, 0, 0])):
        engine = ModelFreeEngine(budget=16, policy=policy)
        engine.add(0, prompt_len=20, priority=5)
        engine.add(1, prompt_len=20, priority=0)
        assert engine.takes(engine.step()) == expected, policy


def test_pages_go_to_the_first_arrival_and_the_next_waits_without_losing_anything():
    engine = ModelFreeEngine(budget=64, num_pages=5)  # 4 usable pages of 8 tokens
    engine.add(0, prompt_len=24)  # 3 pages
    engine.add(1, prompt_len=24)  # 3 more: only 1 is left
    planned = engine.step()
    assert engine.takes(planned)[:2] == [24, 0]
    assert engine.state.pages_held.tolist()[:2] == [3, 0] and int(engine.pool.num_free) == 1
    assert int(engine.state.num_preemptions) == 0  # slot 1 held nothing: it waits, it is not evicted
    assert planned.read_sizes().tokens == 24


def test_a_cancelled_request_gets_no_budget():
    engine = ModelFreeEngine(budget=16)
    engine.add(0, prompt_len=12)
    engine.add(1, prompt_len=12)
    engine.state.cancel[0] = True
    assert engine.takes(engine.step())[:2] == [0, 12]


def test_prompt_logprobs_prefill_no_more_than_the_window_holds_and_the_step_scores():
    engine = ModelFreeEngine(budget=32, prompt_rows=8)
    engine.add(0, prompt_len=20, prompt_logprobs=1)
    engine.add(1, prompt_len=12, prompt_logprobs=0)
    engine.add(2, prompt_len=12)  # asks for none: only the budget limits it
    engine.state.room[0] = 5  # the reader has read little: five entries fit its window
    planned = engine.step()
    # Slot 0 scores positions 0-4 (five entries, as its window holds); slot 1 the three prompt rows left, then stops
    # at the prompt rows' limit; slot 2 takes the rest of the budget.
    assert engine.takes(planned) == [5, 3, 12, 0]
    assert planned.prompt_entries.tolist() == [5, 3, 0, 0]
    assert planned.read_sizes().prompt_entries == 8
    assert engine.state.scored.tolist()[:2] == [5, 3]
    engine.state.room[0] = 64
    planned = engine.step()
    # Slot 0 scores positions 5-12 (eight rows, all of them); slot 1 waits for the next step's rows.
    assert engine.takes(planned)[:2] == [8, 0] and planned.prompt_entries.tolist()[:2] == [8, 0]
    planned = engine.step()
    # Slot 0's last prompt token scores nothing (its logits give the first generated token): 6 rows; slot 1 scores
    # positions 3-4 of its own in the 2 rows left.
    assert engine.takes(planned)[:2] == [7, 2] and planned.prompt_entries.tolist()[:2] == [6, 2]
    assert engine.state.scored.tolist()[:2] == [19, 5]
