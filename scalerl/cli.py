"""`scalerl <command>`: the command-line entry point (also `python -m scalerl`, which torchrun needs).

Commands that run something import their module inside the command (plain imports, no string paths), so
`scalerl --help` and `scalerl config` stay fast (no torch) and a missing optional piece fails only the
command that needs it. The trainers' entries (`train`, `train_sft`) check the config against the files
it names themselves; `scalerl config`, which runs nothing, checks it here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalerl import __version__
from scalerl.core.config import (
    GREEDY_BELOW_TEMPERATURE,
    ConfigError,
    config_to_dict,
    config_to_yaml,
    describe_keys,
    format_config,
    load_config,
    split_config_args,
)
from scalerl.core.errors import RunFailure, UserError

OVERRIDE_HELP = """\
configuration:
  A run is configured by defaults <- CONFIG.yaml <- key=value overrides (later wins).
  Overrides use dotted keys and YAML values:
    actor.lr=1e-6  rollout.n=8  model.path=null  trainer.logger=[console,tensorboard]
  A list can also be written comma-separated: trainer.logger=console,tensorboard
  Every key, with its type, default and meaning: scalerl config --keys
  Check a config without running anything:   scalerl config CONFIG.yaml key=value ...
"""

MAIN_EPILOG = OVERRIDE_HELP + """
examples:
  scalerl demo                                     # tiny GRPO run on the built-in arithmetic task (CPU)
  scalerl train run.yaml actor.lr=1e-6 rollout.n=8
  scalerl sft run.yaml sft.steps=500
  torchrun --nproc-per-node 8 -m scalerl train run.yaml
  scalerl generate --model outputs/run/final --prompt "12+30="
  scalerl export outputs/run/checkpoints/step_00000100 exported/
  scalerl version
  scalerl doctor --distributed-check              # also under torchrun / srun / --ray, on every rank
  scalerl bench --nodes 1,2,4 && scalerl report benchmark_report.json -o performance_analysis.pdf
"""


DEMO_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def _is_main_rank() -> bool:
    """Under torchrun, srun or mpirun every rank runs this CLI; only rank 0 should print the config."""
    try:
        from scalerl.core.rank_env import detect_rank_env

        env = detect_rank_env()
    except Exception:  # a broken launcher environment is reported by the trainer, with its own message
        return os.environ.get("RANK", "0") == "0"
    return env is None or env.rank == 0


def _load_run_config(args: argparse.Namespace, show: bool = True, default_path: Path | None = None) -> Any:
    """The config the arguments describe (validated as it is read); if `show`, the main rank prints the
    start banner (`start_banner`), or with --print-config the whole resolved config."""
    if getattr(args, "from_verl", False):
        return _load_verl_config(args, show)
    path, overrides = split_config_args(args.config_args)
    path = path or default_path
    try:
        cfg = load_config(path, overrides)
    except FileNotFoundError as e:  # a missing config file is a user error, not a crash
        raise ConfigError(str(e)) from None
    if show and _is_main_rank():
        _show_config(args, cfg)
    return cfg


def _load_verl_config(args: argparse.Namespace, show: bool) -> Any:
    """`--from-verl <verl overrides> [-- <scalerl overrides>]`: the translation table, then the config."""
    from scalerl.core.verl_overrides import load_verl_config

    cfg, translation = load_verl_config(args.config_args, getattr(args, "scalerl_overrides", []))
    if _is_main_rank():
        print(translation.table(), flush=True)
        if show:
            _show_config(args, cfg)
    return cfg


def _show_config(args: argparse.Namespace, cfg: Any) -> None:
    print(format_config(cfg) if getattr(args, "print_config", False) else start_banner(cfg, args.command), flush=True)


def start_banner(cfg: Any, command: str) -> str:
    """What a run starts with, in a few lines: model, data, layout, engine, precision, the keys set away from
    their defaults, and where the whole resolved config is written (--print-config prints it here)."""
    from scalerl.core.config import Config

    m, d, t, p = cfg.model, cfg.data, cfg.trainer, cfg.parallel
    model = t.init_from or m.path or (f"built-in (hidden_size={m.hidden_size}, "
                                      f"num_hidden_layers={m.num_hidden_layers})")
    data = f"{', '.join(d.train_files)} (data.format={d.format})" if d.train_files \
        else f"the built-in {d.task} task ({d.num_train} rows)"
    dims = [f"{k}={getattr(p, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "sp", "ep")
            if getattr(p, k, 1) not in (1, -1)]
    world = os.environ.get("WORLD_SIZE", "1")
    layout = f"{world} rank{'s' if world != '1' else ''}" + (f", parallel.{', parallel.'.join(dims)}" if dims else "")
    output = Path(cfg.sft.output_dir or Path(t.output_dir) / "sft") if command == "sft" else Path(t.output_dir)
    changed = _changed_keys(config_to_dict(cfg), config_to_dict(Config()))
    lines = [f"scalerl {command}",
             f"  model:     {model}",
             f"  data:      {data}; reward {d.reward}",
             f"  layout:    {layout}",
             *([f"  engine:    rollout.engine={cfg.rollout.engine}"] if command != "sft" else []),
             f"  precision: trainer.precision={t.precision}",
             f"  changed:   {' '.join(changed) if changed else 'nothing (every key at its default)'}",
             f"  config:    {output / 'config.yaml'} (every key; --print-config prints it here)"]
    return "\n".join(lines)


def _changed_keys(values: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[str]:
    """``key=value`` for each leaf of ``values`` that differs from ``defaults``, in the config's order."""
    changed = []
    for key, value in values.items():
        if isinstance(value, dict):
            changed += _changed_keys(value, defaults.get(key, {}), f"{prefix}{key}.")
        elif value != defaults.get(key):
            shown = json.dumps(value) if not isinstance(value, str) else value
            changed.append(f"{prefix}{key}={shown}")
    return changed


def _split_from_verl(argv: list[str]) -> tuple[list[str], list[str]]:
    """With --from-verl, what follows the first '--' after it is scalerl overrides (argparse would drop '--')."""
    if "--from-verl" in argv and "--" in argv[argv.index("--from-verl"):]:
        i = argv.index("--", argv.index("--from-verl"))
        return argv[:i], argv[i + 1:]
    return argv, []


def cmd_train(args: argparse.Namespace) -> int:
    from scalerl.trainer.rl_trainer import train

    _say_trained_model(train(_load_run_config(args)))
    _leave_process_group()
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from scalerl.trainer.sft_trainer import train_sft

    _say_trained_model(train_sft(_load_run_config(args)))
    _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """The process group this command's run joined (torchrun, srun, ...), closed before the interpreter exits:
    left to the interpreter's teardown, gloo's threads were once destroyed while joinable ("terminate called
    without an active exception", SIGABRT on a rank whose run had finished)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _say_trained_model(summary: dict[str, Any]) -> None:
    """A run's last line: where its trained model is (what model.path or trainer.init_from can name)."""
    if isinstance(summary, dict) and summary.get("trained_model") and _is_main_rank():
        print(f"trained model: {summary['trained_model']} (start from it with trainer.init_from, sample with "
              f"scalerl generate --model)", flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from scalerl.demo import run_demo

    # The demo's own defaults (scalerl/configs/demo.yaml) sit under the user's overrides.
    run_demo(_load_run_config(args, show=False, default_path=DEMO_CONFIG))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        print(describe_keys())
        return 0
    # Light: torch is imported only when a model directory is named.
    from scalerl.trainer.run_checks import check_run_inputs

    cfg = _load_run_config(args, show=False)  # --from-verl: prints the translation table first
    check_run_inputs(cfg)  # what `train` or `sft` would check before any work (both trainers' outputs)
    print(config_to_yaml(cfg), end="")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0 or args.max_new_tokens < 1:
        raise ConfigError("--top-k must be >= 0 and --max-new-tokens >= 1")
    if args.model != "builtin" and not Path(args.model).is_dir():
        raise ConfigError(f"--model {args.model!r}: no such directory (a Hugging Face model directory or 'builtin')")
    from scalerl.rollout.text import generate_text

    completions = generate_text(args.model, args.prompt, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for i, (prompt, completion) in enumerate(zip(args.prompt, completions)):
        print(f"--- sample {i} ---")
        print(f"{prompt}{completion}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    target = Path(args.hf_dir)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"HF_DIR {target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not args.overwrite:
        raise ConfigError(f"HF_DIR {target} is not empty: pass --overwrite to replace it, or choose another directory")
    from scalerl.checkpoint.export import export_checkpoint, find_checkpoint

    checkpoint = find_checkpoint(args.checkpoint)
    export_checkpoint(checkpoint, target, merge=args.merge)
    print(f"exported {checkpoint} to {target}")
    return 0


def _installed_version(package: str) -> str | None:
    """Version from package metadata, without importing (importing vllm takes seconds)."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return getattr(importlib.import_module(package), "__version__", "unknown")


def cmd_version(args: argparse.Namespace) -> int:
    import torch

    print(f"scalerl: {__version__}")
    print(f"python: {platform.python_version()} ({sys.executable})")
    print(f"torch: {torch.__version__}")
    for package in ("ray", "transformers"):
        version = _installed_version(package)
        print(f"{package}: {version if version else 'not installed'}")
    from scalerl.perf.precision import CPU_BF16_FLAGS, cpu_bf16_features

    features = cpu_bf16_features()
    print(f"CPU bf16: {', '.join(features) if features else 'none'} (of {', '.join(CPU_BF16_FLAGS)} in /proc/cpuinfo)")

    from scalerl.rollout.engines.vllm import vllm_build

    build = vllm_build()
    print("vllm: " + ("not installed" if build is None else
                      f"{build['version']} ({build['device']} build; torchvision: {build['torchvision']})"))
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "n/a"
        print(f"CUDA: {torch.version.cuda}")
        print(f"NCCL: {nccl}")
        print(f"GPUs: {torch.cuda.device_count()}")
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}")
    else:
        print("CUDA: not available")
        print("GPUs: 0")
    return 0


def _add_config_args(parser: argparse.ArgumentParser, extra_usage: str = "") -> None:
    parser.usage = f"%(prog)s [-h]{extra_usage} [CONFIG.yaml] [key=value ...]"
    parser.add_argument("config_args", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="optional YAML config file first, then dotted key=value overrides")


def _add_print_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--print-config", action="store_true",
                        help="print the whole resolved config at start instead of the short banner (it is "
                             "written to the output directory's config.yaml either way)")


def _add_from_verl_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-verl", action="store_true",
                        help="the arguments are a verl command line's Hydra overrides (verl's key names), "
                             "translated key by key (the table is printed); scalerl overrides may follow "
                             "a '--': --from-verl data.train_batch_size=64 ... -- model.path=null")


def cmd_verify(args: argparse.Namespace) -> int:
    from scalerl.trainer.run_checks import output_dir_problems
    from scalerl.verify import LAYOUTS, MOE_LAYOUTS, format_rows, run_verification

    worlds = tuple(args.world or (2, 4))
    known = sorted({name for world in worlds for name in [*LAYOUTS[world], *MOE_LAYOUTS.get(world, {})]})
    unknown = [name for name in args.layout or [] if name not in known]
    if unknown:  # checked before the single-process reference runs, not after
        raise ConfigError(f"--layout {', '.join(unknown)}: not a layout of world {'/'.join(map(str, worlds))}; "
                          f"choose from {', '.join(known)}")
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    problems = output_dir_problems(args.output_dir, "--output-dir")
    if problems:
        raise ConfigError(problems[0])
    rows = run_verification(
        args.output_dir, worlds=tuple(args.world or (2, 4)), steps=args.steps,
        kinds=tuple(args.kind or ("grpo", "sft")), layouts=args.layout,
    )
    print(format_rows(rows))
    if not rows:
        print("error: no layout matched --world/--layout", file=sys.stderr)
        return 2
    return 0 if all(r.passed for r in rows) else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from scalerl.doctor.cli import run_doctor

    return run_doctor(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from scalerl.bench.cli import run_bench_command

    return run_bench_command(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from scalerl.plan.cli import run_plan_command

    return run_plan_command(args)


def cmd_serve_rollouts(args: argparse.Namespace) -> int:
    from scalerl.rollout.agent.endpoint import serve_rollouts_main

    return serve_rollouts_main(getattr(args, "serve_args", []))


def cmd_report(args: argparse.Namespace) -> int:
    from scalerl.report.cli import run_report_command

    return run_report_command(args)


def add_launch_parser(sub) -> None:
    """`scalerl launch slurm|ray` lives with the launchers; absent pieces only disable that command."""
    try:
        from scalerl.launch.cli import add_launch_parser as add_launch
    except ImportError:
        return
    add_launch(sub)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser; each subcommand sets `func`."""
    from scalerl.verify import describe_layouts  # cheap: no torch
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="scalerl", formatter_class=formatter, epilog=MAIN_EPILOG,
        description="Reinforcement-learning post-training of language models (GRPO, PPO, SFT).")
    parser.add_argument("-V", "--version", action="version", version=f"scalerl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], summary: str, epilog: str = "") -> Any:
        p = sub.add_parser(name, help=summary, description=summary, epilog=epilog, formatter_class=formatter)
        p.set_defaults(func=func)
        return p

    train = add("train", cmd_train, "RL training (GRPO, or PPO with algorithm.adv_estimator=gae)",
                OVERRIDE_HELP + "\nexamples:\n  scalerl train run.yaml actor.lr=1e-6 rollout.n=8\n"
                "  torchrun --nproc-per-node 8 -m scalerl train run.yaml trainer.resume=auto\n"
                "  scalerl train --from-verl algorithm.adv_estimator=grpo data.train_files=train.parquet ...\n")
    _add_config_args(train, " [--from-verl] [--print-config]")
    _add_from_verl_arg(train)
    _add_print_config_arg(train)
    sft = add("sft", cmd_sft, "supervised fine-tuning (uses the data.* and sft.* keys)",
              OVERRIDE_HELP + "\nexamples:\n  scalerl sft run.yaml sft.steps=500 sft.lr=1e-4\n")
    _add_config_args(sft, " [--print-config]")
    _add_print_config_arg(sft)
    demo = add("demo", cmd_demo, "small end-to-end run on the built-in model and task (CPU friendly)",
               OVERRIDE_HELP + "\nexamples:\n  scalerl demo\n  scalerl demo trainer.total_steps=50\n"
               "  scalerl demo --agent\n")
    _add_config_args(demo, " [--agent]")

    def cmd_demo_agent(args: argparse.Namespace) -> int:  # `demo --agent`: the tool task (scalerl/demo.py)
        from scalerl.demo import AGENT_DEMO_CONFIG, run_agent_demo

        run_agent_demo(_load_run_config(args, show=False, default_path=AGENT_DEMO_CONFIG))
        return 0

    demo.add_argument("--agent", dest="func", action="store_const", const=cmd_demo_agent, default=cmd_demo,
                      help="the tool task instead: SFT on tool-use demonstrations, then GRPO with the tool "
                           "environment (defaults: scalerl/configs/demo_agent.yaml; docs/rollout.md)")
    config = add("config", cmd_config, "print the resolved config as YAML (checks a config and overrides)",
                 OVERRIDE_HELP + "\nexamples:\n  scalerl config run.yaml actor.lr=1e-6\n  scalerl config --keys\n")
    _add_config_args(config, " [--keys] [--from-verl]")
    _add_from_verl_arg(config)
    config.add_argument("--keys", action="store_true", help="list every key with its type, default and meaning")

    gen = add("generate", cmd_generate, "sample completions from a model for quick inspection",
              "examples:\n  scalerl generate --model outputs/run/final --prompt '12+30=' --prompt '7*6='\n"
              "  scalerl generate --model builtin --prompt hello --temperature 0.8 --top-p 0.9\n")
    gen.add_argument("--model", required=True, metavar="PATH|builtin",
                     help="model directory (Hugging Face layout or a scalerl checkpoint), or 'builtin'")
    gen.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                     help="prompt text; repeat for several prompts")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help=f"sampling temperature; 0 (or below {GREEDY_BELOW_TEMPERATURE:g}) = greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens; 0 = off")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")

    export = add("export", cmd_export, "write a checkpoint's model as a Hugging Face directory",
                 "CHECKPOINT is a checkpoint directory (step_*), a checkpoints/ folder or a run's output directory\n"
                 "(the latest complete checkpoint in it); single-process or distributed, any layout, RL or SFT.\n"
                 "Every file is checked against the checkpoint's meta.json before it is read. HF_DIR loads with\n"
                 "transformers' AutoModelForCausalLM.from_pretrained and with scalerl (model.path=HF_DIR).\n"
                 "examples:\n  scalerl export outputs/run/checkpoints/step_00000100 exported/\n"
                 "  scalerl export outputs/run exported/ --overwrite\n")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint, checkpoints/ folder or run directory")
    export.add_argument("hf_dir", metavar="HF_DIR", help="where to write the Hugging Face directory")
    export.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it is not empty")
    export.add_argument("--merge", action="store_true", help="a LoRA run: write the base with its adapters merged "
                        "(a plain model) instead of the PEFT adapter directory")

    verify = add("verify", cmd_verify, "check that distributed layouts reproduce the single-process run",
                 "Runs K GRPO and SFT steps single-process and under each layout (gloo on CPU, fixed seed, identical\n"
                 "global batches) and compares per-step losses and final weights (relative tolerance 1e-4).\n"
                 f"layouts:\n{describe_layouts()}\n"
                 "examples:\n  scalerl verify distributed-vs-single\n"
                 "  scalerl verify distributed-vs-single --world 2 --layout fsdp --steps 5\n")
    verify.add_argument("check", choices=["distributed-vs-single"], help="what to verify")
    verify.add_argument("--world", type=int, action="append", choices=[2, 4], metavar="N",
                        help="world size to check (2 and/or 4; default both)")
    verify.add_argument("--layout", action="append", metavar="NAME", help="only these layouts (default all)")
    verify.add_argument("--kind", action="append", choices=["grpo", "sft", "ppo"],
                        help="trainers to check (default grpo and sft; ppo = GAE with a critic)")
    verify.add_argument("--steps", type=int, default=3, metavar="K", help="training steps per run (default 3)")
    verify.add_argument("--output-dir", default="outputs/verify", metavar="DIR", help="where runs are written")

    add("version", cmd_version, "print versions of scalerl, python, torch, optional packages, CUDA and NCCL")
    # Its options are the endpoint module's own (`scalerl serve-rollouts --help`), parsed there: that module
    # imports torch, which building this parser must not.
    serve = sub.add_parser("serve-rollouts", add_help=False, help="serve a model as an OpenAI-compatible endpoint "
                           "that records the token ids of each session (agent programs; docs/agent-endpoint.md)")
    serve.set_defaults(func=cmd_serve_rollouts)
    from scalerl.doctor.cli import EPILOG as DOCTOR_EPILOG  # cheap: no torch
    from scalerl.doctor.cli import add_doctor_arguments

    add_doctor_arguments(add("doctor", cmd_doctor, "diagnose a distributed run: where on the troubleshooting tree "
                             "its problems are, with evidence and fixes", DOCTOR_EPILOG))
    from scalerl.bench.cli import EPILOG as BENCH_EPILOG  # cheap: no torch
    from scalerl.bench.cli import add_bench_arguments

    add_bench_arguments(add("bench", cmd_bench, "measure a matrix of layouts (throughput, latency, bytes, MFU) into "
                            "benchmark_report.json; --compare two reports; --project to N nodes", BENCH_EPILOG))
    from scalerl.plan import EPILOG as PLAN_EPILOG  # cheap: no torch
    from scalerl.plan import add_plan_arguments

    add_plan_arguments(add("plan", cmd_plan, "predict a run's time and memory per rank and phase before it starts, "
                           "name the first phase that would not fit with its fix, recommend a layout", PLAN_EPILOG))
    from scalerl.report.cli import EPILOG as REPORT_EPILOG
    from scalerl.report.cli import add_report_arguments

    add_report_arguments(add("report", cmd_report, "render a benchmark report as a PDF or self-contained HTML "
                             "file (findings, recommended configuration, figures)", REPORT_EPILOG))
    add_launch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the command; returns the exit code.

    Bad input (`UserError`: config, data, model files, layout, launcher environment) prints `error: ...` and
    returns 2; a run that cannot go on (`RunFailure`: a lost or frozen rank, repeated skipped steps) prints
    `error: ...` and returns 1; a run stopped by SIGINT or SIGTERM (`RunStopped`) prints its one line and
    returns 130 or 143. None shows a traceback: the message names the cause and the fix. A closed stdout
    (`scalerl config --keys | head`) ends the command quietly."""
    try:
        return _run(argv)
    except BrokenPipeError:  # `scalerl ... | head`: the reader left; say nothing more to it
        _quiet_stdout()
        return 0


def _run(argv: list[str] | None) -> int:
    """`main` without its closed-pipe handling: parse, run, report the errors a user can act on."""
    parser = build_parser()
    argv, scalerl_overrides = _split_from_verl(sys.argv[1:] if argv is None else list(argv))
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:  # --help, --version, a usage error: flushed here, where a closed pipe is caught
        sys.stdout.flush()
        raise
    args.scalerl_overrides = scalerl_overrides
    if extra and getattr(args, "command", None) in ("doctor", "launch") and all(
            "=" in e and not e.startswith("-") or e.endswith((".yaml", ".yml")) for e in extra):
        args.config_args += extra  # `doctor --performance-profiling run.yaml --steps 5 parallel.tp=2`
    elif getattr(args, "command", None) == "serve-rollouts":
        args.serve_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return code
    except (UserError, RunFailure) as e:  # a stopped run (Ctrl-C, SIGTERM) says its line without "error:",
        prefix = getattr(e, "prefix", "error: ")  # once: every rank stopped at the same step
        if prefix or _is_main_rank():
            print(f"{prefix}{e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:  # before the training loop (which stops between steps) or a second Ctrl-C
        print("interrupted: stopped at once, nothing saved by this run", file=sys.stderr, flush=True)
        return 130


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so flushing it at exit does not raise a second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (a test's capture): nothing left to flush
        pass
    finally:
        os.close(devnull)
