"""One engine step: plan → forward → sample → commit, all tensor work on the engine's device.

The step is split in two so a driver can pick the forward's bucket between the halves: `plan()` leaves
the number of live tokens, the longest context and the page moves in `plan.sizes` (scheduler.PlanSizes, on the
device); `run(plan, shape)` does the rest on shapes fixed by `shape`. The host mode reads the sizes
(`plan.read_sizes()`, its one sync) to choose `shape`; the device step runs on the bucket its driver picked from
the demand it published, and reads the sizes on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from blink.engine.core.admission import admit
from blink.engine.core.bookkeeping import TORCH_BOOKKEEPING, Bookkeeping
from blink.engine.core.commit import PromptScores, StepOutput, commit, score_prompt
from blink.engine.core.draft_model import DraftModel
from blink.engine.core.kv_cache import PagePool
from blink.engine.core.policy import Policy, StepCost
from blink.engine.core.rotation import HostMirror
from blink.engine.core.sampler import SampleOutput, SamplerFeatures, SamplingRows, hash32
from blink.engine.core.scheduler import PlanSizes, StepPlan, plan
from blink.engine.core.speculation import Speculation
from blink.engine.core.state import Slots, pack
from blink.engine.model.attention import AttentionBatch
from blink.engine.model.model import Transformer
from blink.engine.model.parallel import Shard


@dataclass(frozen=True)
class StepShape:
    """The buckets one step runs on; the driver picks them from `plan.sizes`."""

    tokens: int  # batch tokens the forward runs on (the device step's bucket; the host mode's live tokens)
    context: int  # cache rows each sequence may read (a bucket of the context limit)
    decode_rows: int  # sequences computing one token
    chunk_rows: int  # blocks of QUERY_BLOCK queries of the sequences computing several (prefill chunks)
    rows: int  # logits rows: min(slots, tokens); with drafts min(slots * (1 + K), tokens)
    prompt_rows: int = 0  # prompt logprobs the step may compute (plan caps them at this)
    # With a draft model: the rows its draft forwards compute (the host mode's drafting slots, the device step's
    # slots that its bucket fits), and how many forwards follow its first (the longest draft, or K).
    draft_rows: int = 0
    draft_steps: int = 0


def ladder(top: int, start: int) -> list[int]:
    """Powers of two from `start` below `top`, then `top` itself."""
    sizes, size = [], start
    while size < top:
        sizes.append(size)
        size *= 2
    return [*sizes, top]


class Step:
    def __init__(self, model: Transformer, pool: PagePool, state: Slots, eos_ids: list[int],
                 token_budget: int, policy: Policy, shard: Shard | None = None,
                 speculation: Speculation | None = None, drafter: DraftModel | None = None):
        """shard: this rank's, with tensor parallelism: every rank plans with rank 0's step-cost inputs;
        speculation: drafts verified in the step (engine/core/speculation.py); drafter: the draft model that writes
        them, for a speculation without lookup (engine/core/draft_model.py)."""
        self.model, self.pool, self.state, self.shard = model, pool, state, shard
        self.speculation, self.drafter = speculation, drafter
        self.token_budget, self.policy = token_budget, policy
        device = state.status.device
        self.cost = StepCost(device)  # the step-time model's fit (policy.StepCostModel) that the plan reads
        self.eos_ids = torch.tensor(eos_ids or [-1], dtype=torch.int64, device=device)
        self.vocab_hash = hash32(torch.arange(model.cfg.vocab_size, dtype=torch.int64, device=device)).to(torch.int32)
        self.sampler = model.kernels.sampler
        self.gathered = GatheredSampling(self)  # the sampling of a sampler without step kernels
        # The bookkeeping's tensor functions (admit: the device modes' admission, in every step they run);
        # compile_bookkeeping may swap in compiled ones.
        self.admitter, self.planner, self.committer = admit, plan, commit
        self.use(model.kernels.bookkeeping)
        self.grammar = None  # the host mode's constrained slots (engine/core/grammar.py SlotGrammars), masked in run
        # The device modes capture a graph per token bucket: few, from 16. The host mode captures nothing, so its
        # forward runs on the live tokens alone, no padding: on a CPU a product's cost grows with its rows (a lone
        # decode padded to 16 cost 16x the work; a 5-token verification padded to 8, 1.4x its own).
        self.token_buckets = ladder(token_budget, 16)
        # Context and row counts only shape the torch attention reference, which the host mode runs as it is,
        # so they are fine-grained (contexts) or exact (rows); the device loops' kernels do not use them.
        page = pool.page_size
        top = -(-state.max_len // page) * page
        step = max(page, 64)
        self.context_buckets = [*range(step, top, step), top]

    def compile_bookkeeping(self, backend: str = "inductor") -> None:
        """The plan, the commit and the device modes' admission through torch.compile, whole (fullgraph: a graph
        break fails rather than falling back): their hundreds of small tensor ops fused into tens of kernels, for a
        GPU, where each op of a captured step is a kernel of its own, and for the CPU's per-op overhead
        (docs/design.md, "The step's kernel count"). Compiled for the first bucket a step meets, then once more
        with the bucket's sizes left symbolic."""
        if backend == "inductor" and self.state.status.device.type == "cpu":
            _check_cpp_compiler()
        # Recompiles past dynamo's limit are a hard failure with fullgraph: room for one per power of two of the
        # budget, should the sizes not go symbolic.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 2 * len(ladder(self.token_budget, 1)))
        self.use(TORCH_BOOKKEEPING)  # what is compiled is the references, whole
        self.admitter, self.planner, self.committer = (torch.compile(f, fullgraph=True, backend=backend)
                                                       for f in (admit, plan, commit))

    def use(self, kernels: Bookkeeping) -> None:
        """Binds the kernels that stand in for the bookkeeping's references (engine/core/bookkeeping.py)."""
        self.plan_kernels = kernels.plan
        bound = {"settler": kernels.settle, "advancer": kernels.advance}
        self.committer = functools.partial(commit, **{name: kernel for name, kernel in bound.items() if kernel})
        if self.speculation is not None:
            self.speculation = dataclasses.replace(self.speculation, settle_kernel=kernels.settle_runs,
                                                   draft_kernel=kernels.draft)

    def plan(self, features: SamplerFeatures, mirror: HostMirror | None) -> StepPlan:
        """mirror: where KV pages rotate (the host drive mode's); None: preempted requests are recomputed."""
        prompt_rows = self.token_budget if features.prompt_logprobs else 0
        if self.shard is not None:  # the host-timed inputs: every rank must make rank 0's decisions
            self.shard.from_first(self.cost.values)
        return self.planner(self.state, self.pool, self.token_budget, self.policy, mirror, self.cost, prompt_rows,
                            self.plan_kernels, speculation=self.speculation)

    def shape_for(self, sizes: PlanSizes) -> StepShape:
        """The host mode's buckets: the plan's sizes, read (and with a draft model, its drafts': a second read)."""
        tokens = max(sizes.tokens, 1)
        draft_rows = draft_steps = 0
        if self.drafter is not None:
            k = self.state.draft_len
            draft_rows, draft_steps = torch.stack([(k > 0).sum(), k.max()]).tolist()
        return StepShape(
            tokens=tokens,
            context=_bucket(self.context_buckets, sizes.max_context),
            decode_rows=sizes.decode_rows,
            chunk_rows=sizes.chunk_rows,
            rows=(self.speculation.rows(self.state.num_slots, tokens) if self.speculation
                  else min(self.state.num_slots, tokens)),
            prompt_rows=sizes.prompt_entries,
            draft_rows=draft_rows,
            draft_steps=draft_steps,
        )

    def run(self, plan: StepPlan, shape: StepShape, features: SamplerFeatures, mirror: HostMirror | None) -> StepOutput:
        state, pool, model = self.state, self.pool, self.model
        B, R = shape.tokens, shape.rows
        batch = self._attention_batch(plan, shape)
        if self.drafter is not None:  # the draft model's tokens into the batch its target verifies
            self.drafter.propose(state, plan, shape)
        hidden = model.forward(plan.input_ids[:B], plan.token_pos[:B], batch, pool.k, pool.v)
        # The step's sampling straight from the state (the fused sampler's kernels), or from gathered rows.
        sampling = self.sampler.step or self.gathered
        # One pass over the output embedding for the sampling and the prompt rows together.
        rows_read, prompt = sampling.rows_read(state, plan, B, R, shape.prompt_rows)
        logits = model.logits(hidden[rows_read])
        if self.grammar is not None:  # structured outputs: -inf where a constrained row's grammar says no
            self.grammar.mask(logits[:R], plan.sample_slot[:R])
        out, scored = sampling.sample(logits, state, plan, R, prompt, features, self.eos_ids)
        logits = logits[:R]
        # With drafts the speculation settles; else the committer's own settler (the device step's kernel).
        settler = {} if self.speculation is None else {"settler": self.speculation.settle}
        return self.committer(state, pool, mirror, plan, R, out, logits, self.eos_ids,
                              count_outputs=features.penalties, prompt=scored, **settler)

    def _attention_batch(self, plan: StepPlan, shape: StepShape) -> AttentionBatch:
        return self.model.kernels.attention_batch(plan, shape, self.state.block_table, self.pool.page_size)


class GatheredSampling:
    """The step's sampling from rows gathered out of the slot state, through the step's `Sampler` (the torch
    reference, the CPU's): the interface of the fused sampler's step kernels (engine/kernels/step_sampler.py
    StepKernels), which read the state in place."""

    def __init__(self, step: Step):
        self.step = step  # its sampler is read at each call: a benchmark may swap it

    def rows_read(self, state: Slots, plan: StepPlan, tokens: int, rows: int,
                  prompt_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch rows whose logits the step computes (the sampling rows', then the prompt tokens scored), and the
        prompt tokens' batch indices."""
        if not prompt_rows:
            return plan.sample_token[:rows], None
        prompt = _prompt_tokens(state, plan, tokens, prompt_rows)
        return torch.cat([plan.sample_token[:rows], prompt]), prompt

    def sample(self, logits: torch.Tensor, state: Slots, plan: StepPlan, rows: int, prompt: torch.Tensor | None,
               features: SamplerFeatures, eos_ids: torch.Tensor) -> tuple[SampleOutput, PromptScores | None]:
        sampler = self.step.sampler
        sampled, prompt_logits = logits[:rows], logits[rows:]
        gathered = sampling_rows(state, plan, plan.sample_token[:rows], features, eos_ids)
        seen = _seen_tokens(state, plan.sample_slot[:rows]) if features.penalties else ()
        out = sampler.sample(sampled, gathered, features, self.step.vocab_hash, *seen)
        scored = score_prompt(state, plan, prompt, prompt_logits, sampler) if prompt is not None else None
        return out, scored


def sampling_rows(state: Slots, plan: StepPlan, rows_read: torch.Tensor, features: SamplerFeatures,
                  eos_ids: torch.Tensor) -> SamplingRows:
    """Each sampling row's parameters ([R]: rows_read's batch tokens), gathered from its slot's: the torch
    sampler's inputs."""
    slot = plan.sample_slot[:rows_read.shape[0]]
    rows = SamplingRows(
        temperature=state.temperature[slot], top_p=state.top_p[slot], top_k=state.top_k[slot],
        min_p=state.min_p[slot], repetition_penalty=state.repetition_penalty[slot],
        presence_penalty=state.presence_penalty[slot], frequency_penalty=state.frequency_penalty[slot],
        # The index of the token the row draws (its position's, for a run with drafts): the seeded noise of plain
        # decoding for that token.
        seed=state.seed[slot], step_index=plan.token_pos[rows_read] + 1 - state.prompt_len[slot],
    )
    if features.min_tokens:  # eos (unless ignored) and the stop ids, while fewer than min_tokens are out
        eos = eos_ids[None, :].expand(slot.shape[0], -1).masked_fill(state.ignore_eos[slot][:, None], -1)
        young = (rows.step_index < state.min_tokens[slot])[:, None]
        rows.held = torch.where(young, torch.cat([eos, state.stop_ids[slot]], 1), -1)
    if features.logit_bias:
        rows.bias_ids, rows.bias = state.logit_bias_ids[slot], state.logit_bias[slot]
    if features.logprobs:
        rows.logprobs = state.logprobs[slot]
    return rows


def _seen_tokens(state: Slots, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The penalties' inputs for the rows of `slot`: each sequence's tokens so far ([R, max_len], -1 past its
    length) and how often each was generated: gathers over the context, not the vocabulary."""
    tokens = state.tokens[slot, :-1].long()
    seen = torch.where(torch.arange(tokens.shape[1], device=tokens.device) < state.seq_len[slot][:, None], tokens, -1)
    return seen, state.output_counts[slot[:, None], seen.clamp(min=0)]


def _prompt_tokens(state: Slots, plan: StepPlan, tokens: int, prompt_rows: int) -> torch.Tensor:
    """[prompt_rows] batch indices of the tokens whose logits score a prompt token this step, packed first (in batch
    order, so slot after slot; the rest 0)."""
    slot, pos = plan.token_slot[:tokens], plan.token_pos[:tokens]
    start = torch.maximum(state.num_computed, state.scored)[slot]  # num_computed: before this step's commit
    scores = plan.token_valid[:tokens] & (pos >= start) & (pos < start + plan.prompt_entries[slot])
    return pack(scores)[0][:prompt_rows]


def _check_cpp_compiler() -> None:
    """Inductor builds its CPU kernels with a C++ compiler: a machine without one is told now, not in the first
    step."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # a torch that moved it: its own error comes with the first step
        return
    try:
        get_cpp_compiler()
    except Exception as e:
        raise ValueError(f"compile_bookkeeping on the CPU needs a C++ compiler, which torch.compile builds its "
                         f"kernels with ({e}); install one (g++) or leave compile_bookkeeping off") from e


def _bucket(ladder: list[int], size: int) -> int:
    return next(b for b in ladder if b >= size)
