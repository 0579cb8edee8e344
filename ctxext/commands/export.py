"""`ctxext export`: a patched model written as a plain transformers checkpoint (``ctxext.export``).

    ctxext export MODEL --method yarn --factor 4 --out DIR [--option beta_fast=16] [--gguf-file F] [--overwrite]

MODEL is a hub id, a local folder (with ``--gguf-file``: a GGUF file in it) or ``reference:NAME`` (a shipped
reference model). Every argument, the source, the method x model fit and the existence of a native form are checked
on the model's skeleton (no weights) before anything loads or is written; the folder is written beside ``--out``
and renamed into place when complete.
"""

from __future__ import annotations

import sys
from pathlib import Path



def register(sub) -> None:
    from .eval import _factor

    p = sub.add_parser(
        "export", help="write a patched model as a plain transformers checkpoint (native rope config / weights)",
        description="Patch MODEL and save it in the transformers-native form of the patch (rope type linear, yarn, "
        "llama3, dynamic; a new rope_theta; GPT-2's resized position table), so AutoModelForCausalLM.from_pretrained "
        "and serving engines that read config.json load the same model. Methods with no native form are refused.")
    p.add_argument("model", metavar="MODEL",
                   help="hub id, local folder (holding --gguf-file), or reference:NAME (llama, gpt2, bloom)")
    p.add_argument("--gguf-file", help="GGUF file name inside MODEL")
    p.add_argument("--method", required=True, help="patch method (see `ctxext methods`)")
    p.add_argument("--factor", type=_factor, help="context extension factor (a number >= 1)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="method option; repeatable")
    p.add_argument("--out", required=True, help="folder to write (refused if it exists, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument("--dtype", default="auto", help="dtype of the saved weights: auto (as loaded, default), "
                   "float32, bfloat16 or float16")
    p.set_defaults(func=run_export)


def _options(method: str, pairs: list[str] | None) -> dict[str, str]:
    from ..evaluation.requests import parse_options

    parsed = parse_options(pairs)
    stray = sorted(m for m in parsed if m not in (None, method))
    if stray:
        raise ValueError(f"--option for method {stray[0]!r}, but --method is {method!r}")
    return {**parsed.get(None, {}), **parsed.get(method, {})}


def _check_out(out: Path, source: str, overwrite: bool) -> None:
    from ..export import is_export_folder
    from ..core.outputs import check_replaceable_folder, check_writable_folder, never_replaced

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder")
    if out.is_symlink():  # ctxext writes a folder it can later replace whole; a link's target is not its to replace
        raise ValueError(f"--out {out} is a link; ctxext replaces only folders it wrote: give a new folder")
    check_writable_folder(out, "--out")  # a file on the way: said before the weights load
    reason = never_replaced(out) if overwrite else None
    if reason:  # said before the check below, which every folder holding the model (/ included) would meet first
        raise ValueError(f"--out {out} is {reason}; ctxext never replaces it: give a new folder")
    source_path = Path(source).expanduser()
    if source_path.exists() and out.resolve() in (source_path.resolve(), *source_path.resolve().parents):
        raise ValueError(f"--out {out} would overwrite the model it exports ({source}); choose another folder")
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; pass --overwrite to replace it")
    if overwrite:
        check_replaceable_folder(out, "--out", is_ours=is_export_folder, inputs=(source,), what="a ctxext export")


def prepare(args):
    """Every check, on the model's skeleton: returns (source, method, factor, options, dtype). Loads no weights,
    writes nothing."""
    from ..api import build_spec, patch
    from ..core.errors import PatchError
    from ..evaluation.device import resolve_dtype
    from ..export import NoNativeForm, native_form
    from ..loading import model_skeleton
    from ..methods.registry import resolve_method, validate_factor, validate_options
    from ..data.sources import check_source
    from ..reference import model_source

    source = model_source(args.model)
    info = resolve_method(args.method)
    factor = validate_factor(info, args.factor)
    options = validate_options(info, _options(info.name, args.option))
    dtype = "auto" if args.dtype == "auto" else resolve_dtype(args.dtype)
    _check_out(Path(args.out), source, args.overwrite)
    check_source(source, gguf_file=args.gguf_file, what="MODEL")
    skeleton = model_skeleton(source, gguf_file=args.gguf_file)
    spec, adapter = build_spec(skeleton, info.name, factor, **options)
    try:
        if adapter.native_form_needs_patch:  # verified on the patched model (real buffers: rotary frequencies)
            patch(skeleton, info.name, factor, **options)
            native_form(skeleton)
        else:  # the weights are not loaded yet: whether a form exists is known from the method
            native_form(skeleton, spec, check_only=True)
    except NoNativeForm as exc:
        raise PatchError(f"cannot export natively: {exc}. model.save_pretrained after ctxext.patch writes a "
                         "checkpoint that only ctxext.from_pretrained loads") from None
    return source, info.name, factor, options, dtype


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer(source: str, gguf_file: str | None):
    """The source's tokenizer, to save beside the export; None (with a note) where it has none or it cannot be
    read: the model is what is exported, the tokenizer is a convenience."""
    from ..evaluation.models import load_tokenizer

    folder = Path(source).expanduser()
    if folder.is_dir() and not gguf_file and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        print(f"ctxext export: note: {source} has no tokenizer; none saved", file=sys.stderr)
        return None
    try:
        return load_tokenizer(source, gguf_file=gguf_file)
    except Exception as exc:  # noqa: BLE001 - any failure: export the model without it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"ctxext export: note: no tokenizer saved ({first})", file=sys.stderr)
        return None


def run_export(args) -> int:
    from ..api import describe, patch
    from ..export import export
    from ..loading import from_pretrained
    from ..core.outputs import OutputLock

    source, method, factor, options, dtype = prepare(args)
    with OutputLock(args.out, "--out"):  # one writer, from before the load to the rename
        _check_out(Path(args.out), source, args.overwrite)  # again: another run may have written it meanwhile
        kwargs = {"dtype": dtype}
        if args.gguf_file:
            kwargs["gguf_file"] = args.gguf_file
        model = from_pretrained(source, **kwargs).eval()
        saved = describe(model)
        if saved is not None:  # the new patch replaces it, from the model it was made from: said, not silent
            print(f"ctxext export: note: {args.model} was saved patched ({saved['method']} x{saved['factor']}); "
                  f"the export replaces that patch with {method}, applied to the model it was made from",
                  file=sys.stderr)
        patch(model, method, factor, replace=True, **options)
        tokenizer = _tokenizer(source, args.gguf_file)
        form = export(model, args.out, tokenizer=tokenizer, overwrite=args.overwrite, inputs=(source,))
    what = f"{method}" + (f" x{factor:g}" if factor is not None else "")
    print(f"exported {args.model} patched with {what} to {args.out}: {form.summary}")
    print(f"plain transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r}) loads it; "
          "ctxext.from_pretrained also reports the patch")
    return 0
