"""`longattn`: one command for the tools, `longattn SUBCOMMAND ...` (also `python -m longattn SUBCOMMAND ...`).

Each subcommand is a tool's own `main(argv)`, imported only when it runs: `longattn --help` and the choice of a
subcommand import neither torch nor transformers. The older console scripts (`longattn-lengthen`, `longattn-data`,
`longattn-hub`, `longattn-visualize`) stay, as aliases of the same functions.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, needs longattn's registrations, one line of help)
SUBCOMMANDS = {
    "lengthen": (
        "longattn.tools.lengthen",
        True,
        "make a pretrained checkpoint read longer inputs with longattn's kinds",
    ),
    "data": ("longattn.train.data", False, "write an offline task (listops, needle, needles) as jsonl"),
    "eval": ("longattn.tools.evaluate", True, "evaluate a saved model folder"),
    "hub": ("longattn.tools.hub", False, "check a saved folder, or push it to the Hugging Face Hub"),
    "visualize": ("longattn.tools.visualize", True, "draw an attention pattern as a PNG"),
}


def usage() -> str:
    lines = [
        "usage: longattn SUBCOMMAND [ARGS ...]   (or: python -m longattn SUBCOMMAND [ARGS ...])",
        "",
        "Long-sequence transformers with a zoo of efficient attentions. Subcommands:",
        "",
        *(f"  {name:<10} {help_line}" for name, (_, _, help_line) in SUBCOMMANDS.items()),
        "",
        "`longattn SUBCOMMAND --help` describes a subcommand's arguments.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"longattn {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(
            f"{usage()}\n\nlongattn: error: unknown subcommand {name!r}: expected one of {list(SUBCOMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module_name, needs_registration, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(
            f"longattn: error: `longattn {name}` is not available in this version of longattn ({module_name} "
            "is missing): update longattn.",
            file=sys.stderr,
        )
        return 2
    if needs_registration:
        import longattn

        longattn.register()
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
