"""The ``composer3d-convert`` command line."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from composer3d.convert.common import ConvertError, hydra_overrides
from composer3d.convert.export import export, peft_method, read_checkpoint_meta
from composer3d.convert.import_hf import import_hf
from composer3d.dtypes import DTYPES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="composer3d-convert",
        description="Convert composer3d checkpoints to and from Hugging Face Llama.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser(
        "export",
        help="checkpoint directory -> Hugging Face safetensors directory (bfloat16 unless --dtype "
        "says otherwise)",
        description="Write a checkpoint's model as a Hugging Face directory. The tensors are "
        "written in bfloat16 unless --dtype says otherwise (--dtype float32 for full precision).",
    )
    ex.add_argument(
        "checkpoint", type=Path, help="a checkpoint directory (…/checkpoints/step-NNNNNNNN)"
    )
    ex.add_argument(
        "out",
        type=Path,
        help="output directory (created; must hold no model files unless --overwrite)",
    )
    ex.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="dtype of the written tensors (default: bfloat16, whatever the checkpoint holds; "
        "--dtype float32 keeps a float32 checkpoint's weights exactly)",
    )
    ex.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)"
    )
    ex.add_argument(
        "--overwrite",
        action="store_true",
        help="replace model files already in the output directory",
    )
    ex.add_argument(
        "--merge",
        action="store_true",
        help="a peft=lora|qlora checkpoint: write the merged full model (W + alpha/r·B·A, in fp32 "
        "then --dtype; QLoRA's from its dequantized NF4 base) instead of PEFT's adapter directory "
        "(adapter_config.json, adapter_model.safetensors)",
    )
    im = sub.add_parser(
        "import", help="Hugging Face Llama directory -> model-only composer3d checkpoint"
    )
    im.add_argument("hf_dir", type=Path, help="directory with config.json and model*.safetensors")
    im.add_argument("out", type=Path, help="new checkpoint directory (must not exist or be empty)")
    im.add_argument(
        "--ignore-rope-scaling",
        action="store_true",
        help="import a model with RoPE scaling (e.g. Llama-3.1's 'llama3' type) as plain RoPE",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            if peft_method(read_checkpoint_meta(args.checkpoint)) != "none" or args.merge:
                from composer3d.peft.export import export_peft

                written = export_peft(
                    args.checkpoint,
                    args.out,
                    args.dtype,
                    args.max_shard_size,
                    args.overwrite,
                    args.merge,
                )
            else:
                written = export(
                    args.checkpoint, args.out, args.dtype, args.max_shard_size, args.overwrite
                )
            print(
                f"exported {args.checkpoint} to {args.out} ({args.dtype}): "
                f"{', '.join(p.name for p in written)}"
            )
        else:
            fields = import_hf(args.hf_dir, args.out, args.ignore_rope_scaling)
            print(f"imported {args.hf_dir} as the model-only checkpoint {args.out}")
            print(
                "train from it with these overrides (the model config must match the checkpoint's "
                "exactly):"
            )
            print(
                "  composer3d-train "
                + " ".join(shlex.quote(o) for o in hydra_overrides(fields, args.out.resolve()))
            )
    except ConvertError as error:
        # bad input, as argparse's own errors and every other command's refusals: exit code 2
        print(f"composer3d-convert {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
