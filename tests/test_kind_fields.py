"""Kinds declare, the stack runs: one attention forward for every kind, and the kinds' config fields in one static
table that the configuration validates through without importing any kind, op or executor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kind_configs import SIZES, tiny_config

import longattn
from longattn import LongAttnConfig, backends
from longattn.attention_base import LongAttnAttention
from longattn.attention_fields import KINDS, field_defaults
from longattn.attention_registry import ATTENTION_CLASSES
from longattn.tools.hub import code_closure

PACKAGE_DIR = Path(longattn.__file__).parent

# Imports `longattn.configuration_longattn` without running the package's `__init__` (which loads everything): what
# the module itself pulls in, as in a Hub folder, where transformers loads the config file with its siblings only.
ALONE = """
import sys, types
package = types.ModuleType("longattn")
package.__path__ = [sys.argv[1]]
sys.modules["longattn"] = package
import longattn.configuration_longattn as configuration
configuration.LongAttnConfig(attention_type=["lsh", "sinkhorn"], num_hidden_layers=2, lsh_num_buckets=4)
print(" ".join(sorted(name for name in sys.modules if name.startswith("longattn."))))
"""


def test_the_configuration_imports_no_kind_op_or_executor():
    done = subprocess.run([sys.executable, "-c", ALONE, str(PACKAGE_DIR)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["longattn.attention_fields", "longattn.configuration_longattn"]


def test_a_hub_folder_carries_the_field_table():
    assert code_closure(entry_points=("configuration_longattn.py",)) == [
        "attention_fields.py",
        "configuration_longattn.py",
    ]
    assert "attention_fields.py" in code_closure()


def test_every_kind_runs_the_one_forward_and_takes_its_fields_from_the_table():
    assert set(ATTENTION_CLASSES) == set(KINDS)
    for name, kind in ATTENTION_CLASSES.items():
        assert kind.forward is LongAttnAttention.forward, name
        assert "validate_config" not in vars(kind) and "check_backend" not in vars(kind), name
        assert kind.config_fields == field_defaults(name) and kind.backends == KINDS[name].backends, name
    assert not hasattr(backends, "KIND_PATTERNS")


def test_a_kind_without_a_row_in_the_table_is_refused():
    with pytest.raises(TypeError, match="'unlisted' has no row in `attention_fields.KINDS`"):
        type("Unlisted", (LongAttnAttention,), {"attention_type": "unlisted"})


def test_a_kind_declaring_a_setting_of_another_kind_is_refused():
    with pytest.raises(TypeError, match=r"`settings` reads \['sliding_window'\], which are not fields of"):
        type("Misread", (LongAttnAttention,), {"attention_type": "reduction", "settings": (("x", "sliding_window"),)})


def test_declared_settings_hold_each_layers_value():
    """A per-layer field gives each layer its entry, a per-head one a list, a number a float; the layer reads nothing
    else of its kind's fields by hand."""
    sliding_fields = dict(sliding_window=[3, 5], sliding_dilation=(1, 2))
    span_fields = dict(adaptive_span_max=[7, 9], adaptive_span_loss_coef=1)
    config = LongAttnConfig(**SIZES, attention_type=["sliding", "adaptive_span"], **sliding_fields, **span_fields)
    sliding = ATTENTION_CLASSES["sliding"](config, layer_idx=0, is_causal=False)
    span = ATTENTION_CLASSES["adaptive_span"](config, layer_idx=1, is_causal=False)
    assert sliding.setting_fields == {"window": "sliding_window", "dilation": "sliding_dilation"}
    assert (sliding.window, sliding.dilation) == (3, [1, 2])
    assert (span.max_span, span.ramp) == (9, 32) and type(span.loss_coef) is float and span.loss_coef == 1.0
    for name, kind in ATTENTION_CLASSES.items():
        assert set(kind.setting_fields.values()) <= set(KINDS[name].fields), name


def test_per_layer_optional_fields_take_none_entries():
    config = LongAttnConfig(num_hidden_layers=2, attention_type="lsh", lsh_num_buckets=[None, 4])
    assert config.per_layer("lsh_num_buckets", 0) is None and config.per_layer("lsh_num_buckets", 1) == 4
    with pytest.raises(ValueError, match=r"`lsh_num_buckets`=\[None, 3\] is invalid: expected even integers"):
        LongAttnConfig(num_hidden_layers=2, attention_type="lsh", lsh_num_buckets=[None, 3])


@pytest.mark.parametrize("kind", ["reduction", "linformer", "synthesizer"])
def test_the_dense_form_equals_the_fast_path(kind):
    """The "reference" back end takes each kind's dense form (weights returned), with the same output."""
    config = tiny_config(kind, num_hidden_layers=1, max_position_embeddings=32, reduction_ratio=3, linformer_proj_len=8)
    torch.manual_seed(0)
    layer = ATTENTION_CLASSES[kind](config, layer_idx=0, is_causal=False).double().eval()
    hidden_states = torch.randn(2, 11, 32, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 8:] = False
    fast, no_weights = layer(hidden_states, attention_mask=mask)
    layer.backend = "reference"
    dense, weights = layer(hidden_states, attention_mask=mask)
    torch.testing.assert_close(dense, fast)
    assert no_weights is None and weights.shape[:3] == (2, 2, 11)
