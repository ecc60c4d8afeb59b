"""Write a small Hugging Face model directory (config.json + model.safetensors) next to this file.

dtlaunch never downloads models: `model.hf` names a local directory, as `save_pretrained` writes it. This
script stands in for one you already have (a checkpoint you trained, or one fetched with
`huggingface-cli download` on a machine with access): a 4-layer Qwen2-style decoder with random weights.

    python examples/hf-finetune/make_model.py        # then: dtlaunch up examples/hf-finetune/recipe.yaml
"""
from pathlib import Path

try:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
except ImportError as e:
    raise SystemExit(f"error: {e}\n  fix: install the hf extra: .venv/bin/pip install -c constraints.txt -e '.[hf]'") from None

config = Qwen2Config(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True)
torch.manual_seed(0)
out = Path(__file__).resolve().parent / "model"
AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
print(f"wrote {out}")
