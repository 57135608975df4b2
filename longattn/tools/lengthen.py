"""`longattn-lengthen SRC OUT --max_length 4096 --attention_type sliding --sliding_window 256 ...`

Writes to OUT a model of SRC's family that reads `--max_length` tokens with longattn's kinds (`longattn.lengthen`),
SRC's tokenizer (if it has one) with its `model_max_length` raised, and a model card saying how to load it (with
`trust_remote_code=True`, or after `import longattn`). Every flag other than the ones below is a field of the
`longattn` dict (`--attention_type`, `--sliding_window`, `--sliding_dilation [1,1,2,4]`, `--attention_type
[sliding,full]`, ...), validated like `LongAttnConfig`'s fields. Also `longattn lengthen SRC OUT ...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch import nn

from ..config_overrides import parse_config_overrides
from ..configuration_longattn import check_override_fields, max_tokens
from ..integration_transformers import allowed_fields
from ..lengthen import ROPE_TYPES, lengthen
from .command_line import CommandLineParser
from .hub import is_stock_longattn, save_hub_folder, stock_model_card


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The tool's own flags and the `longattn` fields (`--field value` or `--field=value`; lists in brackets)."""
    parser = CommandLineParser(
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
    try:
        return args, parse_config_overrides(",".join(pairs), flag="longattn fields")
    except ValueError as error:  # a malformed value: a usage error, not a traceback
        parser.error(str(error))


def save_lengthened(model: nn.Module, output_dir: str | Path, *, tokenizer=None, source: str | None = None) -> Path:
    """Write a lengthened model (with the code that runs its kinds), its tokenizer (its `model_max_length` raised to
    what the model reads) and a model card saying how to load it.

    Args:
        model: A model returned by `lengthen`.
        output_dir: The folder (created).
        tokenizer: Its tokenizer, or None.
        source: The checkpoint it was lengthened from, for the card: a Hub id becomes its `base_model`, a local
            folder is recorded by its name only (the card is published with the folder).

    Raises:
        ValueError: `model` is not a stock model running longattn's kinds (no `longattn` dict in its config).
    """
    if not is_stock_longattn(model.config):
        raise ValueError(
            f"{type(model).__name__} is not a lengthened stock model (its config holds no `longattn` "
            "dict): pass what `longattn.lengthen` returns."
        )
    limit = max_tokens(model.config)
    if tokenizer is not None and limit is not None:
        tokenizer.model_max_length = limit
    local = source is not None and Path(source).exists()
    facts = {"lengthened from": f"`{Path(source).name if local else source}`"} if source else {}
    card = stock_model_card(
        model.config, base_model=None if local else source, extra={**facts, "lengthened to": f"{limit} tokens"}
    )
    return save_hub_folder(model, tokenizer, output_dir, card=card)


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
