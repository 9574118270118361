"""The ``atlaslab`` command line.

    atlaslab list [KIND] [--pattern GLOB]     registered parts by kind (one-line descriptions) and presets
    atlaslab show PRESET [key=value ...]      resolved config, parameter count and recurrent-state size
    atlaslab ui RUN_DIR [--port N]            the MLflow UI of a run folder's store, on 127.0.0.1
    atlaslab export-preset RUN_DIR [TRIAL]    a trial's model (the best by default) as a preset YAML

Subcommands are registered in :data:`COMMANDS`: a new one (``run``, ``resume``, ``report``, ``train``, ``demo``)
adds a function ``add_<name>(subparsers)`` that creates its parser and sets ``func`` via
``parser.set_defaults(func=...)``; the function returns the exit code. ``main(argv)`` returns it too.
Configuration errors print one line (``error: mixers.atlas.memory.inner_optimizer.name: …``) and exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

from omegaconf import OmegaConf

from atlaslab.registry import KINDS, ConfigError, get_registry


def _registered_kinds() -> List[str]:
    import atlaslab.models  # noqa: F401  (registers mixers and blocks)
    return list(KINDS) + ["preset"]


# --------------------------------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    from atlaslab.models.presets import list_presets, preset_description

    kinds = _registered_kinds()
    if args.kind and args.kind not in kinds:
        raise ConfigError("kind", f"unknown kind '{args.kind}'.", value=args.kind, choices=kinds)
    selected = [args.kind] if args.kind else kinds
    out = []
    for kind in selected:
        if kind == "preset":
            import fnmatch
            rows = [(n, preset_description(n)) for n in list_presets() if fnmatch.fnmatch(n, args.pattern)]
        else:
            reg = get_registry(kind)
            rows = [(e.name, e.description) for e in reg if e.name in reg.list(args.pattern)]
        if not rows and args.kind is None:
            continue
        out.append(f"{kind}:")
        width = max((len(n) for n, _ in rows), default=0)
        out.extend(f"  {n:<{width}}  {d}".rstrip() for n, d in rows)
    print("\n".join(out))
    return 0


def add_list(sub) -> None:
    p = sub.add_parser("list", help="list registered parts (by kind) and presets")
    p.add_argument("kind", nargs="?", default=None,
                   help="one kind: " + ", ".join(list(KINDS) + ["preset"]))
    p.add_argument("--pattern", default="*", help="shell-style wildcard on names (e.g. '*mlp*')")
    p.set_defaults(func=cmd_list)


# --------------------------------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    from atlaslab.models.presets import build_model, load_preset

    cfg = load_preset(args.preset, args.overrides)
    model = build_model(cfg)
    resolved = model.resolved
    print(f"# preset: {args.preset}" + (f"  overrides: {' '.join(args.overrides)}" if args.overrides else ""))
    print(OmegaConf.to_yaml(OmegaConf.create(resolved.to_dict())).rstrip())
    print("# ---")
    print(f"parameters: {model.num_parameters()}")
    print(f"parameters_non_embedding: {model.num_parameters(exclude_embeddings=True)}")
    fixed, per_token = model.state_size(), model.state_size_per_token()
    print(f"state_size: {fixed}")
    print(f"state_size_per_token: {per_token}")
    if args.context is not None:
        print(f"state_size_at_context: {model.state_size(args.context)}  # context = {args.context} tokens")
    print("state_size_by_layer:")
    for i, (key, mixer) in enumerate(zip(model.layer_keys, model.mixers())):
        print(f"  - layer {i} ({key}, {type(mixer).__name__}): {mixer.state_size()} "
              f"+ {mixer.state_size_per_token()}/token")
    return 0


def add_show(sub) -> None:
    p = sub.add_parser("show", help="resolved config, parameter count and state size of a preset")
    p.add_argument("preset", help="preset name (see `atlaslab list preset`) or a path to a preset YAML")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. d_model=128 mixers.atlas.num_heads=8")
    p.add_argument("--context", type=int, default=None,
                   help="also print the state size after this many context tokens (KV caches grow)")
    p.set_defaults(func=cmd_show)


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="recall capacity of several memories (a quick real demo of the parts)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of `python -m atlaslab.demo`")
    p.set_defaults(func=lambda a: __import__("atlaslab.demo", fromlist=["main"]).main(a.args))


def add_train(sub) -> None:
    from atlaslab.train.cli import add_train_parser

    add_train_parser(sub).set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """``atlaslab train``, logged to MLflow (the train floor's command with the search floor's tracker)."""
    from atlaslab.search.train_tracking import TrainTracker
    from atlaslab.train.cli import train_command

    return train_command(args, tracker_factory=TrainTracker)


def add_run(sub) -> None:
    from atlaslab.search.cli import add_run as _add

    _add(sub)


def add_resume(sub) -> None:
    from atlaslab.search.cli import add_resume as _add

    _add(sub)


def add_report(sub) -> None:
    from atlaslab.search.cli import add_report as _add

    _add(sub)


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write a trained trial (the best by default) as a Hugging Face model folder")
    p.add_argument("run_dir", help="the experiment's run folder")
    p.add_argument("trial", nargs="?", default=None, help="trial key (t000, ...); default: the best trial")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/export/<trial>)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log / register the best trial's model in MLflow")
    p.add_argument("--registered-name", default=None, help="MLflow registered model (default atlaslab-<experiment>)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from atlaslab.search.export import export_trial      # transformers (atlaslab[hf]) loads only here

    print(export_trial(args.run_dir, args.trial, args.out, mlflow=not args.no_mlflow,
                       registered_name=args.registered_name))
    return 0


def add_export_preset(sub) -> None:
    p = sub.add_parser("export-preset", help="write a trial's model (the best by default) as a preset YAML")
    p.add_argument("run_dir", help="the experiment's run folder")
    p.add_argument("trial", nargs="?", default=None, help="trial key (t000, ...); default: the best trial")
    p.add_argument("--name", default=None, help="the preset's name (default: the --out file's, else "
                   "<experiment>_<trial>)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, help="the YAML file to write (default RUN_DIR/export/<name>.yaml)")
    where.add_argument("--into-package", action="store_true",
                       help="write <name>.yaml into the preset folder (atlaslab/presets/, or $ATLASLAB_PRESETS), "
                       "where `atlaslab show NAME` and the model zoo find it")
    p.add_argument("--description", default=None, help="the preset's one-line description")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(func=cmd_export_preset)


def cmd_export_preset(args) -> int:
    from atlaslab.search.preset_export import export_preset       # torch and the search floor load only here

    print(export_preset(args.run_dir, args.trial, name=args.name, out=args.out, description=args.description,
                        into_package=args.into_package, force=args.force))
    return 0


def add_ui(sub) -> None:
    from atlaslab.search.ui import add_ui as _add

    _add(sub)


#: name → function adding the subcommand's parser; other modules append to this (run, resume, report, ...).
COMMANDS: Dict[str, Callable] = {"list": add_list, "show": add_show, "demo": add_demo, "train": add_train,
                                 "run": add_run, "resume": add_resume, "report": add_report, "ui": add_ui,
                                 "export": add_export, "export-preset": add_export_preset}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlaslab", description="Search and ablate test-time-memory models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in COMMANDS.values():
        add(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    # like `python -m`: a user's parts module in the current folder imports by its dotted name (``my_parts.x``)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides after an option (`atlaslab run EXP --dry-run train.steps=5`): argparse stops collecting a
    # positional list at the first option, so the dotlist pairs that follow it come back as unknown arguments
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides or []) + extra
    elif extra:
        parser.parse_args(argv)               # argparse's own error for what is really unknown
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
