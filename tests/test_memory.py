"""The memory model against its sources: the ZeRO paper's worked example and Korthikanti et al.'s Table 2."""

import pytest

from launcher.catalog import ModelShape
from launcher.plan import make_plan
from launcher.plan.memory import Layout, activation_bytes_per_layer, model_states
from launcher.plan.moments import timeline
from launcher.recipe import load_text

GB = 1e9


def states_gb(strategy, n=7.5e9, dp=64):
    p, g, o = model_states(n, Layout(strategy=strategy, dp=dp, precision="bf16"))
    return (p + g + o) / GB


def test_zero_paper_worked_example():
    # Rajbhandari et al. 2019, Figure 1: 7.5B parameters, Nd = 64, K = 12.
    assert states_gb("ddp") == pytest.approx(120, abs=0.05)
    assert states_gb("zero1") == pytest.approx(31.4, abs=0.05)
    assert states_gb("zero2") == pytest.approx(16.6, abs=0.05)
    assert states_gb("zero3") == pytest.approx(1.88, abs=0.005)


def test_zero_example_through_a_recipe():
    """The same numbers come out of a params-only recipe on 64 GPUs, through the recipe's plan and layout; the
    plan's peak holds at least the states (torch's AdamW adds its step temporary on top for ddp)."""
    for strategy, expected in (("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)):
        r = load_text(f"""
name: zero-example
model: {{params: 7500000000}}
parallelism: {{strategy: {strategy}, offload: none}}
resources: {{accelerator: "A100:8", nodes: 8}}
training: {{steps: 10, global_batch: 64}}
""")
        p = make_plan(r)
        assert sum(model_states(p.params, p.layout)) / GB == pytest.approx(expected, rel=0.01)
        assert p.memory.params + p.memory.grads + p.memory.optimizer >= sum(model_states(p.params, p.layout))


def test_fsdp_full_shard_equals_zero3_states_and_grad_op_keeps_unsharded_weights():
    n, d = 7e9, 8
    full = sum(model_states(n, Layout(strategy="fsdp", dp=d)))
    z3 = sum(model_states(n, Layout(strategy="zero3", dp=d)))
    grad_op = sum(model_states(n, Layout(strategy="fsdp_grad_op", dp=d)))
    assert full == pytest.approx(16 * n / d)
    assert z3 == pytest.approx(16 * n / d)
    assert grad_op == pytest.approx(16 * n / d)
    # reshard_after_forward=False: the bf16 weights of every unit stay gathered from forward to backward,
    # a buffer of the loss, not a state of the optimizer step
    kept = timeline(None, "llama", n, 4096, Layout(strategy="fsdp_grad_op", dp=d))
    assert kept["loss backward"]["buffers"] >= 2 * n
    assert kept["optimizer step"]["buffers"] == 0


def test_offload_moves_optimizer_then_params_off_the_gpu():
    n, d = 7e9, 8
    p, g, o = model_states(n, Layout(strategy="zero3", dp=d, offload="optimizer"))
    assert o == 0 and g == 0 and p == pytest.approx(2 * n / d)
    p, g, o = model_states(n, Layout(strategy="zero3", dp=d, offload="params"))
    assert o == 0 and g == 0 and p == 0


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_offload_keeps_only_16bit_weights_on_the_gpu(strategy):
    """ZeRO-Offload (Ren et al. 2021, sec. 3): with optimizer offload the 16-bit gradients are reduced into host
    memory with the fp32 master weights and Adam's moments; the GPU keeps the 16-bit weights, no fp32 gradient
    partition for the step, and (ZeRO-1/2) one staging buffer the gradients pass through on their way out."""
    from launcher.plan.moments import deepspeed_buffers, units
    from launcher.plan.states import states

    n, d = 7e9, 8
    on = Layout(strategy=strategy, dp=d, offload="none")
    off = Layout(strategy=strategy, dp=d, offload="optimizer")
    s_on, s_off = states(n, on), states(n, off)
    assert s_off.params == s_on.params > 0
    assert s_off.grads == 0 < s_on.grads
    assert s_off.optimizer == 0 < s_on.optimizer
    assert s_off.step_grads == 0 < s_on.step_grads
    shape = ModelShape(layers=32, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=32, vocab=32000, seq_len=4096)
    if strategy != "zero3":
        u = units(shape, "llama", n, off)
        assert deepspeed_buffers(u, off, 2) > deepspeed_buffers(u, on, 2)
    tl_on = timeline(shape, "llama", n, 4096, on)
    tl_off = timeline(shape, "llama", n, 4096, off)
    for m in tl_off:
        assert tl_off[m]["grads"] == 0 and tl_off[m]["optimizer"] == 0, m
    assert max(tl_on[m]["grads"] for m in tl_on) > 0


@pytest.mark.parametrize(
    "strategy, per_param",
    [
        # [ZeRO] mixed-precision Adam: 16-bit weights 2, 16-bit grads 2, fp32 master + two moments 12; ZeRO-3 shards
        # all three over the data-parallel ranks, ZeRO-2 the grads and the optimizer, ZeRO-1 the optimizer
        ("zero3", (2 / 64, 2 / 64, 12 / 64)),
        ("zero2", (2, 2 / 64, 12 / 64)),
        ("zero1", (2, 2, 12 / 64)),
        # torch keeps fp32 weights (the master copy) and fp32 grads, and Adam's two fp32 moments: 4 + 4 + 8
        ("fsdp", (4 / 64, 4 / 64, 8 / 64)),
        ("ddp", (4, 4, 8)),
    ],
)
def test_plan_json_carries_the_model_states_per_gpu(strategy, per_param):
    """`memory.model_states` is what the strategy keeps on a GPU for the whole step, the figure of the ZeRO paper
    and DeepSpeed's estimators, in bytes: for 7.5B parameters on 64 GPUs in bf16, worked out by hand."""
    n = 7_500_000_000
    r = load_text(f"""
name: states
model: {{params: {n}}}
parallelism: {{strategy: {strategy}, offload: none}}
resources: {{accelerator: "A100:8", nodes: 8}}
training: {{steps: 10, global_batch: 64}}
""")
    states = make_plan(r).to_dict()["memory"]["model_states"]
    params, grads, optim = (k * n for k in per_param)
    assert states == pytest.approx(
        {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}, abs=1
    )


def test_model_states_do_not_depend_on_the_peak_moment(tmp_path):
    """Llama 3 8B (8,030,261,248 parameters, the released checkpoint's count) on 8 H100s with FSDP2 reducing once
    per step: at the peak every rank holds the unsharded fp32 gradients (4 bytes a parameter), but the states
    kept for the step are 16 bytes a parameter over 8 GPUs. The plan file carries them back."""
    from launcher import planfile

    n = 8_030_261_248
    r = load_text("""
name: states
model: {preset: llama3-8b, seq_len: 2048}
parallelism: {strategy: fsdp, grad_reduce: once_per_step}
resources: {accelerator: "H100:8"}
training: {micro_batch: 1, global_batch: 64, steps: 10}
""")
    p = make_plan(r)
    assert p.params == n and p.layout.reduces_once_per_step
    states = p.to_dict()["memory"]["model_states"]
    assert states == pytest.approx(
        {"params": 4 * n / 8, "grads": 4 * n / 8, "optimizer": 8 * n / 8, "total": 16 * n / 8}, abs=1
    )
    assert p.memory.grads > 3 * n  # the peak's gradients: unsharded
    (tmp_path / "plan.json").write_text(planfile.dumps(r, p))
    assert planfile.read(tmp_path / "plan.json")[1].memory.model_states == p.memory.model_states


# ----- activations: Korthikanti et al. 2022, Table 2 (GPT layer), independent restatement of the formulas
GPT = ModelShape(layers=96, hidden=12288, ffn_hidden=4 * 12288, heads=96, kv_heads=96, vocab=51200, seq_len=2048)
s, b, h, a = 2048, 1, 12288, 96


@pytest.mark.parametrize(
    "t,sp,ac,expected",
    [
        (1, False, "none", s * b * h * (34 + 5 * a * s / h)),
        (8, False, "none", s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))),
        (8, True, "none", s * b * h / 8 * (34 + 5 * a * s / h)),
        (8, False, "selective", s * b * h * (10 + 24 / 8)),
        (8, True, "selective", s * b * h * 34 / 8),
        (1, False, "full", 2 * s * b * h),
        (8, True, "full", 2 * s * b * h / 8),
    ],
)
def test_korthikanti_table2(t, sp, ac, expected):
    assert activation_bytes_per_layer(GPT, "gpt", s, b, t, sp, ac) == pytest.approx(expected)


def test_korthikanti_gpt3_175b_reduction():
    """The paper's headline: TP+SP+selective needs ~5x less than TP alone for GPT-3 175B-like layers."""
    tp_only = activation_bytes_per_layer(GPT, "gpt", s, b, 8, False, "none")
    best = activation_bytes_per_layer(GPT, "gpt", s, b, 8, True, "selective")
    assert 4 < tp_only / best < 6


def test_llama_layer_derivation():
    """The runtime's Llama block with SDPA (GQA inside the kernel) and recomputing RMSNorms, bf16 under FSDP2:
    norms' inputs and outputs 8sbh, q 2sbh, k and v 4sbh g/a, O 2sbh, fp32 lse 4asb, SwiGLU 8sbf, and the block's
    bf16 copies of the RoPE tables, 2s(h/a); no s^2 terms."""
    sh = ModelShape(layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=128256)
    S, B, H, F, A, G = 8192, 1, 4096, 14336, 32, 8
    expected = 8 * S * B * H + 2 * S * B * H + 4 * S * B * H * G / A + 2 * S * B * H + 8 * S * B * F + 4 * A * S * B
    expected += 2 * S * H / A
    assert activation_bytes_per_layer(sh, "llama", S, B, 1, False, "none") == pytest.approx(expected)
    sel = activation_bytes_per_layer(sh, "llama", S, B, 1, False, "selective")
    assert expected - sel == pytest.approx(4 * S * B * F)
    assert activation_bytes_per_layer(sh, "llama", S, B, 1, False, "full") == pytest.approx(2 * S * B * H)
    # flash attention never stores the s x s scores: far below a GPT layer of the same width at long s
    gpt_like = activation_bytes_per_layer(sh, "gpt", S, B, 1, False, "none")
    assert activation_bytes_per_layer(sh, "llama", S, B, 1, False, "none") < gpt_like / 5


def test_activation_orderings():
    sh = ModelShape(layers=32, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=32, vocab=32000)
    f = lambda t=1, sp=False, ac="none": activation_bytes_per_layer(sh, "llama", 4096, 1, t, sp, ac)  # noqa: E731
    assert f(ac="full") < f(ac="selective") < f()
    assert f(t=8, sp=True) < f(t=8) < f()
    # linear in the micro-batch, but for the per-block RoPE table copies, which do not depend on it
    per_sequence = activation_bytes_per_layer(sh, "llama", 4096, 1, 1, False, "none", cast_inputs=False)
    assert activation_bytes_per_layer(sh, "llama", 4096, 2, 1, False, "none", cast_inputs=False) == pytest.approx(
        2 * per_sequence
    )


def test_pipeline_first_stage_holds_all_layers_worth():
    """1F1B: the first stage keeps pp micro-batches of L/pp layers = L layers' worth (paper sec. 4.2.3), plus its
    output of each micro-batch in flight (kept by torch's stage for its backward). 32 blocks + the embedding and
    the head in 4 stages: the first holds the embedding and 8 blocks."""
    from launcher.plan.memory import activations

    sh = ModelShape(layers=32, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=32, vocab=32000)
    one = activations(sh, "llama", 4096, Layout(strategy="fsdp", dp=1, pp=1, grad_accum=8))
    four = activations(sh, "llama", 4096, Layout(strategy="fsdp", dp=1, pp=4, grad_accum=8))
    assert four == pytest.approx(one + 4 * 2 * 4096 * 4096)
