"""Prefix caching: KV pages addressed by their content, shared between requests, decided inside the step.

Every page of the pool has a reference count (the block tables that map it) and, once a full page of a prompt is
computed, the hash of the prompt up to its end (blink.shared.prefix_hash; the ingress wrote one per full page into
the request's record). A page whose last reference goes keeps its hash: it is free, and still cached until the
allocator needs it. Allocation takes free pages that hold nothing first, then the least recently released (a
request's last pages before its first, as vLLM's block pool does, so a shared prefix outlives its tails), and
forgets the hash of a page it hands out.

A request about to start maps the longest run of cached pages matching its prompt's hashes into its block table
(taking references) and computes from there; it always computes its prompt's last token itself, whose logits it
samples from. A request that asks for its prompt's logprobs computes everything (vLLM skips the cache for those
too).

No sort and no pass over the pool a step (a captured step pays every kernel it holds, every step):

- free pages that hold nothing are a stack (`stack`, `empties`);
- free pages that hold a hash are a ring in the order they were released (`ring`, `head`, `tail`): its head is the
  least recently released. A hit takes a page out of the middle by its reference count alone: an entry is live
  while its page is free and `pos[page]` still names it, and allocation skips the others; it compacts the ring when
  half of it is dead entries. A release that finds the ring full (never, while allocation runs every step) lets
  its page forget its hash, onto the stack;
- hash -> page is an open-addressing table (`slots`, 4 cells a page or more, linear probing over PROBES cells)
  that holds page ids only: a cell matches hash h when its page holds h now (`hash[page] == h`), so a page evicted
  or refilled needs no deletion; a cell is free when its page holds nothing or a hash whose window misses the cell.
  A registration that finds no free cell in its window is dropped (a miss later, never a wrong page); inserts
  claim cells in rounds, the lowest item winning a contested cell.

The methods here are the torch reference: fixed-shape tensor work with no host read (so torch.compile takes them),
and the semantics blink.engine.kernels.prefix_cache's Triton kernels (one launch each, which the device step sets
as `kernels`) are held to, state for state, in Triton's interpreter, where programs run in order.
"""

from __future__ import annotations

import torch

from blink.engine.core.kv_cache import NULL_PAGE
from blink.engine.core.state import none_set

PROBES = 8  # cells of the hash table a hash may lie in, from its home cell
NO_CLAIM = torch.iinfo(torch.int64).max  # a table cell no insert has claimed (the kernels' `claims`)


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class PrefixCache:
    """The page pool's allocator when prefix caching is on; the interface of blink.engine.core.kv_cache.FreeList
    (allocate, release, num_free), plus `reuse` at admission and `register` after a step."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.refs = zeros(num_pages)  # block-table entries that map each page
        self.refs[NULL_PAGE] = 1  # never free; masked-off writes land on it
        self.hash = zeros(num_pages)  # the prefix hash a page holds; 0: nothing reusable
        self.num_free = torch.tensor(num_pages - 1, dtype=torch.int64, device=device)
        # Free pages holding nothing, [0, empties) (one cell more than ever holds one: it takes masked-off writes).
        self.stack = zeros(num_pages)
        self.stack[: num_pages - 1] = torch.arange(num_pages - 1, 0, -1, device=device)
        self.empties = torch.tensor(num_pages - 1, dtype=torch.int64, device=device)
        # Free pages holding a hash, by release: counters [head, tail), cell counter % R; the last cell is a trash cell.
        self.ring_size = _power_of_two(4 * num_pages)
        self.ring, self.head, self.tail = zeros(self.ring_size + 1), zeros(), zeros()
        self.pos = torch.full((num_pages,), -1, dtype=torch.int64, device=device)  # a page's live ring counter
        self.table_size = _power_of_two(4 * num_pages)
        self.slots = zeros(self.table_size + 1)  # page ids (NULL_PAGE: empty); the last cell is a trash cell
        # The kernels' scratch: the register's items (page, hash, pending, cell), the allocation's picked pages.
        self.scratch = zeros(4, num_pages)
        self.claims = torch.full((self.table_size + 1,), NO_CLAIM, dtype=torch.int64, device=device)
        # blink.engine.kernels.page_sharing's: each page's first and last holder (at rest: no holder), the pages kept
        # slots map (marked with the epoch).
        self.extremes = torch.stack([torch.full((num_pages,), NO_CLAIM, dtype=torch.int64, device=device),
                                     torch.full((num_pages,), -1, dtype=torch.int64, device=device)])
        self.mark, self.epoch = zeros(num_pages), zeros()
        # The Triton kernels of these methods' arguments and effects (blink.engine.kernels.prefix_cache), which the
        # device step sets.
        self.kernels = None

    def allocate(self, need: torch.Tensor, table: torch.Tensor, held: torch.Tensor, max_new: int) -> None:
        """Gives slot s `need[s]` more pages (at most max_new) after its `held[s]`; the caller guarantees they
        are free: empty pages first (off the stack), then the ring's oldest. The table's last column takes the
        masked-off writes."""
        if self.kernels is not None:
            self.kernels.allocate(self, need, table, held, max_new)
            return
        self._compact()
        grant = torch.arange(max_new, device=need.device)[None, :] < need[:, None]
        rank = grant.flatten().cumsum(0).view_as(grant) - 1
        k, empties = need.sum(), self.empties
        pages = self.stack[(empties - 1 - rank).clamp(min=0)]
        if not none_set(k > empties):  # the stack does not cover them: the ring's oldest too
            counter, page, live, nth = self._ring_live()
            picked = torch.zeros(self.ring_size + 1, dtype=torch.int64, device=need.device)
            picked.scatter_(0, torch.where(live, nth, self.ring_size), page)  # the ring's live pages, oldest first
            pages = torch.where(rank < empties, pages, picked[(rank - empties).clamp(0, self.ring_size)])
            taken = (k - empties).clamp(min=0)
            self.head.copy_(torch.where(live & (nth == taken - 1), counter + 1, self.head).amax())
        pages = torch.where(grant, pages, NULL_PAGE)
        j = torch.arange(max_new, device=need.device)
        table.scatter_(1, torch.where(grant, held[:, None] + j[None, :], table.shape[1] - 1), pages)
        pages = pages.flatten()
        self.refs.scatter_(0, pages, 1)
        self.hash.scatter_(0, pages, 0)  # evicted: its old contents are about to be overwritten
        self.pos.scatter_(0, pages, -1)
        self.empties -= k.minimum(empties)
        held += need
        self.num_free -= k

    def release(self, which: torch.Tensor, table: torch.Tensor, held: torch.Tensor) -> None:
        """Drops the references of the slots in the mask `which` to every page they hold. Slot by slot, each one's
        last page first, a page its last reference leaves goes onto the stack (holding nothing) or the ring."""
        if self.kernels is not None:
            self.kernels.release(self, which, table, held)
            return
        S, width = table.shape
        j = torch.arange(width, device=which.device)
        give = which[:, None] & (j[None, :] < held[:, None])
        pages = torch.where(give, table, NULL_PAGE)
        self.refs.index_add_(0, pages.flatten(), -give.flatten().long())
        # The page frees with its last reference: the last slot releasing it (the kernel's last program).
        slot = torch.arange(S, device=which.device)[:, None].expand(S, width)
        last = torch.full_like(self.refs, -1).scatter_reduce_(0, pages.flatten(), torch.where(give, slot, -1).flatten(),
                                                              reduce="amax")
        frees = (give & (self.refs[pages] == 0) & (last[pages] == slot)).flip(1).flatten()  # each slot's last first
        pages = pages.flip(1).flatten()
        cached = frees & (self.hash[pages] != 0)
        counter = self.tail + cached.long().cumsum(0) - 1
        kept = cached & (counter - self.head < self.ring_size)
        self.hash.scatter_(0, torch.where(cached & ~kept, pages, NULL_PAGE), 0)  # no room in the ring
        self.ring.scatter_(0, torch.where(kept, counter & (self.ring_size - 1), self.ring_size), pages)
        # A page with no room keeps no live entry either (an older one of its own would look live).
        self.pos.scatter_(0, torch.where(cached, pages, NULL_PAGE),
                          torch.where(kept, counter, torch.where(cached, -1, self.pos[NULL_PAGE])))
        onto_stack = frees & ~kept
        at = self.empties + onto_stack.long().cumsum(0) - 1
        self.stack.scatter_(0, torch.where(onto_stack, at, self.num_pages - 1), pages)
        self.tail += cached.sum()
        self.empties += onto_stack.sum()
        self.num_free += frees.sum()
        table.masked_fill_(give, NULL_PAGE)
        held.masked_fill_(which, 0)

    def reuse(self, hashes: torch.Tensor, prompt_len: torch.Tensor, which: torch.Tensor, table: torch.Tensor,
              held: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
        """Maps, for each slot in `which` (holding no page, nothing computed), the longest run of cached pages
        its prompt's hashes ([S, H]) find into its block table, as computed. Returns the tokens found, per slot."""
        if self.kernels is not None:
            return self.kernels.reuse(self, hashes, prompt_len, which, table, held, computed)
        page = self.page_size
        H = hashes.shape[1]
        usable = ((prompt_len - 1) // page).clamp(min=0, max=H)  # its last prompt token is always computed
        queried = which[:, None] & (torch.arange(H, device=hashes.device)[None, :] < usable[:, None])
        query = torch.where(queried, hashes, 0)
        cells = self.slots[self._window(query)]  # [S, H, PROBES]
        match = (self.hash[cells] == query[..., None]) & queried[..., None]
        found = match.any(-1)
        got = cells.gather(-1, match.long().argmax(-1, keepdim=True)).squeeze(-1)  # the first cell that matches
        run = found.long().cumprod(1)  # pages found without a gap from the first
        pages = torch.where(run.bool(), got, NULL_PAGE)
        table[:, :H] = torch.where(run.bool(), pages, table[:, :H])
        was_free = self.refs == 0
        self.refs.index_add_(0, pages.flatten(), run.flatten())
        self.num_free -= (was_free & (self.refs > 0)).sum()  # a free cached page taken leaves the ring's live part
        found_tokens = run.sum(1) * page
        held += run.sum(1)
        computed += found_tokens
        return found_tokens

    def register(self, hashes: torch.Tensor, prompt_len: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                 table: torch.Tensor, max_new: int) -> None:
        """Gives the full prompt pages a step completed (tokens before..after of each slot computed) their hashes:
        from now on they can be found. max_new: the most pages one slot completes in a step."""
        if self.kernels is not None:
            self.kernels.register(self, hashes, prompt_len, before, after, table, max_new)
            return
        page, H = self.page_size, hashes.shape[1]
        full = torch.minimum(after, prompt_len) // page
        j = before[:, None] // page + torch.arange(max_new, device=before.device)[None, :]
        new = j < full[:, None]
        pages = torch.where(new, table.gather(1, j.clamp(max=table.shape[1] - 1)), NULL_PAGE).flatten()
        values = torch.where(new, hashes.gather(1, j.clamp(max=H - 1)), 0).flatten()
        self.hash.scatter_(0, pages, values)
        self._insert(pages, values, new.flatten() & (values != 0))

    def _insert(self, pages: torch.Tensor, values: torch.Tensor, pending: torch.Tensor) -> None:
        """Puts each pending page into the table under its hash, in rounds: an item whose hash a cell of its window
        already finds is done; the others propose their window's first free cell, the lowest item taking a cell
        proposed twice; those left propose again; after PROBES rounds, or with no free cell, an item is dropped."""
        T = self.table_size
        item = torch.arange(pages.shape[0], device=pages.device)
        window = self._window(values)  # [M, PROBES]
        for _ in range(PROBES):
            cells = self.slots[window]
            holds = self.hash[cells]
            present = ((holds == values[:, None]) & (cells != NULL_PAGE)).any(1)
            free = (cells == NULL_PAGE) | (holds == 0) | ((window - (holds & (T - 1))) & (T - 1) >= PROBES)
            cell = window.gather(1, free.long().argmax(1, keepdim=True)).squeeze(1)
            propose = pending & ~present & free.any(1)
            target = torch.where(propose, cell, T)
            claim = torch.full((T + 1,), pages.shape[0], dtype=torch.int64, device=pages.device)
            claim.scatter_reduce_(0, target, item, reduce="amin")
            won = propose & (claim[target] == item)
            self.slots.scatter_(0, torch.where(won, cell, T), pages)
            pending = propose & ~won
            if none_set(pending):
                break

    def _window(self, values: torch.Tensor) -> torch.Tensor:
        """[..., PROBES] the table cells a hash may lie in."""
        mask = self.table_size - 1
        return ((values & mask)[..., None] + torch.arange(PROBES, device=values.device)) & mask

    def _ring_live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ring from its head: each cell's counter, its page, whether it is live, and its rank among the live."""
        counter = self.head + torch.arange(self.ring_size, device=self.ring.device)
        page = self.ring[counter & (self.ring_size - 1)]
        live = (counter < self.tail) & (self.refs[page] == 0) & (self.pos[page] == counter)
        return counter, page, live, live.long().cumsum(0) - 1

    def _compact(self) -> None:
        """Moves the ring's live entries together from its head, in order, when over half of it is taken."""
        compact = self.tail - self.head > self.ring_size // 2
        if none_set(compact):
            return
        _, page, live, nth = self._ring_live()
        moved = live & compact
        to = self.head + nth
        self.ring.scatter_(0, torch.where(moved, to & (self.ring_size - 1), self.ring_size), page)
        self.pos.scatter_(0, torch.where(moved, page, NULL_PAGE), torch.where(moved, to, self.pos[NULL_PAGE]))
        self.tail.copy_(torch.where(compact, self.head + live.sum(), self.tail))
