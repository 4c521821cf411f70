"""Build a tiny random-weight Qwen2 chat model that vLLM can serve on a CPU.

Run as a script by the *vLLM* venv's python (it imports torch, transformers and tokenizers, which
the harness venv never has)::

    <vllm-venv>/bin/python tiny_model.py OUT_DIR

No weights can be downloaded on the machines this runs on, so the model is made here: a
``Qwen2ForCausalLM`` (hidden 256, 4 layers, 4 heads, 2 KV heads, ~3.4M parameters, 14 MB float32)
and a byte-level BPE tokenizer trained in-process on a fixed list of Python stdlib sources. Every
source of randomness is seeded so two builds are byte-identical; ``vllm_install.build_tiny_model``
caches the result by a hash of this file's source, so any change here rebuilds.

The chat template is Qwen2.5/Hermes style (``<tool_call>`` / ``<tool_response>`` tags), which is
what vLLM's ``hermes`` tool parser expects; the tags are added tokens so the parser finds them in
the vocabulary.
"""

from __future__ import annotations

import os
import random
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not "special": they must survive detokenisation so the hermes parser can see them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS_MODULES = [
    "argparse.py",
    "textwrap.py",
    "string.py",
    "functools.py",
    "collections/__init__.py",
    "dataclasses.py",
    "enum.py",
    "pathlib.py",
    "shutil.py",
    "json/__init__.py",
    "json/encoder.py",
    "json/decoder.py",
    "http/client.py",
    "email/message.py",
    "logging/__init__.py",
    "csv.py",
]
SEED = 1234

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def corpus() -> list[str]:
    """Read the fixed training texts; a missing module is an error, not a silent smaller corpus."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_MODULES]


def train_tokenizer():  # -> transformers.PreTrainedTokenizerFast (imported lazily)
    """Train a byte-level BPE on the corpus with all 256 bytes in the initial alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    fast.add_tokens(TOOL_TOKENS)
    return fast


def build_model(tokenizer):  # -> transformers.Qwen2ForCausalLM
    """A seeded random-weight Qwen2 sized to the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.do_sample = False
    return model


def main(argv: list[str]) -> int:
    """Build into OUT_DIR (which must not exist yet; the caller renames it into place)."""
    if len(argv) != 2:
        print("usage: tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(SEED)
    tokenizer = train_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built tiny model: {n_params} parameters, vocab {len(tokenizer)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
