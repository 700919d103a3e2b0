"""A byte-level BPE tokenizer trained on local text, wrapped for transformers.

Byte-level BPE (GPT-2's scheme) covers any input with no unknown token. The
wrapped tokenizer adds ``<|bos|>`` in front of every encoded text (as Llama's
tokenizer does; the target is trained on ``<|bos|> document <|eos|>``) and
carries a chat template whose assistant turns are ``{% generation %}`` blocks,
so ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks the
tokens a draft trainer puts its loss on.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from draftsmith.proposers.core.errors import InputError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, *(f"<|{role}|>" for role in ROLES), END_OF_TURN]

# <|role|>\n content <|end|>\n per message; the assistant's content and <|end|>
# are the generation (loss) tokens. add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + '; valid roles: system, user, assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts``.

    Args:
        texts: training documents (the train split only, never held-out text).
        vocab_size: total vocabulary, special tokens and the 256 bytes included.
        min_frequency: a pair must occur this often to be merged.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise InputError(f"vocab_size={vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    return tokenizer


def wrap(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` with bos / eos / pad and the chat template set.

    Args:
        tokenizer: a trained ``tokenizers.Tokenizer`` holding ``SPECIAL_TOKENS``.
        model_max_length: the context length the model is trained on.
    """
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tokenizer(
    texts: Iterable[str], vocab_size: int, model_max_length: int, out_dir: str | Path | None = None
) -> PreTrainedTokenizerFast:
    """Train, wrap and (when ``out_dir`` is given) ``save_pretrained`` a tokenizer.

    Args:
        texts: training documents.
        vocab_size: total vocabulary size.
        model_max_length: the context length the model is trained on.
        out_dir: directory that ``AutoTokenizer.from_pretrained`` can load afterwards.
    """
    wrapped = wrap(train_bpe(texts, vocab_size), model_max_length)
    if out_dir is not None:
        wrapped.save_pretrained(str(out_dir))
    return wrapped
