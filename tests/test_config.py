"""LongAttnConfig: every field refused outside its type and range, misspelt fields caught, `head_dim` accepted when
it agrees, foreign model folders refused with what to use instead, and saved configs still load."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from attention_checks import TINY_MODEL
from transformers import AutoConfig, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, RobertaConfig, RobertaModel

import longattn
from longattn import LongAttnConfig

# The tiny model of attention_checks.py in one layer: the foreign models' size.
ONE_LAYER = {**TINY_MODEL, "num_hidden_layers": 1}


def tiny(**fields) -> LongAttnConfig:
    return LongAttnConfig(**{**TINY_MODEL, **fields})


# ---------------------------------------------------------------------------------------------- types and ranges
@pytest.mark.parametrize(
    "fields",
    [
        dict(is_decoder="no"),  # a truthy string would make the encoder causal
        dict(is_encoder_decoder="yes"),
        dict(tie_word_embeddings=1),
        dict(use_cache="false"),
        dict(output_hidden_states=None),
        dict(return_dict=0),
        dict(rope_theta=0),
        dict(rope_theta=-10000.0),
        dict(rope_theta=math.inf),
        dict(rope_theta="10000"),
        dict(layer_norm_eps=-1e-5),
        dict(layer_norm_eps=0.0),
        dict(layer_norm_eps=math.nan),
        dict(initializer_range=-0.02),
        dict(initializer_range=math.inf),
        dict(classifier_dropout=-0.1),
        dict(classifier_dropout=1.0),
        dict(classifier_dropout=math.nan),
        dict(hidden_dropout_prob=math.nan),
        dict(attention_probs_dropout_prob=True),
        dict(hidden_act="gelux"),
        dict(chunk_size_feed_forward=-1),
        dict(problem_type="regresion"),
        dict(pad_token_id=60),
        dict(bos_token_id=-1),
        dict(eos_token_id=[2, 600]),
        dict(decoder_start_token_id=1.0),
        dict(attention_type="adaptive_span", adaptive_span_loss_coef=math.inf),
        dict(attention_type="adaptive_span", adaptive_span_loss_coef=math.nan),
        dict(attention_type="sinkhorn", sinkhorn_temperature=math.inf),
    ],
    ids=lambda fields: ",".join(f"{k}={v!r}" for k, v in fields.items()),
)
def test_a_field_outside_its_type_or_range_is_refused_naming_it(fields):
    field, value = list(fields.items())[-1]
    with pytest.raises(ValueError, match=rf"`{field}`=") as error:
        tiny(**fields)
    assert repr(value) in str(error.value) or str(value) in str(error.value)


def test_values_inside_the_ranges_are_accepted():
    config = tiny(
        rope_theta=500000,
        layer_norm_eps=1e-12,
        initializer_range=0.0,
        classifier_dropout=None,
        eos_token_id=[2, 3],
        pad_token_id=None,
        hidden_act="silu",
        is_decoder=True,
    )
    assert config.rope_theta == 500000 and config.eos_token_id == [2, 3]


def test_a_saved_config_round_trips(tmp_path):
    config = tiny(
        attention_type=["sliding", "lsh"],
        sliding_window=3,
        lsh_seed=4,
        classifier_dropout=0.2,
        rope_theta=1e6,
        is_decoder=True,
        num_labels=3,
    )
    config.save_pretrained(tmp_path)
    expected = {**config.to_dict(), "_name_or_path": None}
    for loaded in (LongAttnConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert {**loaded.to_dict(), "_name_or_path": None} == expected


# ---------------------------------------------------------------------------------------------- misspelt fields
def test_a_misspelt_field_is_refused_with_the_field_it_resembles():
    with pytest.raises(ValueError, match=r"`sliding_windw`=8 .*did you mean sliding_window\?"):
        tiny(sliding_windw=8)
    with pytest.raises(ValueError, match="did you mean num_hidden_layers"):
        tiny(num_hiden_layers=3)


def test_the_recipes_overrides_of_a_saved_config_name_the_close_field(tmp_path):
    """`--config_overrides` on a saved longattn config: the misspelt key and the field it resembles, one error."""
    from longattn.train import training

    tiny().save_pretrained(tmp_path)
    args = training.recipe_parser(None, task="mlm").parse_args(
        [
            "--train_file",
            __file__,
            "--output_dir",
            str(tmp_path / "out"),
            "--config_name",
            str(tmp_path),
            "--config_overrides",
            "num_labels=3,slidingwindow=4",
        ]
    )
    with pytest.raises(training.RecipeError, match=r"'slidingwindow' \(did you mean sliding_window.*\) for "):
        training.load_config(args, task="mlm")
    args.config_overrides = "num_labels=3,sliding_window=4"
    assert training.load_config(args, task="mlm").sliding_window == 4


def test_unknown_keys_far_from_any_field_and_transformers_keys_are_kept():
    config = tiny(my_note="kept", cls_token_id=3, sep_token_id=4, tokenizer_class="ByteTokenizer", num_labels=4)
    assert config.my_note == "kept" and config.cls_token_id == 3 and config.num_labels == 4


def test_a_misspelt_field_in_a_saved_config_is_a_warning(tmp_path, caplog):
    tiny().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    saved["sliding_windw"] = 8
    path.write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="longattn.configuration_longattn"):
        config = LongAttnConfig.from_pretrained(tmp_path)
    assert any("did you mean sliding_window" in r.getMessage() for r in caplog.records)
    assert config.sliding_window == 256  # the default, as the warning says


# ---------------------------------------------------------------------------------------------- head_dim
def test_head_dim_is_accepted_when_it_agrees_and_refused_otherwise(tmp_path):
    assert tiny(head_dim=16).head_dim == 16
    with pytest.raises(ValueError, match=r"`head_dim`=8 .*32 / 2 = 16"):
        tiny(head_dim=8)
    longattn.LongAttnModel(tiny()).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "head_dim": 16}))  # a Llama-style config that states it
    assert LongAttnConfig.from_pretrained(tmp_path).head_dim == 16
    assert longattn.LongAttnModel.from_pretrained(tmp_path).config.head_dim == 16
    assert LongAttnConfig.from_pretrained(tmp_path, head_dim=16).head_dim == 16
    with pytest.raises(ValueError, match="head_dim"):
        LongAttnConfig.from_pretrained(tmp_path, head_dim=32)


# ---------------------------------------------------------------------------------------------- foreign folders
def _bert():
    return BertModel(BertConfig(**ONE_LAYER))


def _roberta():
    return RobertaModel(RobertaConfig(**ONE_LAYER))


def _llama():
    return LlamaForCausalLM(LlamaConfig(**ONE_LAYER, num_key_value_heads=2))


@pytest.mark.parametrize("build, model_type", [(_bert, "bert"), (_roberta, "roberta"), (_llama, "llama")])
def test_a_folder_of_another_model_type_is_refused_saying_what_to_use(tmp_path, build, model_type):
    torch.manual_seed(0)
    build().save_pretrained(tmp_path)
    for load in (
        longattn.LongAttnModel.from_pretrained,
        longattn.LongAttnForMaskedLM.from_pretrained,
        LongAttnConfig.from_pretrained,
    ):
        with pytest.raises(ValueError, match=rf"holds a '{model_type}' model.*AutoModel"):
            load(tmp_path)
    with pytest.raises(ValueError, match=rf"holds a '{model_type}' model"):
        LongAttnConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
