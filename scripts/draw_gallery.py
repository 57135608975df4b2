"""Draw the pattern gallery of the README: one PNG per attention kind, heads side by side.

    python scripts/draw_gallery.py --output_dir docs/patterns --length 64

Fixed patterns show their mask; content-based kinds (LSH, routing, Sinkhorn) show the keys each query attended to on
a random input of a freshly initialised layer; projection kinds show their effective weights' support. Each kind is
drawn with its picture settings (`longattn.tools.visualize.PICTURE_SETTINGS`), the defaults of `longattn-visualize`.
`binary_partition` sees every token through some node, so its picture shows instead through which node: the tree
level of the span covering each key (bidirectional and causal).
"""

import argparse

from longattn import available_attention_types
from longattn.attention_binary_partition import binary_partition_levels
from longattn.tools.visualize import main as draw


def draw_binary_partition(path: str, length: int, context: int = 2) -> None:
    """The level of the node through which each query sees each key: 0 = the token itself, l = a span of 2^l."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(7.4, 3.6))
    for ax, causal in zip(axes, (False, True)):
        levels = binary_partition_levels(length, context=context, causal=causal).float()
        image = ax.imshow(
            levels.masked_fill(levels < 0, float("nan")).numpy(), cmap="viridis_r", interpolation="nearest"
        )
        ax.set_title("causal" if causal else "bidirectional", fontsize=9)
        ax.set_xlabel("key")
    axes[0].set_ylabel("query")
    fig.colorbar(image, ax=axes, label="tree level of the node seen", shrink=0.8)
    fig.suptitle(f"binary_partition binary_partition_context={context} n={length}", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--output_dir", default="docs/patterns", help="folder of the PNGs")
    parser.add_argument("--length", type=int, default=64, help="tokens of the random input")
    args = parser.parse_args()
    for kind in available_attention_types():
        if kind == "binary_partition":
            draw_binary_partition(f"{args.output_dir}/{kind}.png", args.length)
            continue
        extra = ["--global_tokens", "0"] if kind == "sliding" else []
        draw(
            [
                "--attention_type",
                kind,
                "--length",
                str(args.length),
                "--output",
                f"{args.output_dir}/{kind}.png",
                *extra,
            ]
        )


if __name__ == "__main__":
    main()
