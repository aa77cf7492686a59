"""The `blink` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
import typing
from pathlib import Path

from blink.shared.service_class import parse_class
from blink.shared.settings import Settings


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field; what is not given comes from BLINK_* variables or the defaults."""
    for name, field in Settings.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        if field.annotation is bool:  # a switch and its --no- form, as vLLM's --enable-prefix-caching
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=field.description)
        elif _is_list(field.annotation):  # `--served-model-name a b`, or one JSON array (Settings reads both)
            parser.add_argument(flag, dest=name, nargs="+", default=None, help=field.description)
        else:
            parser.add_argument(flag, dest=name, default=None, help=field.description)


def _is_list(annotation: object) -> bool:
    """list[...], maybe within Optional or Annotated."""
    origin = typing.get_origin(annotation)
    return origin is list or (origin is not None and any(_is_list(a) for a in typing.get_args(annotation)))


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    return Settings(**given)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # before parsing: blink.bench.cli imports only what the benchmark asked for needs
        from blink.bench.cli import main as bench_main

        return bench_main(argv[1:])
    return _run(_parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    """Every command, in the order `blink --help` lists them."""
    parser = argparse.ArgumentParser(prog="blink", description="Blink: LLM serving off the host's per-token path")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_service_commands(commands)
    _add_operator_commands(commands)
    _add_file_commands(commands)
    _add_generate_command(commands)
    # Listed here for --help; main() hands `blink bench ...` to blink.bench.cli before parsing.
    commands.add_parser("bench", help="benchmarks: serve, plot, offline, overhead (`blink bench --help`)")
    return parser


def _add_service_commands(commands: argparse._SubParsersAction) -> None:
    """The long-running services: each takes every Settings flag."""
    for name, text in (("serve", "run the engine and the ingress (the OpenAI API), watched by the watchdog"),
                       ("engine", "run the engine service alone"), ("ingress", "run the ingress service alone"),
                       ("watchdog", "watch an engine and an ingress started elsewhere (compose)")):
        add_settings_flags(commands.add_parser(name, help=text))


def _add_operator_commands(commands: argparse._SubParsersAction) -> None:
    """What an operator asks of a machine or a running deployment: probe, doctor, classes."""
    probe = commands.add_parser("probe", help="exit 0 if the service answers its control socket (healthchecks)")
    probe.add_argument("service", choices=["engine", "ingress"])
    add_settings_flags(probe)

    doctor = commands.add_parser("doctor", help="list the transports and drive modes this machine supports, and why "
                                 "not the others")
    doctor.add_argument("--rdma-device", help="the RDMA device to check (default: the first)")
    doctor.add_argument("--json", action="store_true")

    classes = commands.add_parser("classes", help="show the running ingress's service-class defaults, or change "
                                  "them with --default-class and --ls-/--be-ttft-/tpot-slo-ms (0 clears one)")
    add_settings_flags(classes)


def _add_file_commands(commands: argparse._SubParsersAction) -> None:
    """The commands that write files ahead of serving: model init, model pull, keygen."""
    model = commands.add_parser("model", help="manage checkpoints").add_subparsers(dest="model_command",
                                                                                   required=True)
    init = model.add_parser("init", help="write the tiny random-weight model for tests and benchmarks (to DIR or the "
                            "cache), or a small random mixture-of-experts one (--arch qwen3-moe, to DIR)")
    init.add_argument("dir", nargs="?", type=Path)
    init.add_argument("--arch", choices=("llama", "qwen3-moe"), default="llama")
    pull = model.add_parser("pull", help="fetch and convert a model into the cache ahead of serving it (a .gguf "
                            "file, a Hub id; default: the default model); prints its checkpoint directory")
    pull.add_argument("model", nargs="?")
    pull.add_argument("--revision")

    keygen = commands.add_parser("keygen", help="write a new control-plane key to FILE (mode 0600), for "
                                 "--control-key-file on every host of a deployment (a compose secret)")
    keygen.add_argument("file", type=Path)


def _add_generate_command(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="generate offline on the engine (host drive mode)")
    gen.add_argument("prompt", nargs="*", help="prompts (default: three examples)")
    gen.add_argument("--model", help="a checkpoint directory, .gguf file or Hub id (default: the default model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--speculative-config",
                     help="speculative decoding (n-gram or a draft model), vLLM's JSON (as blink serve's flag)")


def _run(args: argparse.Namespace) -> int:
    """The commands that answer and exit; the rest are services, which run until stopped."""
    if args.command == "model":
        if args.model_command == "pull":
            return _model_pull(args.model, args.revision)
        return _model_init(args.dir, args.arch)
    if args.command == "keygen":
        return _keygen(args.file)
    if args.command == "generate":
        return _generate(args)
    if args.command == "probe":
        return _probe(args.service, settings_from_args(args))
    if args.command == "classes":
        return _classes(args)
    if args.command == "doctor":
        return _doctor(args.rdma_device, args.json)
    return _run_service(args)


def _doctor(rdma_device: str | None, as_json: bool) -> int:
    from blink.services import doctor

    found = doctor.check(rdma_device)
    print(json.dumps(doctor.as_dicts(found), indent=1) if as_json else doctor.report(found))
    return 0


def _run_service(args: argparse.Namespace) -> int:
    """engine, ingress or watchdog alone, else serve (all three); logs go to the service's name."""
    from blink.shared.logs import configure_logging

    configure_logging(args.command)
    settings = settings_from_args(args)
    if args.command == "engine":
        return _engine(settings)
    if args.command == "watchdog":
        from blink.services.watchdog import run_watchdog

        run_watchdog(settings)
    elif args.command == "ingress":
        from blink.services.ingress_service import run_ingress

        run_ingress(settings)
    else:
        return _serve(settings)
    return 0


def _engine(settings: Settings) -> int:
    from blink.services.engine_service import run_engine
    from blink.shared.checkpoints.errors import CheckpointError

    try:
        run_engine(settings)
    except CheckpointError as e:  # the model cannot be had or loaded: the reason, not a traceback
        print(f"blink engine: {e}", file=sys.stderr)
        return 1
    return 0


def _serve(settings: Settings) -> int:
    """Starts the engine, waits for its handshake, starts the ingress, then watches both (restarting what fails)
    until SIGTERM or ^C; then stops, in order, the watchdog, the ingress (which drains) and the engine."""
    import shutil

    from blink.services import listener
    from blink.services.ingress_service import handshake
    from blink.services.watchdog import ENGINE, INGRESS, ProcessSupervisor, Watchdog
    from blink.shared.slot_table import SlotTable
    from blink.shared.sockets import load_keys
    from blink.shared.stopping import StopFlag

    try:  # before the engine loads: a port in use is an error at once
        http_socket = listener.bind(settings.host, settings.port)
    except OSError as e:
        print(f"blink serve: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    keys = load_keys(settings, create=True)  # before the services start: they all read the one it makes
    supervisor = ProcessSupervisor(settings, http_socket)
    stop = StopFlag().install()
    engine = supervisor.start(ENGINE)
    try:
        try:
            handshake(settings, keys, timeout_s=settings.engine_start_timeout,
                      alive=lambda: engine.poll() is None and not stop.is_set())
        except RuntimeError as e:
            print(f"blink serve: {e} (its reason is above)", file=sys.stderr)
            return 1
        ingress = supervisor.start(INGRESS)
        port = http_socket.getsockname()[1]  # --port 0: the one the kernel chose
        print(f"blink serving at http://{settings.host}:{port}/v1 (engine pid {engine.pid}, ingress pid "
              f"{ingress.pid}, watchdog deadline {settings.watchdog_deadline} s)", flush=True)
        Watchdog(settings, supervisor).run(stop)
    finally:
        http_socket.close()  # the draining ingress's copy is the port's last: once it goes, clients are refused
        supervisor.stop(INGRESS, settings.shutdown_timeout + 5)
        supervisor.stop(ENGINE, 30)
        # An engine stopped while it was still starting never installed its handlers to remove the segment.
        SlotTable.path_for(settings.deployment).unlink(missing_ok=True)
        shutil.rmtree(settings.private_dir, ignore_errors=True)  # the sockets' files and the generated key
    return 0


def _probe(service: str, settings: Settings) -> int:
    from blink.shared import control
    from blink.shared.sockets import load_keys

    endpoint, ask = ((settings.control_endpoint, control.GetStatus()) if service == "engine" else
                     (settings.ingress_control_endpoint, control.Ping()))
    try:
        reply = control.request(endpoint, ask, load_keys(settings), timeout_s=settings.watchdog_deadline)
    except (TimeoutError, OSError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    print(reply.model_dump_json())
    healthy = isinstance(reply, control.IngressStatus) or (
        isinstance(reply, control.EngineStatus) and reply.state in ("ready", "draining"))
    return 0 if healthy else 1


def _classes(args: argparse.Namespace) -> int:
    """Reads the ingress's defaults, changes what the flags name, and sends them back whole."""
    from blink.shared import control
    from blink.shared.sockets import load_keys

    settings = settings_from_args(argparse.Namespace(**{k: v for k, v in vars(args).items()
                                               if k in ("deployment", "runtime_dir", "engine_host", "control_key",
                                                        "control_key_file")}))
    try:
        keys = load_keys(settings)
        reply = control.request(settings.ingress_control_endpoint, control.SetClassDefaults(), keys, timeout_s=2.0)
        if isinstance(reply, control.ClassDefaultsNow):
            change: dict = {"default_class": args.default_class}
            for prefix, name in (("ls", "latency_sensitive"), ("be", "best_effort")):
                slo = reply.defaults.slo(parse_class(prefix)).model_dump()
                for field in ("ttft_slo_ms", "tpot_slo_ms"):
                    if (value := getattr(args, f"{prefix}_{field}")) is not None:
                        slo[field] = float(value) or None
                change[name] = slo
            reply = control.request(settings.ingress_control_endpoint, control.SetClassDefaults.model_validate(change),
                                    keys, timeout_s=2.0)
    except (ValueError, TimeoutError, OSError) as e:
        print(e, file=sys.stderr)
        return 1
    print(reply.model_dump_json())
    return 0 if isinstance(reply, control.ClassDefaultsNow) else 1


def _keygen(target: Path) -> int:
    from blink.shared.sockets import write_key

    try:
        write_key(target)
    except FileExistsError:
        print(f"{target} exists: a key is never overwritten (remove it first)", file=sys.stderr)
        return 1
    print(target)
    return 0


def _model_pull(model: str | None, revision: str | None) -> int:
    from blink.engine.model.checkpoint import load_config
    from blink.shared.checkpoints.errors import CheckpointError
    from blink.shared.checkpoints.source import resolve

    try:
        print(resolve(model, revision=revision, check=load_config).path)
    except CheckpointError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


def _model_init(target: Path | None, arch: str) -> int:
    from blink.engine.model.tiny_model import tiny_model_dir, write_tiny_model

    if target is None and arch != "llama":
        print("blink model init --arch qwen3-moe needs DIR (the cache holds the tiny model)", file=sys.stderr)
        return 2
    print(write_tiny_model(target or tiny_model_dir(), arch))
    return 0


def _generate(args: argparse.Namespace) -> int:
    import logging

    from blink.engine import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model, device=args.device, dtype=args.dtype, speculative_config=args.speculative_config)
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
