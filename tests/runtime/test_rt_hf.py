"""Hugging Face models (`model.hf`): the planner's parameter count is transformers' own, bad model directories
are located recipe errors, and the runtime fine-tunes a tiny model from local safetensors weights on 2 real
gloo ranks with FSDP2 and with DeepSpeed ZeRO, exporting a directory `from_pretrained` loads back.

The configs are made here with transformers' own config classes (no hub access); the real-size ones carry
the published values of Llama 3 8B, Mistral 7B v0.1 and Qwen2 7B.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from launcher.errors import RecipeError
from launcher.plan import make_plan
from launcher.recipe import load
from rt_harness import load_safetensors, recipe_dict, run_torchrun, write_plan

TINY = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)
CONFIGS = {
    "llama-tiny": (transformers.LlamaConfig, TINY),
    "llama-tiny-biases": (transformers.LlamaConfig, {**TINY, "attention_bias": True, "mlp_bias": True}),
    "mistral-tiny": (transformers.MistralConfig, TINY),
    "qwen2-tiny-tied": (transformers.Qwen2Config, {**TINY, "tie_word_embeddings": True}),
    "llama3-8b": (
        transformers.LlamaConfig,
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
            max_position_embeddings=8192,
        ),
    ),
    "mistral-7b": (
        transformers.MistralConfig,
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
        ),
    ),
    "qwen2-7b": (
        transformers.Qwen2Config,
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
        ),
    ),
}


def config_dict(name: str) -> dict:
    cls, kw = CONFIGS[name]
    return json.loads(cls(**kw).to_json_string())


def model_dir(tmp: Path, name: str, weights: bool = True, seed: int = 0) -> Path:
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = config_dict(name)
    (d / "config.json").write_text(json.dumps(cfg))
    if weights:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
        model.save_pretrained(d, safe_serialization=True)
    return d


def recipe_file(tmp: Path, model: dict, **over) -> Path:
    doc = {
        "name": "hf",
        "model": model,
        "resources": {"accelerator": "cpu:2"},
        "training": {"steps": 2, "micro_batch": 2},
        **over,
    }
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planned_parameters_equal_transformers(tmp_path, name):
    d = model_dir(tmp_path, name, weights=False)
    plan = make_plan(load(recipe_file(tmp_path, {"hf": d.name})))
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config_dict(name)))
    assert plan.params == sum(p.numel() for p in built.parameters())  # tied weights counted once, as transformers does


def test_relative_paths_start_at_the_recipe_and_the_config_travels_in_the_plan(tmp_path, monkeypatch):
    d = model_dir(tmp_path / "models", "qwen2-tiny-tied")
    p = recipe_file(tmp_path, {"hf": "models/qwen2-tiny-tied"})
    monkeypatch.chdir("/")
    r = load(p)
    assert r.model.hf == str(d) and r.model.hf_weights == str(d)  # it holds weights: fine-tuning by default
    assert r.model.hf_config["model_type"] == "qwen2" and r.model.shape().tied_embeddings
    assert r.model.shape().seq_len == 128  # max_position_embeddings, below the 4096 default cap
    r2 = load(recipe_file(tmp_path, {"hf": "models/qwen2-tiny-tied", "seq_len": 64}))
    assert r2.model.shape().seq_len == 64


@pytest.mark.parametrize(
    "setup, words",
    [
        (lambda d: None, "not a directory"),
        (lambda d: d.mkdir(), "config.json not found"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{nope")), "is not JSON"),
        (
            lambda d: (
                d.mkdir(),
                (d / "config.json").write_text(json.dumps({**config_dict("llama-tiny"), "model_type": "gpt2"})),
            ),
            "model_type 'gpt2' is not a decoder",
        ),
        (
            lambda d: (
                d.mkdir(),
                (d / "config.json").write_text(json.dumps({**config_dict("llama-tiny"), "head_dim": 32})),
            ),
            "head_dim 32 differs",
        ),
        (
            lambda d: (
                d.mkdir(),
                (d / "config.json").write_text(json.dumps({**config_dict("llama-tiny"), "num_hidden_layers": "two"})),
            ),
            "num_hidden_layers must be a positive whole number",
        ),
    ],
)
def test_bad_model_directories_are_located_errors(tmp_path, setup, words):
    setup(tmp_path / "m")
    p = recipe_file(tmp_path, {"hf": "m"})
    with pytest.raises(RecipeError) as e:
        load(p)
    text = str(e.value)
    assert words in text and f"{p}:" in text and "model.hf" in text


def test_hf_with_a_shape_is_refused(tmp_path):
    model_dir(tmp_path, "llama-tiny", weights=False)
    with pytest.raises(RecipeError, match="model.hf gives the whole shape; remove preset"):
        load(recipe_file(tmp_path, {"hf": "llama-tiny", "preset": "tiny"}))


def hf_run_recipe(d: Path, strategy: str, **training) -> dict:
    return recipe_dict(
        model={"preset": None, "seq_len": None, "hf": str(d)},
        parallelism={"strategy": strategy},
        training={"steps": 4, "micro_batch": 2, "global_batch": 8, **training},
        checkpoint={"every": 100, "export": "safetensors"},
    )


def pretrained(d: Path) -> dict[str, torch.Tensor]:
    return load_safetensors(d / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_fine_tunes_from_local_weights_with_fsdp2_and_zero(tmp_path, strategy):
    d = model_dir(tmp_path, "qwen2-tiny-tied", seed=123)
    rec = hf_run_recipe(d, strategy)
    rec["model"] = {k: v for k, v in rec["model"].items() if v is not None}
    # lr 1e-30 (no update in fp32): the exported weights must be the pretrained ones (zero biases move by 1e-30 at most).
    run = tmp_path / "lr0"
    res = run_torchrun(write_plan(run, deep(rec, training={"lr": 1e-30, "warmup_steps": 0})), run)
    assert res.rc == 0, res.output[-4000:]
    assert "loaded" in res.output and "pretrained weights" in res.output
    out = load_safetensors(run / "hf" / "model.safetensors")
    src = pretrained(d)
    assert set(out) == set(src)
    for k in src:
        torch.testing.assert_close(out[k], src[k], rtol=1e-6, atol=1e-12, msg=k)
    # Training for real: the loss goes down, and transformers loads the exported directory as it is.
    run = tmp_path / "train"
    res = run_torchrun(write_plan(run, deep(rec, training={"steps": 8, "lr": 3e-3})), run)
    assert res.rc == 0, res.output[-4000:]
    losses = res.losses()
    assert losses[8] < losses[1], losses
    back = transformers.AutoModelForCausalLM.from_pretrained(run / "hf")
    assert back.config.model_type == "qwen2"
    assert not torch.equal(back.state_dict()["model.embed_tokens.weight"], src["model.embed_tokens.weight"])


def deep(base: dict, **over) -> dict:
    from rt_harness import deep_merge

    return deep_merge(base, over)
