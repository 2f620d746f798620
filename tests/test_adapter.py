"""`full` through our attention path equals the model's own HF attention; decoding equals HF generate."""

import pytest
import torch

from conftest import TINY, load_model, model_cfg, sample_ids
from baselines.full import Full
from infinigen import adapter, modes

MODELS = TINY + ["tiny-gemma3", pytest.param("smollm2-135m", marks=pytest.mark.slow),
                 pytest.param("gemma3-270m", marks=pytest.mark.slow)]
DECODE_TOL = 2e-4  # fp32 logits of decode steps against HF's own (6x the difference measured on smollm2)


@pytest.mark.parametrize("name", MODELS)
def test_full_sim_and_decode_equal_hf_eager(name):
    model, _ = load_model(name)
    ids = sample_ids(name, 96)
    with torch.inference_mode():
        ref = model(ids).logits.float()  # HF's own eager attention
    assert model.config._attn_implementation == "eager"
    # the exact kernel is transformers' eager math (fused == exact: tests/test_longctx.py)
    sim = modes.sim_logits(model, Full(), ids, dense_rows=80, attention="exact")
    torch.testing.assert_close(sim, ref, atol=1e-5, rtol=0)
    # predictions of 80..95: each decode step is a forward of the whole model on both sides (greedy generation
    # against HF's own generate: test_greedy_decode_equals_hf_generate)
    # decode attends each KV head's query heads as rows of one product (eager repeats the KV heads): the same
    # sums, rounded in another order, which 30 fp32 layers carry to 3.2e-5 on smollm2's logits (tiny: < 1e-5)
    dec = modes.decode_logits(model, Full(), ids, dense_rows=80, attention="exact")
    torch.testing.assert_close(dec, hf_decode_logits(model, ids, 80), atol=DECODE_TOL, rtol=0)


@torch.inference_mode()
def hf_decode_logits(model, ids, prompt):
    """HF's own eager attention, prefill + one token per step with its DynamicCache (the decode-mode reference:
    incremental and whole-sequence forwards round differently)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # the prefill's last row only, as decode mode asks for it (a 1-row LM head rounds unlike a 32-row one)
    out = [model(ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
    for pos in range(prompt, ids.shape[1] - 1):
        out.append(model(ids[:, pos : pos + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, dim=1).float()


@pytest.mark.parametrize("name", MODELS)
def test_greedy_decode_equals_hf_generate(name):
    model, _ = load_model(name)
    prompt = sample_ids(name, 24)
    ours = modes.greedy_generate(model, Full(), prompt, new_tokens=16)
    with torch.inference_mode():
        hf = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(ours, hf)


def test_install_is_undone_on_exit():
    model, _ = load_model("tiny-llama")
    attn = adapter.attention_layers(model)[0].module
    with adapter.install(model, Full(), mode="sim"):
        assert model.config._attn_implementation == adapter.ATTN_NAME
        assert len(attn._forward_pre_hooks) == 1
    assert model.config._attn_implementation == "eager"
    assert len(attn._forward_pre_hooks) == 0
    assert not adapter._BOUND


@pytest.mark.parametrize("name", TINY + ["tiny-gemma3"])
def test_layer_view_reproduces_attention_inputs(name):
    """queries()/keys() from the captured attention input match what the attention function receives (Gemma 3: its
    q/k norms given weights of their own, which random init leaves at zero, i.e. a scale of 1)."""
    model, _ = (adapter.load(model_cfg(name)) if name == "tiny-gemma3" else load_model(name))
    gen = torch.Generator().manual_seed(0)
    for layer in adapter.attention_layers(model):
        for norm in (layer._q_norm, layer._k_norm):
            if norm is not None:
                norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen))
    ids = sample_ids(name, 20)
    seen = {}

    class Spy(Full):
        def forward_attention(self, session, layer, q, k, v, allowed):
            seen[layer.index] = (q, k, session.attn_inputs[layer.index], session.position_embeddings)
            return super().forward_attention(session, layer, q, k, v, allowed)

    modes.sim_logits(model, Spy(), ids)
    for layer in adapter.attention_layers(model):
        q, k, x, pe = seen[layer.index]
        torch.testing.assert_close(layer.queries(x, pe), q)
        torch.testing.assert_close(layer.keys(x, pe), k)


def test_unsupported_architecture_is_refused():
    cfg = model_cfg("tiny-llama", arch={"model_type": "falcon"})
    with pytest.raises(ValueError, match="supported model_type values: .*llama.*opt"):
        adapter.validate_model(cfg)


def test_hub_model_offline_fails_clearly(tmp_path, monkeypatch):
    cfg = model_cfg("opt-13b")  # its hub id, offline (a bad local_path is refused earlier, by validate_model)
    with pytest.raises(adapter.ModelUnavailable, match="not available offline"):
        adapter.load(cfg)


def test_random_init_builds_real_shapes_without_weights():
    cfg = model_cfg("llama-3-8b", random_init=True)
    config = adapter.model_config(cfg)
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (32, 8, 32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_gguf_conversion_is_exact(name, data_dir):
    """adapter.load reads a GGUF model through its one-time float32 conversion: the same tensors, config,
    tokenizer and logits as transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infinigen import models
    from infinigen.corpora import corpus_text

    cfg = model_cfg(name)
    src, extra = models.source(cfg)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager", **extra)
    ref_tok = AutoTokenizer.from_pretrained(src, **extra)
    model, tok = load_model(name)
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # where it was read from, what saving records, and that the loader's weights came from a GGUF
    skip = {"_name_or_path", "dtype", "architectures", "quantization_config"}
    config, ref_config = adapter.model_config(cfg).to_dict(), ref.config.to_dict()
    assert {k: v for k, v in config.items() if k not in skip} == {k: v for k, v in ref_config.items() if k not in skip}
    text = corpus_text("wikitext2", data_dir)[:50000]
    assert tok(text).input_ids == ref_tok(text).input_ids
    assert [tok.bos_token, tok.eos_token, tok.pad_token, tok.chat_template] == \
        [ref_tok.bos_token, ref_tok.eos_token, ref_tok.pad_token or ref_tok.eos_token, ref_tok.chat_template]
    ids = tok(text[:2000], return_tensors="pt").input_ids[:, :128]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ref(ids).logits)
