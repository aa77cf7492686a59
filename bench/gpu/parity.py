"""The parity phase of `blink bench gpu`: greedy tokens of every drive mode against the host mode's, case by case,
each case in an engine of its own so that one that fails loses nothing the others found."""

from __future__ import annotations

from pathlib import Path

from blink.bench.gpu.drive import drive_modes, engine_options, failure, free_memory, greedy, model_dir

SHAPE = "llama3-1b"


def parity(out: dict, dry_run: bool, save) -> None:
    """Greedy tokens of every drive mode against the host's: one short prompt (exact); a mixed batch (the first
    divergence per request: random bf16 weights give near-flat logits, so another bucket's rounding may flip a token
    without a bug); prompts whose prefix an earlier request left in the cache (a hit under capture); and a pool too
    small for its batch, so requests rotate out to host memory and back under capture. save(out): what was found
    so far, after each mode (about four engines a mode)."""
    directory = model_dir(SHAPE, dry_run)
    short = {0: list(range(100, 108))}
    mixed = {i: list(range(200 + 37 * i, 200 + 37 * i + n)) for i, n in enumerate((3, 17, 64, 130, 5, 250, 31, 9))}
    shared = list(range(300, 396))  # six 16-token pages the first round leaves cached for the second
    prefixed = [{0: [*shared, 7, 8, 9]}, {i: shared + list(range(600 + 11 * i, 604 + 11 * i)) for i in range(1, 4)}]
    # 14 pages each, 8 requests: the GPU's pool of 66 (the fewest that hold its 1,024-token context) holds 4 of them
    crowded = {i: [(11 * i + 3 * j) % 1000 + 10 for j in range(200)] for i in range(8)}
    pressure = {"num_pages": 40 if dry_run else 66, "swap_space": 1.0}
    cases = {"short": ([short], 16, {}), "mixed": ([mixed], 24, {}), "prefixed": (prefixed, 16, {}),
             "rotated": ([crowded], 24, pressure)}
    tokens: dict[str, dict] = {}
    stats: dict[str, dict] = {}
    out["tokens"], out["stats"] = tokens, stats
    for mode in drive_modes(dry_run):
        tokens[mode], stats[mode] = {}, {}
        for case, (rounds, n, options) in cases.items():
            done = []
            try:  # the next case still runs
                tokens[mode][case] = greedy(directory, dry_run, mode, rounds, n, stats=done, **options)[-1]
            except Exception as e:
                tokens[mode][case] = {"error": failure(e)}
            free_memory()
            if case == "prefixed":  # the second round found the first's pages
                stats[mode]["cached_tokens"] = sum(s.cached_tokens for s in done)
            if case == "rotated":  # pages went out to host memory and came back
                stats[mode]["pages_out"] = sum(s.pages_out for s in done)
                stats[mode]["pages_in"] = sum(s.pages_in for s in done)
        save(out)
    host = tokens.get("host", {})
    out["against_host"] = {}
    for mode, got in tokens.items():
        compared: dict[str, object] = {}
        for case in cases:
            if "error" in got[case] or "error" in host.get(case, {"error": None}):
                compared[f"{case}_error"] = True
            elif case == "short":
                compared["short_identical"] = got[case] == host[case]
            else:
                compared[f"{case}_first_divergence"] = {slot: _first_divergence(host[case][slot], got[case][slot])
                                                        for slot in host[case]}
        if "mixed_first_divergence" in compared:
            compared["mixed_teacher_forced_gap"] = teacher_forced_gap(directory, dry_run, mixed, got["mixed"])
        compared["prefix_hit"] = stats[mode].get("cached_tokens", 0) > 0  # else the case tested no hit
        compared["rotated_out_and_back"] = stats[mode].get("pages_out", 0) == stats[mode].get("pages_in", 0) > 0
        out["against_host"][mode] = compared


def teacher_forced_gap(directory: Path, dry_run: bool, prompts: dict[int, list[int]],
                       generated: dict[int, list[int]]) -> float:
    """How far from greedy a mode's tokens are, by the offline engine's own logprobs: each prompt followed by what
    the mode generated, scored in one prefill (prompt_logprobs); the largest gap, in nats, between the top token's
    logprob and the generated token's. A flip that rounding explains has a gap near 0; a bug, a large one."""
    from blink.engine import LLM, SamplingParams

    llm = LLM(str(directory), **engine_options(dry_run))
    room = llm.engine.max_model_len - 1  # the scoring prefill generates one token too
    sequences = [(prompts[slot] + generated[slot])[:room] for slot in prompts]
    outs = llm.generate(sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    gap = 0.0
    for slot, out in zip(prompts, outs, strict=True):
        for position in range(len(prompts[slot]), len(out.prompt_token_ids)):
            scored = out.prompt_logprobs[position]
            gap = max(gap, max(e.logprob for e in scored.values()) - scored[out.prompt_token_ids[position]].logprob)
    del llm
    free_memory()
    return gap


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))
