"""Pictures of attention patterns: which keys each query attended to, per head, as a PNG.

For fixed patterns (sliding, dilated, strided, ...) the picture is the pattern's mask; for content-based kinds (LSH,
routing, Sinkhorn, ...) it is the pattern the layer actually produced on the given input. Both come from the same
place: the layer's attention weights (`output_attentions=True`), computed in float64 so that a visible key never
underflows to a zero weight.

Needs matplotlib (`pip install matplotlib`). Command line: `longattn visualize --help` (or `longattn-visualize`);
its config overrides take the recipes' grammar (`--config_overrides "sliding_window=4,sliding_dilation=[1,3]"`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..config_overrides import format_config_overrides, parse_config_overrides
from ..configuration_longattn import LongAttnConfig
from ..modeling_longattn import LongAttnModel
from .command_line import CommandLineParser

# Each kind's settings for a picture, under the user's overrides: small enough that its structure shows at the
# default 64 tokens (the config defaults, e.g. a window of 256 keys each side, would cover the whole picture).
PICTURE_SETTINGS: dict[str, dict] = {
    "sliding": {"sliding_window": 4, "sliding_dilation": [1, 3]},
    "strided": {"strided_stride": 8},
    "fixed": {"fixed_block_size": 16, "fixed_num_summary": 4},
    "lsh": {"lsh_bucket_size": 8, "lsh_num_hashes": 2},
    "routing": {"routing_num_clusters": 4},
    "sinkhorn": {"sinkhorn_block_size": 8},
    "adaptive_span": {"adaptive_span_max": 16, "adaptive_span_ramp": 4},
    "reduction": {"reduction_ratio": 4},
    "linformer": {"linformer_proj_len": 16},
    "deformable": {"deformable_levels": 3, "deformable_points": 2},
    "synthesizer": {"synthesizer_mode": "factorized_random"},
}


@torch.no_grad()
def attention_pattern(
    model: LongAttnModel,
    input_ids: torch.Tensor,
    *,
    layer_idx: int = 0,
    attention_mask: torch.Tensor | None = None,
    global_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The keys each query of the first row attended to in layer `layer_idx`.

    Args:
        model: A `LongAttnModel` (or the base model of a head, e.g. `model.longattn`).
        input_ids: `[b, n]`; only the first row is drawn.
        layer_idx: The layer to look at.
        attention_mask: `[b, n]` padding mask (1 = real token).
        global_attention_mask: `[b, n]` global tokens (1 = global).

    Returns:
        bool `[h, n, n]`: True where query i gave key j a non-zero weight.
    """
    if not 0 <= layer_idx < model.config.num_hidden_layers:
        raise ValueError(
            f"`layer_idx`={layer_idx} is out of range: the model has {model.config.num_hidden_layers} layers."
        )
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, global_attention_mask=global_attention_mask)
    was_training, dtype = model.training, model.dtype
    model.eval().double()
    try:
        out = model(**inputs, output_attentions=True, use_cache=False)
    finally:
        model.to(dtype).train(was_training)
    return out.attentions[layer_idx][0] > 0


def draw_pattern(pattern: torch.Tensor, path: str | Path, *, title: str = "") -> Path:
    """Draw a `[h, n, m]` bool pattern, heads side by side, to a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = pattern.shape[0]
    fig, axes = plt.subplots(1, heads, figsize=(3.2 * heads, 3.4), squeeze=False)
    for head, ax in enumerate(axes[0]):
        ax.imshow(pattern[head].cpu().numpy(), cmap="Blues", interpolation="nearest", vmin=0, vmax=1)
        density = pattern[head].float().mean().item()
        ax.set_title(f"head {head} ({density:.0%} of keys)", fontsize=9)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def picture_config(
    attention_type: str, overrides: dict | None = None, *, length: int = 64, heads: int = 2, causal: bool = False
) -> LongAttnConfig:
    """A one-layer config of `attention_type` for a picture: `PICTURE_SETTINGS[attention_type]` under `overrides`.

    Raises:
        ValueError: `length` or `heads` below 1, or a config field `LongAttnConfig` refuses.
    """
    for name, value in (("length", length), ("heads", heads)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    settings = {
        "attention_type": attention_type,
        "num_attention_heads": heads,
        "hidden_size": 16 * heads,
        "num_hidden_layers": 1,
        "intermediate_size": 32,
        "max_position_embeddings": max(length, 128),
        "is_decoder": causal,
        **PICTURE_SETTINGS.get(attention_type, {}),
        **(overrides or {}),
    }
    return LongAttnConfig(**settings)


def main(argv: list[str] | None = None) -> None:
    parser = CommandLineParser(
        prog="longattn-visualize",
        description="Draw the attention pattern of a configured layer as a PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--attention_type", default="sliding", help="a registered attention name")
    parser.add_argument(
        "--config_overrides",
        default="",
        help="config fields as in the recipes, over the kind's picture settings "
        "(longattn.tools.visualize.PICTURE_SETTINGS), e.g. 'sliding_window=4,sliding_dilation=[1,3]'",
    )
    parser.add_argument("--length", type=int, default=64, help="tokens of the random input")
    parser.add_argument("--heads", type=int, default=2, help="attention heads (one picture each)")
    parser.add_argument("--causal", action="store_true", help="draw the decoder (causal) form")
    parser.add_argument("--global_tokens", type=int, nargs="*", default=[], help="positions of global tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the input")
    parser.add_argument("--output", default="pattern.png", help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        overrides = parse_config_overrides(args.config_overrides)
        config = picture_config(
            args.attention_type, overrides, length=args.length, heads=args.heads, causal=args.causal
        )
        outside = [position for position in args.global_tokens if not 0 <= position < args.length]
        if outside:
            raise ValueError(f"--global_tokens {outside} lie outside the {args.length} positions [0, {args.length})")
    except ValueError as error:
        parser.error(str(error))

    torch.manual_seed(args.seed)
    model = LongAttnModel(config)
    input_ids = torch.randint(4, config.vocab_size, (1, args.length))
    global_mask = torch.zeros_like(input_ids)
    global_mask[0, args.global_tokens] = 1
    pattern = attention_pattern(model, input_ids, global_attention_mask=global_mask)
    settings = format_config_overrides({**PICTURE_SETTINGS.get(args.attention_type, {}), **overrides})
    title = " ".join(filter(None, [args.attention_type, settings, f"n={args.length}", "causal" * args.causal]))
    draw_pattern(pattern, args.output, title=title)
    print(f"wrote the picture of {args.attention_type} attention to {Path(args.output).resolve()}")


if __name__ == "__main__":
    main()
