"""`blink bench speculation`: speculative decoding (n-gram drafts, `--speculative-config`) on against off (issue 41).

Two engines on the same real instruct model (default: the default checkpoint, SmolLM2-135M-Instruct) in one process,
through the offline API's driver: one plain, one with drafts. Input-grounded prompts (rewrite this code, summarise
this text, fill this JSON from this record, correct this text, tabulate this list, convert this JSON), whose answers
copy their input, and open-ended ones, whose drafts the policy should stop trying. Six grounded prompts, not three:
a small model's greedy answer can turn on a tie between two logits, so one prompt's answer (and its share of the
copying) may change with a kernel's rounding. At batch 1 and batch 8 (the prompts repeated to fill it). Rounds
alternate which engine goes first, so a drift of the machine's load is shared. Per cell: output tokens/s (wall), P50
and P99 TPOT over requests (a request's (last token - first token) / (tokens - 1)), the mean acceptance length (1 +
accepted / drafts, vLLM's), and whether the greedy text is plain decoding's, request by request. Prints, saves JSON
under bench/results with the machine, asserts nothing.

    blink bench speculation            # a few minutes on 2 CPU cores
    blink bench speculation --quick    # one round, short answers: a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from blink.bench.lib.machine import blink_source, machine, save

CODE = '''def total(items):
    result = 0
    for item in items:
        if item["price"] > 0:
            result = result + item["price"] * item["quantity"]
    return result


def names(users):
    out = []
    for user in users:
        if user["active"]:
            out.append(user["first_name"] + " " + user["last_name"])
    return out
'''
TEXT = ("The city council met on Tuesday to discuss the new budget for the public library. The library director, "
        "Maria Lopez, asked for an increase of twelve percent to extend opening hours on weekends and to buy new "
        "computers for the reading room. Several council members supported the request, saying that the library is "
        "used by students, retirees and job seekers every day. Others argued that the city must first repair the "
        "roads near the river, which were damaged by the floods in March. After a long debate, the council agreed to "
        "raise the library budget by eight percent and to review the request again in six months.")
RECORD = ("Customer record: name Anna Schmidt, born 14 March 1987, customer number 40551, email "
          "anna.schmidt@example.com, phone +49 30 1234567, address Lindenstrasse 12, 10969 Berlin, Germany, "
          "member since 2015, preferred "
          "language German, newsletter yes.")
TYPOS = ("The new libary will open on Monday mornning. Vistors can borow up to ten books at a time, and childern under "
         "twelve get a free membrship card. The reading room has fourty seats, free wifi and a small cafe that sells "
         "coffe and sandwitches.")
PEOPLE = ("- Alice Martin, software engineer, Lyon\n- Bruno Costa, product manager, Porto\n- Chen Wei, data scientist, "
          "Shanghai\n- Dana Levi, designer, Haifa\n- Erik Larsen, support engineer, Oslo\n- Fatima Zahra, researcher, "
          "Rabat")
CONFIG = ('{"server": {"host": "0.0.0.0", "port": 8080, "workers": 4}, "database": {"url": "postgres://db:5432/app", '
          '"pool_size": 10, "timeout_seconds": 30}, "logging": {"level": "info", "format": "json"}}')
GROUNDED = {
    "code": "Rewrite this Python code with type hints, keeping everything else exactly the same:\n\n" + CODE,
    "summary": "Repeat the following text, then summarise it in two sentences:\n\n" + TEXT,
    "json": ("Fill this JSON object from the record below: {\"name\": \"\", \"birth_date\": \"\", \"customer_number\": "
             "\"\", \"email\": \"\", \"phone\": \"\", \"street\": \"\", \"postal_code\": \"\", \"city\": \"\", "
             "\"country\": \"\", \"member_since\": \"\", \"language\": \"\", \"newsletter\": \"\"}\n\n" + RECORD),
    "typos": "Correct the spelling mistakes in this text and write it out in full:\n\n" + TYPOS,
    "table": "Turn this list into a Markdown table with the columns Name, Role and City:\n\n" + PEOPLE,
    "yaml": "Convert this JSON to YAML:\n\n" + CONFIG,
}
OPEN_ENDED = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "advice": "What are some good habits for staying healthy while working from home?",
    "poem": "Write a poem about autumn in the mountains.",
}
# A 1-token match drafts too: its drafts earn their own acceptance rate, so they stop where they fail.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a checkpoint (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto: the engine's choice (bfloat16 on a CPU that has it)")
    p.add_argument("--speculative-config", default=None, help=f"the drafts' config (default: {SPEC})")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one round of 48 tokens, batch 1")
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--no-save", action="store_true")


def _chat(llm, text: str) -> list[int]:
    """The model's chat template around one user message, as the chat API renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tokenizer = llm.tokenizer
    template = ImmutableSandboxedEnvironment().from_string(tokenizer.chat_template)
    return tokenizer.encode(template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True),
                            add_special_tokens=False)


def _run_batch(llm, prompts: list[list[int]], max_tokens: int):
    """Generates greedily through the offline driver; returns (token ids per request, wall seconds, TPOTs)."""
    from blink.engine import SamplingParams

    driver = llm._driver
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        driver.add_request(str(i), prompt, params, max_tokens)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    start = time.perf_counter()
    while driver.has_work():
        events = driver.step()
        now = time.perf_counter()
        for e in events:
            if e.tokens:
                tokens[e.request_id] += e.token_ids
                first.setdefault(e.request_id, now)
                last[e.request_id] = now
    wall = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (len(t) - 1) for r, t in tokens.items() if len(t) > 1]
    return [tokens[str(i)] for i in range(len(prompts))], wall, tpots


def _counts(llm) -> list[int]:
    """vLLM's counters as the engine keeps them: drafts, draft tokens, accepted tokens, then the accepted tokens at
    each draft position (spec_decode_num_accepted_tokens_per_pos)."""
    state = llm.engine.state
    return state.spec_counts.tolist() + state.spec_accepted_per_pos.tolist()


def run(args: argparse.Namespace) -> None:
    from blink.engine import LLM
    from blink.shared.speculative import speculative_config

    spec = speculative_config(args.speculative_config) if args.speculative_config else speculative_config(SPEC)
    rounds, max_tokens, batches = args.rounds, args.max_tokens, args.batches
    if args.quick:
        rounds, max_tokens, batches = 1, 48, [1]
    options = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(8, *batches), max_model_len=2048)
    engines = {"off": LLM(args.model, **options),
               "on": LLM(args.model, **options, speculative_config=spec.model_dump())}
    sets = {"grounded": GROUNDED, "open_ended": OPEN_ENDED}
    prompts = {name: [_chat(engines["off"], text) for text in texts.values()] for name, texts in sets.items()}
    for llm in engines.values():  # the first steps of an engine pay for its allocations: not measured
        _run_batch(llm, prompts["grounded"][:1], 16)
    cells: dict[tuple, dict] = {}
    for r in range(rounds):
        for batch in batches:
            for name, group in prompts.items():
                # Batch 1: each prompt alone, in turn; batch B: the prompts repeated to B at once.
                runs = [[p] for p in group] if batch == 1 else [[group[i % len(group)] for i in range(batch)]]
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    llm = engines[mode]
                    cell = cells.setdefault((batch, name, mode), {"tokens": 0, "seconds": 0.0, "tpots": [],
                                                                  "texts": [], "counts": None})
                    before = _counts(llm)
                    for batch_prompts in runs:
                        texts, wall, tpots = _run_batch(llm, batch_prompts, max_tokens)
                        cell["tokens"] += sum(map(len, texts))
                        cell["seconds"] += wall
                        cell["tpots"] += tpots
                        if r == 0:
                            cell["texts"] += texts
                    spent = [a - b for a, b in zip(_counts(llm), before, strict=True)]
                    cell["counts"] = spent if cell["counts"] is None else [c + d for c, d in zip(cell["counts"], spent,
                                                                                                 strict=True)]
    results = []
    for batch in batches:
        for name in prompts:
            off, on = cells[(batch, name, "off")], cells[(batch, name, "on")]
            row = {"batch": batch, "prompts": name}
            for mode, cell in (("off", off), ("on", on)):
                tpots = sorted(cell["tpots"])
                row[mode] = {"tokens_per_s": cell["tokens"] / cell["seconds"],
                             "tpot_p50_ms": 1000 * statistics.median(tpots),
                             "tpot_p99_ms": 1000 * tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
                             "output_tokens": cell["tokens"]}
            drafts, drafted, accepted, *per_pos = on["counts"]
            row["on"].update(drafts=drafts, draft_tokens=drafted, accepted_tokens=accepted,
                             mean_acceptance_length=1 + accepted / drafts if drafts else None,
                             accepted_per_pos=per_pos[:spec.num_speculative_tokens],
                             acceptance_rate_per_pos=[n / drafts for n in per_pos[:spec.num_speculative_tokens]]
                             if drafts else None)
            row["speedup"] = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
            row["identical_greedy_text"] = sum(a == b for a, b in zip(off["texts"], on["texts"], strict=True))
            row["requests_compared"] = len(off["texts"])
            results.append(row)
    _print(results)
    per_step, per_token = engines["on"].engine.step.cost.fit.tolist()
    print(f"step-cost fit of the engine with drafts: {1000 * per_step:.2f} ms a step + {1000 * per_token:.3f} ms "
          "a token")
    result = {"benchmark": "speculation", "model": str(engines["off"].engine.model_dir), "dtype": args.dtype,
              "device": args.device, "speculative_config": spec.model_dump(exclude_none=True), "rounds": rounds,
              "max_tokens": max_tokens, "results": results,
              "step_cost_fit_s": {"per_step": per_step, "per_token": per_token}, "machine": machine(),
              "blink": blink_source()}
    if not args.no_save:
        print(f"saved {save('speculation', result, args.result_dir)}")


def _print(results: list[dict]) -> None:
    print(f"{'batch':>5} {'prompts':<11} {'off tok/s':>9} {'on tok/s':>9} {'speedup':>7} {'P50 TPOT off/on ms':>19} "
          f"{'P99 TPOT off/on ms':>19} {'accept len':>10} {'same text':>9}  accepted by draft position")
    for r in results:
        off, on = r["off"], r["on"]
        length = on["mean_acceptance_length"]
        print(f"{r['batch']:>5} {r['prompts']:<11} {off['tokens_per_s']:>9.1f} {on['tokens_per_s']:>9.1f} "
              f"{r['speedup']:>6.2f}x {off['tpot_p50_ms']:>9.1f}/{on['tpot_p50_ms']:<9.1f} "
              f"{off['tpot_p99_ms']:>9.1f}/{on['tpot_p99_ms']:<9.1f} {length or 0:>10.2f} "
              f"{r['identical_greedy_text']:>4}/{r['requests_compared']}  "
              + " ".join(f"{rate:.0%}" for rate in on["acceptance_rate_per_pos"] or ()))
