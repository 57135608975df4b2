"""transformers' decoding modes on every decoder kind: greedy with a draft model (`assistant_model=`) or prompt lookup
(`prompt_lookup_num_tokens=`) gives the tokens of plain greedy decoding, and beam search with the cache gives those
of beam search without it.

The models are initialised with a wide normal (`initializer_range=0.5`) so that their greedy continuations vary from
token to token: a tiny model at the default 0.02 repeats one token, which hides a decoder that ignores its context.
"""

from __future__ import annotations

import pytest
import torch
from kind_configs import kind_config, random_ids
from test_models import KINDS, causal_config_or_skip
from transformers import DynamicCache

import longattn

GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)


def _decoder(kind: str, seed: int = 0, **overrides) -> longattn.LongAttnForCausalLM:
    torch.manual_seed(seed)
    config = causal_config_or_skip(kind, eos_token_id=None, initializer_range=0.5, **overrides)
    return longattn.LongAttnForCausalLM(config).eval()


def _prompt() -> torch.Tensor:
    """One row (assisted decoding takes batch 1) that repeats an n-gram, so prompt lookup finds drafts."""
    ids = random_ids(1, 11)
    return torch.cat([ids, ids[:, 2:8]], dim=1)


@pytest.mark.parametrize("kind", KINDS)
def test_assisted_and_prompt_lookup_decoding_equal_greedy(kind):
    model = _decoder(kind)
    assistant = _decoder("full", seed=1, num_hidden_layers=1)
    prompt = _prompt()
    greedy = model.generate(prompt, **GREEDY)
    assisted = model.generate(prompt, assistant_model=assistant, **GREEDY)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=3, **GREEDY)
    torch.testing.assert_close(assisted, greedy, rtol=0, atol=0)
    torch.testing.assert_close(lookup, greedy, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_beam_search_with_cache_equals_without(kind):
    model = _decoder(kind)
    prompt = random_ids(2, 9)
    for num_beams in (2, 3):
        cached = model.generate(prompt, num_beams=num_beams, **GREEDY)
        uncached = model.generate(prompt, num_beams=num_beams, use_cache=False, **GREEDY)
        assert cached.shape == (2, 19)
        torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


def test_generation_cache_keeps_every_key():
    """A sliding-window model's generation cache keeps all keys: dilated windows and global tokens reach beyond the
    last `sliding_window` keys, which a sliding cache layer built from the config would drop."""
    model = _decoder("sliding")
    out = model.generate(random_ids(1, 20), return_dict_in_generate=True, **GREEDY)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert [layer.keys.shape[2] for layer in cache.layers] == [29, 29]  # 20 prompt + 10 new - the last, not fed


def test_static_cache_implementation_is_refused():
    model = _decoder("sliding")
    with pytest.raises(ValueError, match="cache_implementation.*'static'"):
        model.generate(random_ids(1, 8), cache_implementation="static", **GREEDY)


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_seq2seq_assisted_and_beam_search(kind):
    """The seq2seq model: assisted and prompt-lookup decoding equal greedy, beam search equals its uncached form."""
    torch.manual_seed(0)
    model = longattn.LongAttnForSeq2SeqLM(kind_config(kind, eos_token_id=None, initializer_range=0.5)).eval()
    torch.manual_seed(1)
    assistant = longattn.LongAttnForSeq2SeqLM(
        kind_config("full", num_hidden_layers=1, eos_token_id=None, initializer_range=0.5)
    ).eval()
    source = random_ids(1, 21)
    greedy = model.generate(source, **GREEDY)
    torch.testing.assert_close(model.generate(source, assistant_model=assistant, **GREEDY), greedy, rtol=0, atol=0)
    torch.testing.assert_close(model.generate(source, prompt_lookup_num_tokens=3, **GREEDY), greedy, rtol=0, atol=0)
    sources = random_ids(2, 21)
    cached = model.generate(sources, num_beams=3, **GREEDY)
    torch.testing.assert_close(cached, model.generate(sources, num_beams=3, use_cache=False, **GREEDY), rtol=0, atol=0)


def test_cache_argument_takes_both_names():
    """`cache` (transformers' name since 5.2x, what generate passes) and `past_key_values` (its older name) are one
    argument: the same step through either gives the same logits; two different caches at once are refused."""
    model = _decoder("sliding")
    ids = random_ids(1, 12)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        for name in ("cache", "past_key_values"):
            prefix = model(input_ids=ids[:, :11], use_cache=True)
            cache = prefix.cache if hasattr(prefix, "cache") else prefix.past_key_values
            step = model(input_ids=ids[:, 11:], use_cache=True, **{name: cache}).logits
            torch.testing.assert_close(step[:, 0], full[:, 11], rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="`cache` or as `past_key_values`"):
            model(input_ids=ids[:, 11:], cache=DynamicCache(), past_key_values=DynamicCache())
