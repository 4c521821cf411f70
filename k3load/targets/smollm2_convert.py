"""Turn SmolLM2-135M-Instruct's GGUF file into an ordinary safetensors checkpoint vLLM can serve.

Run as a script by the *vLLM* venv's python (it imports torch and transformers, and needs the
``gguf`` and ``accelerate`` packages that ``real_model.ensure_conversion_deps`` installs there)::

    <vllm-venv>/bin/python smollm2_convert.py GGUF_FILE OUT_DIR

Why convert instead of serving the GGUF: vLLM's GGUF loader wants the original tokenizer from a
model hub, and none can be reached here. transformers reads the llama-architecture GGUF (weights
and tokenizer) offline and de-quantizes the Q4_1 tensors while loading. The loaded model still
carries its GGUF quantizer, and ``save_pretrained`` refuses such a model ("quantized with GGUF and
is not serializable"); the weights are already plain float32 tensors by then, so dropping the
quantizer's traces lets it save a float32 ``LlamaForCausalLM`` (517 MB, 134.5M parameters).
``real_model.build_real_model`` caches the result by a hash of this file and the pinned inputs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def load(gguf_file: Path):  # -> (transformers model, tokenizer); imported lazily
    """Model and tokenizer from the GGUF file, de-quantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)  # nothing random should be drawn; this keeps it so if something is
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model, tokenizer


def drop_quantizer(model) -> None:
    """Make a de-quantized GGUF model look like an ordinary one so ``save_pretrained`` accepts it."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def main(argv: list[str]) -> int:
    """Convert into OUT_DIR (which must not exist yet; the caller renames it into place)."""
    if len(argv) != 3:
        print("usage: smollm2_convert.py GGUF_FILE OUT_DIR", file=sys.stderr)
        return 2
    gguf_file, out = Path(argv[1]), Path(argv[2])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model, tokenizer = load(gguf_file)
    drop_quantizer(model)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"converted {gguf_file.name}: {type(model).__name__}, {n_params} parameters, "
          f"vocab {len(tokenizer)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
