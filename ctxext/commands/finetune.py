"""`ctxext finetune RECIPE.yaml`: LoRA fine-tune a patched model from a YAML recipe."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="LoRA fine-tune a patched model from a YAML recipe (see recipes/)",
        description="Run a fine-tune recipe: load -> patch -> LoRA -> train -> save adapter + patch spec, with a "
        "before/after perplexity. Several processes: `accelerate launch -m ctxext finetune ...` or "
        "`torchrun --nproc_per_node N -m ctxext finetune ...`.",
    )
    p.add_argument("recipe", help="recipe YAML file (e.g. recipes/tiny/llama_pi_lora.yaml); relative data paths in it "
                   "are read from its folder, output.dir from the working directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, value read as YAML (repeatable): --set train.steps=50; "
                   "paths given here are relative to the working directory")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop (with a checkpoint) after N optimizer steps in this invocation; continue with --resume")
    p.add_argument("--check", action="store_true",
                   help="validate the recipe, its data, the patch/LoRA fit and that output.dir can be written, "
                   "without loading weights or training")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved recipe (defaults filled in) and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..finetune import check, load_recipe
    from ..finetune.outdir import check_output_folder
    from ..finetune import run as run_recipe

    # argument checks first: nothing is read, loaded or written for a bad command line
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after must be >= 1 (optimizer steps in this invocation), got {args.stop_after}")
    if args.check and args.print_recipe:
        raise ValueError("--check and --print-recipe: give one of them")
    if args.resume and (args.check or args.print_recipe):
        raise ValueError("--resume runs a recipe; it does not go with --check or --print-recipe")
    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_recipe:
        print(recipe.to_yaml(), end="")
        return 0
    if args.check:
        result = check(recipe)
        check_output_folder(recipe)  # what a run would meet there: a finished run, checkpoints, someone's files
        print(json.dumps({"recipe": args.recipe, "ok": True, **result}, indent=2))
        return 0
    summary = run_recipe(recipe, resume=args.resume, stop_after=args.stop_after, progress=not args.no_progress)
    return 0 if summary.get("finished") or args.stop_after else 1
