"""Pages for a step's tokens, as fixed-shape tensor work (the plan's second half, after the budget is handed out):
the new pages each slot's tokens reach into; when the free pages run short, room made by victims in the policy's
order (their pages rotated out to the host mirror while it has room, else dropped for recompute); rotated requests
brought back when pages free. Like the rest of the plan, no host read on a device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blink.engine.core.kv_cache import PagePool
from blink.engine.core.page_sharing import frees_a_page, held_pages, pages_by_position, positions
from blink.engine.core.policy import Policy, ahead, lexsort
from blink.engine.core.rotation import HostMirror, PageMoves
from blink.engine.core.state import Slots, none_set, pack


def find_pages(state: Slots, pool: PagePool, policy: Policy, mirror: HostMirror | None, token_budget: int,
               take: torch.Tensor, running: torch.Tensor, resident: torch.Tensor, precedence: torch.Tensor,
               kernel: Callable | None = None):
    """Pages for the tokens taken: victims give theirs back when they run short, rotated out while the mirror has
    room; rotated requests come back when pages free. Returns (take, the page moves or None, [out, in] counts).
    kernel: a stand-in with `make_room`'s arguments and results (the device step's), or None for it; the mirror's
    rotation out and back stays tensor ops either way (it runs only with a mirror)."""
    need, take, evicted, reserve, keep, victims = (kernel or make_room)(state, pool, policy, take, resident,
                                                                        precedence, mirror is not None)
    moves_out = _give_back(state, pool, mirror, evicted, victims)
    if not none_set(need):  # need >= 0: set where nonzero (and no comparison launched on a GPU)
        pool.allocate(need, state.block_table, state.pages_held, max_new=max_new_pages(token_budget, pool.page_size))
    if not mirror:
        return take, None, torch.zeros(2, dtype=torch.int64, device=state.status.device)
    moves_in = _come_back(state, pool, mirror, running, evicted, keep, reserve, token_budget)
    moved = torch.stack([moves_out[2], moves_in[2]])
    mirror.pages_moved += moved
    return take, PageMoves(moves_out[0], moves_out[1], moves_in[0], moves_in[1]), moved


def make_room(state: Slots, pool: PagePool, policy: Policy, take: torch.Tensor, resident: torch.Tensor,
              precedence: torch.Tensor, mirror: bool):
    """The pages each slot's tokens need and, when the free pages run short, who gives theirs back (`_make_room`).
    Returns (new pages, tokens, evicted, the pages reserved for the next step, the keep order, the victims' order
    or None when nobody gives any back); without a mirror the evicted are counted too (`_count_evictions`), their
    pages still theirs to give back. The reference of the device step's kernel (blink.engine.kernels.make_room)."""
    need, crossing = _pages_needed(state, take, pool.page_size, mirror)
    # A cancelled request ends in this step's commit: its pages are the first to give, not kept at its precedence
    # while another is preempted.
    keep = ahead(precedence, resident & ~state.cancel)
    if none_set(need.sum() + crossing.sum() > pool.num_free):  # the free pages cover all: nobody gives any back
        return need, take, torch.zeros_like(resident), crossing.sum(), keep, None
    victims = lexsort(policy.victim_keys(state), first=resident & state.cancel)
    need, take, evicted, reserve = _make_room(state, pool, need, take, keep, victims, crossing)
    if not mirror and not none_set(evicted):  # with a mirror, what is rotated out is not recomputed
        _count_evictions(state, evicted, recompute=evicted)
    return need, take, evicted, reserve, keep, victims


def _pages_needed(state: Slots, take: torch.Tensor, page: int, mirror: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The new pages each slot's tokens reach into, and (with a mirror, 1 or 0) whether it starts a page next step."""
    covered = (state.num_computed + take + page - 1) // page
    need = torch.where(take > 0, covered - state.pages_held, 0).clamp(min=0)
    # With a mirror, room is also kept for the page each sequence running on will start in the next step.
    crossing = ((take > 0) & ((state.num_computed + take) % page == 0)).long() if mirror else torch.zeros_like(take)
    return need, crossing


def _give_back(state: Slots, pool: PagePool, mirror: HostMirror | None, evicted: torch.Tensor,
               victims: torch.Tensor | None):
    """The evicted slots' pages: to the mirror while it has room, else dropped for recompute (counted here with a
    mirror; without one, `make_room` counted them). Returns the moves out."""
    if victims is None or none_set(evicted):  # no victims' order: nobody gives any back
        return _no_pairs(state) if mirror else None
    moves_out = None
    if mirror:
        rotate_out = _rotate_out(state, mirror, evicted, victims)
        moves_out = _move_out(state, mirror, rotate_out)
        _count_evictions(state, evicted, recompute=evicted & ~rotate_out)
    pool.release(evicted, state.block_table, state.pages_held)
    return moves_out


def _count_evictions(state: Slots, evicted: torch.Tensor, recompute: torch.Tensor) -> None:
    """The evicted slots are preempted; those not rotated out compute from the start again."""
    state.num_computed.masked_fill_(recompute, 0)
    preempted = evicted & ~state.cancel  # a cancelled one gave its pages back: it was not preempted
    state.preemptions += preempted.long()
    state.num_preemptions += preempted.sum()
    state.num_recomputes += (recompute & ~state.cancel).sum()


def max_new_pages(token_budget: int, page: int) -> int:
    """The most pages one slot's tokens in a step reach into (a run of the whole budget across page bounds)."""
    return token_budget // page + 2


def _make_room(state: Slots, pool: PagePool, need: torch.Tensor, take: torch.Tensor, keep: torch.Tensor,
               victims: torch.Tensor, crossing: torch.Tensor):
    """Keeps the longest prefix of slots, in `keep` order, whose new pages (and a page for each slot ahead that
    will cross into a new page next step) fit once every slot after it gives its pages back; then takes pages,
    in `victims` order, from as few slots past that prefix as the prefix needs. Returns the new pages, the
    tokens, the evicted slots and the pages reserved for the next step.

    A page frees when every slot mapping it gives it back (prefix caching shares pages), so what giving back frees
    is counted per page, by the first slot (in keep order) or the last victim that maps it; a slot whose every page
    a kept slot maps too (a request that has just mapped a shared prefix) would free nothing and is not a victim."""
    S = state.num_slots
    held = held_pages(state, pool)  # with prefix caching, who maps which page
    need_o, cross_o = need[keep], crossing[keep]
    first_o = pages_by_position(state, pool, held, positions(keep), "amin").cumsum(0)  # pages kept by slots <= k
    freed_after = first_o[-1] - first_o
    fits_o = need_o.cumsum(0) + cross_o.cumsum(0) - cross_o <= pool.num_free + freed_after
    fits = torch.empty_like(fits_o).scatter_(0, keep, fits_o)
    reserve = (crossing * fits).sum()
    deficit = (need * fits).sum() + reserve - pool.num_free
    candidate = ~fits & frees_a_page(state, pool, held, fits)
    at = torch.where(candidate, positions(victims), S)  # a page a kept slot maps never frees
    last_v = pages_by_position(state, pool, held, at, "amax")
    evict_v = candidate[victims] & (last_v.cumsum(0) - last_v < deficit)  # short before this victim gives back
    evicted = torch.empty_like(evict_v).scatter_(0, victims, evict_v)
    # A slot past the prefix still runs if it needs no new page and keeps its own.
    runs = fits | ((need == 0) & ~evicted)
    return torch.where(fits, need, 0), torch.where(runs, take, 0), evicted, reserve


def _comeback_pages(state: Slots, page: int, token_budget: int) -> torch.Tensor:
    """What a rotated request needs to come back: its pages, and those its next step adds."""
    next_tokens = (state.seq_len - state.num_computed).clamp(max=token_budget)
    return torch.maximum((state.num_computed + next_tokens + page - 1) // page, state.host_held)


def _rotate_out(state: Slots, mirror: HostMirror, evicted: torch.Tensor, victims: torch.Tensor) -> torch.Tensor:
    """The victims whose pages the mirror can take, in victim order; the others are recomputed later."""
    pages = torch.where(evicted & (state.num_computed > 0) & ~state.cancel, state.pages_held, 0)[victims]
    fits_v = (pages > 0) & (pages.cumsum(0) <= mirror.free.num_free)
    return torch.empty_like(fits_v).scatter_(0, victims, fits_v)


def _move_out(state: Slots, mirror: HostMirror, out: torch.Tensor):
    pages = torch.where(out, state.pages_held, 0)
    mirror.free.allocate(pages, state.host_table, state.host_held, max_new=state.block_table.shape[1] - 1)
    state.pages_out += pages
    state.rotated |= out
    return _pairs(out, state.block_table, state.host_table, pages)


def _come_back(state: Slots, pool: PagePool, mirror: HostMirror, running: torch.Tensor, evicted: torch.Tensor,
               keep: torch.Tensor, reserve: torch.Tensor | int, token_budget: int):
    """The page moves of rotated requests coming back; none in a step that evicts."""
    if none_set(state.rotated):
        return _no_pairs(state)
    candidates = running & state.rotated & ~state.cancel & ~state.paused & ~evicted.any()
    if none_set(candidates):
        return _no_pairs(state)
    return _move_in(state, pool, mirror, candidates, keep, reserve, token_budget)


def _move_in(state: Slots, pool: PagePool, mirror: HostMirror, candidates: torch.Tensor, keep: torch.Tensor,
             reserve: torch.Tensor | int, token_budget: int):
    """Brings rotated requests back, in keep order, while the pool's free pages cover them, the pages their next
    step needs (so that they do not come back only to be rotated out again) and the reserve. They run from the
    next step on: their pages land after this step's forward."""
    needs_o = torch.where(candidates, _comeback_pages(state, pool.page_size, token_budget), 0)[keep]
    back_o = (needs_o > 0) & (needs_o.cumsum(0) + reserve <= pool.num_free)
    back = torch.empty_like(back_o).scatter_(0, keep, back_o)
    pages = torch.where(back, state.host_held, 0)
    pool.allocate(pages, state.block_table, state.pages_held, max_new=state.block_table.shape[1] - 1)
    moves = _pairs(back, state.host_table, state.block_table, pages)
    mirror.free.release(back, state.host_table, state.host_held)
    state.pages_in += pages
    state.rotated &= ~back
    return moves


def _no_pairs(state: Slots):
    """What `_pairs` gives when no slot moves."""
    src, dst = torch.zeros(2, state.num_slots * (state.block_table.shape[1] - 1), dtype=torch.int64,
                           device=state.block_table.device)
    return src, dst, src.new_zeros(())


def _pairs(which: torch.Tensor, src_table: torch.Tensor, dst_table: torch.Tensor, count: torch.Tensor):
    """(source page, destination page) for the first count[s] columns of every slot in `which`, packed first."""
    j = torch.arange(src_table.shape[1] - 1, device=which.device)
    index, n = pack((which[:, None] & (j[None, :] < count[:, None])).flatten())
    return src_table[:, :-1].flatten()[index], dst_table[:, :-1].flatten()[index], n
