"""The scheduler without a model: budgets, orders and pages on a state built through the one admission."""

from __future__ import annotations

from tests.support.engine_builder import ModelFreeEngine


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


def test_packed_sort_keys_give_the_orders_the_keys_one_by_one_give():
    """lexsort packs neighbouring keys of known width (the class, the priority, a flag, the tokens generated) into
    one integer: each policy's three orders must be those of its keys sorted one at a time, ties and the extremes of
    every range included."""
    from types import SimpleNamespace

    import torch

    from blink.engine.core.policy import POLICIES, ahead, lexsort, policy_named

    def one_by_one(keys, first):
        order = torch.arange(first.shape[0])
        for key in reversed([(~first).long(), *keys]):
            order = order[key[order].argsort(stable=True)]
        return order

    gen = torch.Generator().manual_seed(0)
    n = 96

    def draw(values):
        return torch.tensor(values)[torch.randint(len(values), (n,), generator=gen)]

    for _ in range(30):
        s = SimpleNamespace(service_class=draw([0, 1]), priority=draw([-(2**15), -1, 0, 1, 7, 2**15 - 1]),
                            ttft_deadline=draw([0.5, 1.0, 1.0, 2.5, float("inf")]).double(),
                            arrival=draw(list(range(20))), prompt_len=draw([1, 5, 9]))
        s.seq_len = s.prompt_len + draw([0, 1, 3, 2**31 - 10])
        first, prefill = draw([True, False]), draw([True, False])
        generated = s.seq_len - s.prompt_len
        specs = {
            "fcfs": ([s.arrival], [prefill.long(), s.arrival], [-s.arrival]),
            "priority": ([s.priority, s.arrival], [prefill.long(), s.priority, s.arrival], [-s.priority, -s.arrival]),
            "slo": ([s.service_class, s.priority, s.ttft_deadline, s.arrival],
                    [s.service_class, prefill.long(), s.priority, s.ttft_deadline, s.arrival],
                    [-s.service_class, -s.priority, -generated, -s.arrival]),
        }
        for name in POLICIES:
            policy = policy_named(name)
            packed = (policy.keep_keys(s), policy.budget_keys(s, prefill), policy.victim_keys(s))
            for keys, plain in zip(packed, specs[name], strict=True):
                assert torch.equal(lexsort(keys, first), one_by_one(plain, first)), name
                # The plan sorts the keep order once and moves the resident slots ahead of it.
                assert torch.equal(ahead(lexsort(keys, torch.zeros_like(first)), first), one_by_one(plain, first))


def test_a_cancelled_request_gives_its_pages_before_anyone_is_preempted():
    """Cancelled just as another request needs a page: the cancelled one's pages go first (it ends in this step's
    commit), so no running request is preempted for them, and the cancelled one counts no preemption."""
    engine = ModelFreeEngine(num_slots=3, max_len=64, page_size=8, num_pages=9, budget=32)  # 8 usable pages
    engine.add(0, prompt_len=24)
    engine.add(1, prompt_len=15)
    engine.add(2, prompt_len=16)
    s = engine.state
    for _ in range(3):
        engine.step()
    while int(s.num_computed[1]) % 8:  # slot 1 is about to need a new page, and the pool has none free
        engine.step()
    assert int(engine.pool.num_free) == 0 and s.pages_held.tolist() == [4, 2, 2]
    s.cancel[0] = True
    assert engine.takes(engine.step()) == [0, 1, 1]
    assert s.preemptions.tolist() == [0, 0, 0] and s.pages_held[0] == 0


def test_readers_that_stop_reading_do_not_hold_new_requests_back():
    """Best-effort requests whose readers stopped reading are paused, and under pressure rotated out until the host
    mirror is nearly full. New best-effort requests wait while a rotated request waits to come back; rotated
    requests that wait only for their readers must not keep them from starting."""
    import torch

    from blink.engine.core.state import SlotStatus
    from blink.shared.service_class import ServiceClass

    engine = ModelFreeEngine(num_slots=4, max_len=64, page_size=8, num_pages=7, budget=32, policy="slo",
                             mirror_pages=5)  # 6 usable pages; a mirror of 4
    s, best_effort = engine.state, dict(service_class=ServiceClass.BEST_EFFORT)
    engine.add(0, prompt_len=16, **best_effort)
    engine.add(1, prompt_len=16, **best_effort)
    engine.step()
    s.paused[:2] = True  # their readers stopped reading
    engine.add(2, prompt_len=40, service_class=ServiceClass.LATENCY_SENSITIVE)
    for _ in range(3):
        engine.step()
    assert s.rotated.tolist() == [True, True, False, False] and bool(engine.mirror.nearly_full())
    finished = torch.tensor([False, False, True, False])  # the latency-sensitive request ends (as the commit would)
    engine.pool.release(finished, s.block_table, s.pages_held)
    s.status[2] = SlotStatus.FREE
    engine.add(3, prompt_len=8, **best_effort)
    assert engine.takes(engine.step()) == [0, 0, 0, 8]
