"""`longattn-lengthen SRC OUT --max_length 4096 --attention_type sliding --sliding_window 256 ...`

Writes to OUT a model of SRC's family that reads `--max_length` tokens with longattn's kinds (`longattn.lengthen`),
SRC's tokenizer (if it has one) with its `model_max_length` raised, and a model card saying that loading it needs
`pip install longattn`. Every flag other than the ones below is a field of the `longattn` dict (`--attention_type`,
`--sliding_window`, `--sliding_dilation [1,1,2,4]`, `--attention_type [sliding,full]`, ...), validated like
`LongAttnConfig`'s fields.
"""

from __future__ import annotations

import argparse
import sys

from ..configuration_longattn import check_override_fields
from ..integration_transformers import allowed_fields
from ..lengthen import ROPE_TYPES, lengthen, save_lengthened


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The tool's own flags and the `longattn` fields (`--field value` or `--field=value`; lists in brackets)."""
    from ..train.training import parse_config_overrides

    parser = argparse.ArgumentParser(
        prog="longattn-lengthen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", help="a pretrained model: folder or Hub id")
    parser.add_argument("out", help="the output folder")
    parser.add_argument("--max_length", type=int, required=True, help="tokens the lengthened model reads")
    parser.add_argument("--rope_type", choices=ROPE_TYPES, help="rotary models: scale the rotation (default: none)")
    args, rest = parser.parse_known_args(argv)
    pairs = []
    while rest:
        word = rest.pop(0)
        if not word.startswith("--"):
            parser.error(f"unexpected argument {word!r}: longattn fields are given as --field value")
        name, sep, value = word[2:].partition("=")
        if not sep:
            if not rest or rest[0].startswith("--"):
                parser.error(f"--{name} needs a value")
            value = rest.pop(0)
        try:
            check_override_fields([name], allowed_fields(), where=f"--{name}", hint=" and not a flag of the tool")
        except ValueError as error:
            parser.error(str(error))
        pairs.append(f"{name}={value}")
    return args, parse_config_overrides(",".join(pairs))


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    args, fields = parse_args(argv)
    try:
        model = lengthen(args.src, args.max_length, rope_type=args.rope_type, **fields)
    except ValueError as error:
        print(f"longattn-lengthen: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.src)
    except (OSError, ValueError, TypeError):  # a checkpoint saved without its tokenizer
        tokenizer = None
    save_lengthened(model, args.out, tokenizer=tokenizer, source=args.src)
    print(f"{args.out}: {type(model).__name__} reading {args.max_length} tokens with {model.config.longattn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
