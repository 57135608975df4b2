"""Draw the pattern gallery of the README: one PNG per attention kind, heads side by side.

    python scripts/draw_gallery.py --output_dir docs/patterns --length 64

Fixed patterns show their mask; content-based kinds (LSH, routing, Sinkhorn) show the keys each query attended to on
a random input of a freshly initialised layer; projection kinds show their effective weights' support. Each kind is
drawn with its picture settings (`longattn.tools.visualize.PICTURE_SETTINGS`), the defaults of `longattn-visualize`.
"""

import argparse

from longattn import available_attention_types
from longattn.tools.visualize import main as draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--output_dir", default="docs/patterns", help="folder of the PNGs")
    parser.add_argument("--length", type=int, default=64, help="tokens of the random input")
    args = parser.parse_args()
    for kind in available_attention_types():
        extra = ["--global_tokens", "0"] if kind == "sliding" else []
        draw(["--attention_type", kind, "--length", str(args.length), "--output", f"{args.output_dir}/{kind}.png",
              *extra])


if __name__ == "__main__":
    main()
