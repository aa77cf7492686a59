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
too). All of it is fixed-shape tensor work (a sort of the pool's hashes, a binary search per page queried, masked
scatters) with no host read, so the device modes capture it with the rest of the step.
"""

from __future__ import annotations

import torch

from blink.engine.core.kv_cache import NULL_PAGE

_NEVER = torch.iinfo(torch.int64).max  # the allocation key of a page in use


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
        self.stamp = zeros(num_pages)  # when it was last released, and which page of its request (LRU order)
        self.clock = zeros()
        self.num_free = torch.tensor(num_pages - 1, dtype=torch.int64, device=device)
        # A kernel of release's arguments and effects (blink.engine.kernels.page_release), which the device step sets.
        self.releaser = None

    def allocate(self, need: torch.Tensor, table: torch.Tensor, held: torch.Tensor, max_new: int) -> None:
        """Gives slot s `need[s]` more pages (at most max_new) after its `held[s]`; the caller guarantees they
        are free. The table's last column takes the masked-off writes."""
        free = self.refs == 0
        key = torch.where(free, torch.where(self.hash == 0, -1, self.stamp), _NEVER)
        order = key.argsort(stable=True)
        j = torch.arange(max_new, device=need.device)
        grant = j[None, :] < need[:, None]
        rank = grant.flatten().cumsum(0).view_as(grant) - 1
        pages = torch.where(grant, order[rank.clamp(0, self.num_pages - 1)], NULL_PAGE)
        table.scatter_(1, torch.where(grant, held[:, None] + j[None, :], table.shape[1] - 1), pages)
        self.refs.scatter_(0, pages.flatten(), 1)
        self.hash.scatter_(0, pages.flatten(), 0)  # evicted: its old contents are about to be overwritten
        held += need
        self.num_free -= need.sum()

    def release(self, which: torch.Tensor, table: torch.Tensor, held: torch.Tensor) -> None:
        """Drops the references of the slots in the mask `which` to every page they hold."""
        if self.releaser is not None:
            self.releaser(self, which, table, held)
            return
        width = table.shape[1]
        j = torch.arange(width, device=which.device)
        give = which[:, None] & (j[None, :] < held[:, None])
        pages = torch.where(give, table, NULL_PAGE).flatten()
        self.refs.index_add_(0, pages, -give.flatten().long())
        self.clock += 1
        # Later pages of a request count as released earlier: evicted first, they leave its prefix cached longest.
        stamp = self.clock * width + (width - 1 - j)
        self.stamp.scatter_(0, pages, stamp.expand_as(give).flatten())
        self._count_free()
        table.masked_fill_(give, NULL_PAGE)
        held.masked_fill_(which, 0)

    def reuse(self, hashes: torch.Tensor, prompt_len: torch.Tensor, which: torch.Tensor, table: torch.Tensor,
              held: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
        """Maps, for each slot in `which` (holding no page, nothing computed), the longest run of cached pages
        its prompt's hashes ([S, H]) find into its block table, as computed. Returns the tokens found, per slot."""
        page = self.page_size
        H = hashes.shape[1]
        usable = ((prompt_len - 1) // page).clamp(min=0, max=H)  # its last prompt token is always computed
        queried = which[:, None] & (torch.arange(H, device=hashes.device)[None, :] < usable[:, None])
        query = torch.where(queried, hashes, 0)
        cached, cached_page = self.hash.sort()
        at = torch.searchsorted(cached, query).clamp(max=self.num_pages - 1)
        found = (cached[at] == query) & queried
        run = found.long().cumprod(1)  # pages found without a gap from the first
        pages = torch.where(run.bool(), cached_page[at], NULL_PAGE)
        table[:, :H] = torch.where(run.bool(), pages, table[:, :H])
        self.refs.index_add_(0, pages.flatten(), run.flatten())
        self._count_free()
        found_tokens = run.sum(1) * page
        held += run.sum(1)
        computed += found_tokens
        return found_tokens

    def register(self, hashes: torch.Tensor, prompt_len: torch.Tensor, before: torch.Tensor, after: torch.Tensor,
                 table: torch.Tensor, max_new: int) -> None:
        """Gives the full prompt pages a step completed (tokens before..after of each slot computed) their hashes:
        from now on they can be found. max_new: the most pages one slot completes in a step."""
        page, H = self.page_size, hashes.shape[1]
        full = torch.minimum(after, prompt_len) // page
        j = before[:, None] // page + torch.arange(max_new, device=before.device)[None, :]
        new = j < full[:, None]
        pages = torch.where(new, table.gather(1, j.clamp(max=table.shape[1] - 1)), NULL_PAGE)
        values = torch.where(new, hashes.gather(1, j.clamp(max=H - 1)), 0)
        self.hash.scatter_(0, pages.flatten(), values.flatten())

    def _count_free(self) -> None:
        self.num_free.copy_((self.refs == 0).sum())
