"""The `blink` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blink", description="Blink: LLM serving off the host's per-token path")
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="manage checkpoints").add_subparsers(dest="model_command", required=True)
    init = model.add_parser("init", help="write the default random-weight model (to DIR or the cache)")
    init.add_argument("dir", nargs="?", type=Path)

    gen = commands.add_parser("generate", help="generate offline on the engine (host drive mode)")
    gen.add_argument("--model", help="checkpoint directory (default: the built-in random model)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-num-seqs", type=int)
    gen.add_argument("--max-num-batched-tokens", type=int)
    gen.add_argument("--max-model-len", type=int)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "model":
        return _model_init(args.dir)
    return _generate(args)


def _model_init(target: Path | None) -> int:
    from blink.engine.default_model import default_model_dir, write_default_model

    path = write_default_model(target or default_model_dir())
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from blink.engine import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
    prompts = args.prompt or ["The quick brown fox", "Once upon a time", "Question: What is two plus two?"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(json.dumps({"prompt": out.prompt, "text": out.text, "tokens": len(out.token_ids),
                          "finish_reason": out.finish_reason}, ensure_ascii=False))
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s) on {llm.engine.device}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
