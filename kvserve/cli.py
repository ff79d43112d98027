"""The ``kvserve`` command: serve, router, generate, chat, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kvserve
from kvserve.engine.worker import apply_engine_env

# Set before torch, and so OpenMP, loads: for in-process engines (generate, chat, bench offline) and
# the engine process `serve` spawns, which inherits them (not PASSIVE on every CPU: that kept an AMX
# CPU's engine from its spin count, c64 492 vs 649 output tok/s; docs/benchmarks.md).
apply_engine_env()

from kvserve.config import PARTS, KVServeConfig
from kvserve.errors import InvalidArgumentError, KVServeError
from kvserve.kernels.isa import chosen_level


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _sampling_params(a: argparse.Namespace):
    from kvserve import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                          seed=a.sampling_seed, stop=a.stop, ignore_eos=a.ignore_eos)


def _llm(a: argparse.Namespace):
    from kvserve.llm import LLM

    return LLM(**KVServeConfig.from_cli_args(a).to_kwargs())


def cmd_generate(a: argparse.Namespace) -> None:
    params = _sampling_params(a)
    llm = _llm(a)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")


CHAT_COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (the --system prompt stays)",
    "/exit": "leave (so do /quit and Ctrl-D)",
}


def cmd_chat(a: argparse.Namespace) -> None:
    params = _sampling_params(a)
    print(f"loading {a.model or 'the embedded model (SmolLM2-135M-Instruct)'} ...", file=sys.stderr, flush=True)
    llm = _llm(a)
    history: list[dict[str, str]] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print(f"kvserve chat on {llm.model_name}. /help lists commands; Ctrl-D or /exit to leave.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/help":
            print("\n".join(f"  {name:<7} {what}" for name, what in CHAT_COMMANDS.items()), file=sys.stderr)
            continue
        if command == "/reset":
            history = history[:1] if a.system else []
            print("(conversation reset)", file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command:  # a mistyped command is not a prompt
            print(f"unknown command {command}; /help lists them", file=sys.stderr)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        answer = []
        try:
            for out in llm.stream(llm.tokenizer.apply_chat_template(history), params):
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                answer.append(out.delta_text)
        except KeyboardInterrupt:
            pass  # stop this answer, keep the conversation
        except KVServeError as e:  # e.g. the conversation outgrew the context window
            print(f"\nerror: {e}", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(answer)})


def cmd_serve(a: argparse.Namespace) -> None:
    from kvserve.server.engine_client import AsyncEngineClient
    from kvserve.server.launch import serve

    config = KVServeConfig.from_cli_args(a, tuple(PARTS))
    srv = config.server
    logging.basicConfig(level=getattr(logging, srv.uvicorn_log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.ray:  # replicas on Ray Serve (docs/scale-out.md)
        from kvserve.ray_serve.launch import serve_on_ray
        from kvserve.ray_serve.options import from_args as ray_options

        if a.replicas != 1:
            raise InvalidArgumentError("--replicas starts local processes; with --ray, use --ray-replicas",
                                       param="replicas")
        serve_on_ray(config, ray_options(a), a.ray_address)
        return
    if a.replicas != 1:  # N engine processes behind the router (docs/scale-out.md)
        from kvserve.router.replicas import serve_replicas

        serve_replicas(config, a.replicas, a.router_policy, a.prefill_replicas)
        return
    if a.prefill_replicas:
        raise InvalidArgumentError("--prefill-replicas splits --replicas N: give N too", param="prefill_replicas")
    serve(lambda: AsyncEngineClient(config), srv)


def cmd_router(a: argparse.Namespace) -> None:
    from kvserve.router.config import from_args
    from kvserve.router.launch import run_router

    config = from_args(a)
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_router(config)


def cmd_bench_offline(a: argparse.Namespace) -> None:
    from kvserve.bench.offline import run

    run(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="A small LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    KVServeConfig.add_cli_args(s, tuple(PARTS))
    from kvserve.ray_serve.options import add_args as add_ray_args

    add_ray_args(s)

    from kvserve.router.policy import POLICIES

    rep = s.add_argument_group("replicas", "several engine processes behind the router (docs/scale-out.md)")
    rep.add_argument("--replicas", type=int, default=1,
                     help="start N replicas on 127.0.0.1 behind `kvserve router` on --host/--port; --num-threads, "
                          "--kv-cache-memory-gb, --num-kv-blocks and the offload sizes are totals divided among them "
                          "(default: %(default)s, one server)")
    rep.add_argument("--prefill-replicas", type=int, default=0,
                     help="with --replicas N: the first P are --role prefill, the rest --role decode, paired by the "
                          "router (disaggregated prefill; default: %(default)s, no split)")
    rep.add_argument("--router-policy", default="cache-aware", choices=POLICIES,
                     help="with --replicas: the router's --policy (default: %(default)s)")
    s.set_defaults(func=cmd_serve)

    from kvserve.router.config import add_args as add_router_args

    r = sub.add_parser("router", help="one OpenAI endpoint over several `kvserve serve` replicas, routing by "
                                      "their prefix caches (docs/scale-out.md)")
    add_router_args(r)
    r.set_defaults(func=cmd_router)

    g = sub.add_parser("generate", help="complete one prompt and print the answer as it streams")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _sampling_args(g)
    KVServeConfig.add_cli_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    _sampling_args(c)
    KVServeConfig.add_cli_args(c)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from kvserve.bench.offline import add_args

    off = bsub.add_parser("offline", help="in-process throughput on random prompts")
    add_args(off)
    off.set_defaults(func=cmd_bench_offline)

    from kvserve.bench import roofline as bench_roofline

    roof = bsub.add_parser("roofline", help="this machine's GEMM rate and memory bandwidth -> the model's decode ceilings")
    bench_roofline.add_args(roof)
    roof.set_defaults(func=lambda a: bench_roofline.run(a))

    from kvserve.bench import serve as bench_serve

    srv = bsub.add_parser("serve", help="load an OpenAI-compatible server with streaming requests")
    bench_serve.add_args(srv)
    srv.set_defaults(func=lambda a: bench_serve.run(a))

    from kvserve.bench import compare as bench_compare

    cmp = bsub.add_parser("compare", help="one serving workload against several servers in turn")
    bench_compare.add_args(cmp)
    cmp.set_defaults(func=lambda a: bench_compare.run(a))

    from kvserve.sim.cli import add_parsers as add_sim_parsers

    add_sim_parsers(sub)

    tbl = bsub.add_parser("table", help="side-by-side markdown of saved results (name=FILE.json ...)")
    tbl.add_argument("results", nargs="+", help="name=path pairs of --save-result files")
    tbl.set_defaults(func=lambda a: print(bench_compare.table(a.results)))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        chosen_level()  # an impossible KVSERVE_CPU_ISA is refused before anything starts
        args.func(args)
    except KVServeError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
