"""Parameter counts against the released checkpoints' published sizes."""

import pytest

from launcher.catalog import PRESETS
from launcher.plan.params import count_params

# Exact counts of the released weights (sum of tensor sizes in Meta's/HF's checkpoints).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("preset,expected", PUBLISHED.items())
def test_exact_param_counts(preset, expected):
    assert count_params(PRESETS[preset]) == expected


def test_tied_embeddings_count_the_matrix_once():
    from msgspec.structs import replace

    s = PRESETS["tiny"]
    assert count_params(s) - count_params(replace(s, tied_embeddings=True)) == s.vocab * s.hidden


def test_gqa_shrinks_attention():
    from msgspec.structs import replace

    s = PRESETS["llama2-7b"]
    # k and v go from h x h to h x (h/4): saves 2 * h * (h - h/4) per layer
    saved = s.layers * 2 * s.hidden * (s.hidden - s.hidden // 4)
    assert count_params(s) - count_params(replace(s, kv_heads=s.heads // 4)) == saved
