"""`ctxext lab`: tiny decoders that differ only in position encoding, trained from scratch and evaluated at
1x-8x their training length; `ctxext lab shift`: the start-offset probe; `ctxext lab copy`: the encoder copy task of
the write-up the lab starts from (see ctxext.lab)."""

from __future__ import annotations

import dataclasses
import os


def register(sub) -> None:
    p = sub.add_parser("lab", help="reproduce the textbook position-encoding claims on tiny decoders trained from scratch")
    p.add_argument("probe", nargs="?", choices=["shift", "copy"],
                   help="'shift': the start-offset probe instead of the lab; 'copy': the encoder copy task (tiny "
                        "bidirectional encoders, several seeds per scheme)")
    p.add_argument("--quick", action="store_true", help="small settings (<= 5 minutes on 2 CPU cores)")
    p.add_argument("--schemes", default=None, help="comma-separated: sinusoidal,learned,rope,alibi,nope,t5 (copy: "
                   "sinusoidal,learned,rope,alibi,alibi-causal,nope)")
    p.add_argument("--seeds", type=int, default=None, help="copy: seeds per scheme (default 3)")
    p.add_argument("--steps", type=int, default=None, help="training steps per scheme")
    p.add_argument("--out", default="results/lab", help="output folder (default results/lab)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG figure")
    p.add_argument("--overwrite", action="store_true", help="replace a finished result in --out")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: these matmuls are tiny, and on shared cores two threads measured "
                        "3-5x slower than one)")
    p.add_argument("--jobs", type=int, default=None,
                   help="schemes trained at once, each in its own process with --threads threads (default: 2 where "
                        "the machine has 2 or more cores, else 1; the numbers do not depend on it)")
    p.add_argument("--offsets", default=None, help="shift: comma-separated start offsets (default 0,16,32,64,T-W)")
    p.add_argument("--window", type=int, default=None, help="shift: window length W (default training length / 8)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..lab.run import FULL, QUICK, format_table, parse_schemes, run_lab
    from ..lab.shift import format_shift, parse_offsets, run_shift

    args.out = os.path.expanduser(args.out)  # as finetune's output.dir: "~/x" is the home folder's, never ./~
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")
    if not 1 <= args.threads <= 1024:  # torch allocates per thread: a typo's 100000 ends in a MemoryError
        raise ValueError(f"--threads must be between 1 and 1024, got {args.threads}")
    if args.jobs is not None and not 1 <= args.jobs <= 64:
        raise ValueError(f"--jobs must be between 1 and 64, got {args.jobs}")
    if args.jobs is not None and args.probe is not None:
        raise ValueError(f"--jobs goes with the lab itself, not 'ctxext lab {args.probe}'")
    if args.probe != "shift" and (args.offsets is not None or args.window is not None):
        raise ValueError("--offsets and --window go with 'ctxext lab shift'")
    if args.probe != "copy" and args.seeds is not None:
        raise ValueError("--seeds goes with 'ctxext lab copy'")
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds must be a positive integer, got {args.seeds}")
    if args.probe == "copy":
        return _copy(args)
    if args.schemes is not None:
        parse_schemes(args.schemes)
    offsets = parse_offsets(args.offsets)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.probe == "shift":
            doc = run_shift(args.out, quick=args.quick, schemes=args.schemes, offsets=offsets, window=args.window,
                            steps=args.steps, overwrite=args.overwrite, plot=not args.no_plot)
            print(format_shift(doc))
            print()
            print("\n".join(doc["verdicts"]))
            return 0
        settings = QUICK if args.quick else FULL
        if args.steps is not None:
            settings = dataclasses.replace(settings, steps=args.steps)
        jobs = args.jobs if args.jobs is not None else min(2, os.cpu_count() or 1)
        doc = run_lab(settings, parse_schemes(args.schemes), args.out, overwrite=args.overwrite,
                      plot=not args.no_plot, jobs=jobs)
    finally:
        torch.set_num_threads(threads)
    print(format_table(doc))
    print()
    print("\n".join(doc["verdicts"]))
    return 0


def _copy(args) -> int:
    import torch

    from ..lab.copytask import FULL, QUICK, format_copy, parse_copy_schemes, run_copy

    schemes = parse_copy_schemes(args.schemes)
    settings = QUICK if args.quick else FULL
    if args.steps is not None:
        settings = dataclasses.replace(settings, steps=args.steps)
    if args.seeds is not None:
        settings = dataclasses.replace(settings, seeds=args.seeds)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        doc = run_copy(settings, schemes, args.out, overwrite=args.overwrite, plot=not args.no_plot)
    finally:
        torch.set_num_threads(threads)
    print(format_copy(doc))
    print()
    print("\n".join(doc["verdicts"]))
    return 0
