"""The byte-level tokenizer of longattn: every UTF-8 byte is one token, nothing to download.

Ids follow `LongAttnConfig`'s defaults (vocab_size=260):

    0 <pad>   1 <s>   2 </s>   3 <mask>   4 + b  for the byte b (0..255)

Byte-level input is what the Long Range Arena text tasks use, and it is the natural tokenizer for long-sequence models
trained from scratch: no vocabulary to learn, no unknown tokens, lengths measured in bytes.

It is built in code as a `tokenizers` fast tokenizer (a ByteLevel pre-tokenizer and a BPE model with no merges), so a
saved copy is a plain `tokenizer.json` that `AutoTokenizer.from_pretrained(folder)` loads anywhere without custom code.
Encoding adds `<s>` in front and `</s>` at the end (`<s> A </s> B </s>` for pairs): the first token is the natural
global token of classification models. A decoder's tokenizer (`add_eos_token=False`, what the causal-LM recipe saves)
adds only `<s>`: a prompt that ended in `</s>` would ask `generate()` to continue after the end of the text. The
causal-LM recipe appends `</s>` to its training texts itself, so the model still learns where a text ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, MASK_TOKEN = "<pad>", "<s>", "</s>", "<mask>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, MASK_TOKEN)  # ids 0, 1, 2, 3
BYTE_OFFSET = len(SPECIAL_TOKENS)
VOCAB_SIZE = BYTE_OFFSET + 256


def byte_tokenizer_object(add_eos_token: bool = True) -> Tokenizer:
    """The raw `tokenizers.Tokenizer` behind `byte_tokenizer` (ids as in the module docstring); `add_eos_token` as
    there."""
    byte_to_char = bytes_to_unicode()  # GPT-2's printable stand-in for each byte, as the ByteLevel pre-tokenizer emits
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_to_char[byte]: BYTE_OFFSET + byte for byte in range(256)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: the text stays one piece, so the no-merge BPE maps it byte by byte, spaces included.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    bos, eos = SPECIAL_TOKENS.index(BOS_TOKEN), SPECIAL_TOKENS.index(EOS_TOKEN)
    end = f" {EOS_TOKEN}" if add_eos_token else ""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A{end}",
        pair=f"{BOS_TOKEN} $A {EOS_TOKEN} $B:1{end}:1" if add_eos_token else f"{BOS_TOKEN} $A {EOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos), (EOS_TOKEN, eos)],
    )
    return tokenizer


def byte_tokenizer(
    model_max_length: int = 4096, padding_side: str = "right", add_eos_token: bool = True
) -> PreTrainedTokenizerFast:
    """A byte-level `PreTrainedTokenizerFast` (260 ids, see the module docstring), built offline.

    Args:
        model_max_length: Longest input the model accepts (`LongAttnConfig.max_position_embeddings`); truncation
            and the tokenizer's length warnings use it.
        padding_side: `"right"` for training; `"left"` for batched generation with a causal LM.
        add_eos_token: End every encoded text with `</s>` (encoders, seq2seq); `False` for decoder-only models,
            whose prompts must not end the text before generation starts.

    Returns:
        A fast tokenizer whose `save_pretrained` writes a `tokenizer.json` that loads with `AutoTokenizer` and no
        custom code.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer_object(add_eos_token),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=model_max_length,
        padding_side=padding_side,
    )


UNK_TOKEN = "<unk>"
WORD_SPECIAL_TOKENS = (*SPECIAL_TOKENS, UNK_TOKEN)  # ids 0-4 of a word-level tokenizer


def word_level_tokenizer(
    words: Sequence[str], model_max_length: int = 4096, padding_side: str = "right"
) -> PreTrainedTokenizerFast:
    """A tokenizer for texts of whitespace-separated words from a closed vocabulary (ListOps: the digits, the
    operators and `]`), one token per word, built offline.

    Ids: `<pad>` 0, `<s>` 1, `</s>` 2, `<mask>` 3 (as the byte tokenizer, hence `LongAttnConfig`'s defaults),
    `<unk>` 4, then `words` in order. Encoding frames a text as `<s> ... </s>` (`<s>` is the classification token,
    `cls_token`; `</s>` the `sep_token`); decoding joins the words with single spaces.

    Args:
        words: The vocabulary, distinct, none containing whitespace or equal to a special token.
        model_max_length / padding_side: As in `byte_tokenizer`.

    Returns:
        A fast tokenizer (a `tokenizers` WordLevel model after a whitespace split) whose `save_pretrained` folder
        loads with `AutoTokenizer.from_pretrained` and no custom code.

    Raises:
        ValueError: a repeated word, a word with whitespace, an empty word or a special token among `words`.
    """
    words = list(words)
    bad = [word for word in words if not word or word.split() != [word] or word in WORD_SPECIAL_TOKENS]
    if bad or len(set(words)) != len(words):
        raise ValueError(
            f"words={bad or words!r} is invalid: expected distinct, non-empty words without whitespace, none of "
            f"{list(WORD_SPECIAL_TOKENS)}."
        )
    vocab = {token: index for index, token in enumerate((*WORD_SPECIAL_TOKENS, *words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split on whitespace only: `Whitespace` would also cut "[MAX" into "[" and "MAX".
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in WORD_SPECIAL_TOKENS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A {EOS_TOKEN}",
        pair=f"{BOS_TOKEN} $A {EOS_TOKEN} $B:1 {EOS_TOKEN}:1",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN]), (EOS_TOKEN, vocab[EOS_TOKEN])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        cls_token=BOS_TOKEN,
        sep_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        padding_side=padding_side,
    )


__all__ = [
    "byte_tokenizer",
    "byte_tokenizer_object",
    "word_level_tokenizer",
    "BYTE_OFFSET",
    "VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "WORD_SPECIAL_TOKENS",
]
