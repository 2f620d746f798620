"""The offloading runtime's Triton programs (infinigen/offload/kernels.py) against the torch code they replace,
run through Triton's interpreter on a CPU: the same function on random inputs, every output element written."""

import importlib

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture
def kernels(monkeypatch):
    """The kernels module with its programs built for Triton's interpreter (it reads TRITON_INTERPRET when a
    program is decorated), restored afterwards."""
    from infinigen.offload import kernels as module

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(module)
    yield module
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(module)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,group,d", [(4, 64, 128), (2, 64, 64), (8, 32, 64), (4, 16, 32)])
def test_fused_dequantisation_equals_the_codec(kernels, dtype, bits, group, d):
    from baselines.quant import QuantCodec
    from infinigen.offload.codecs import head_major, token_major

    gen = torch.Generator().manual_seed(bits * 100 + d)
    b, hk, n = 2, 3, 37
    k, v = (torch.randn(b, hk, n, d, generator=gen).to(dtype) * 3 for _ in range(2))
    codec = QuantCodec(d, bits, group, dtype)
    rows = token_major(codec.encode(k, v))  # (n, b*hk, W) uint8, as the pool holds them
    assert kernels.dequantize_supported(d, bits, codec.codes, codec.params, codec.width)
    want_k, want_v = codec.decode(head_major(rows, b, hk))
    got_k, got_v = kernels.dequantize_pool(rows, b, hk, d, bits, group, codec.codes, codec.params, dtype)
    assert got_k.is_contiguous() and got_k.dtype == dtype
    # bit-identical, but for bfloat16 under the interpreter: numpy has no bfloat16, and its float32 -> bfloat16
    # drops bits where a GPU (and torch) round to nearest: one unit in the last place
    rtol = 2**-7 if dtype == torch.bfloat16 else 0
    torch.testing.assert_close(got_k, want_k, atol=0, rtol=rtol)
    torch.testing.assert_close(got_v, want_v, atol=0, rtol=rtol)


def test_codec_takes_the_fused_pass_where_it_runs(kernels, monkeypatch):
    """QuantCodec.decode_pool calls the program where kernels.available() says it runs, the torch path
    elsewhere: the two give the same K, V."""
    from baselines.quant import QuantCodec
    from infinigen.offload.codecs import token_major

    codec = QuantCodec(64, 4, 64, torch.float16)
    k, v = (torch.randn(1, 2, 9, 64).half() for _ in range(2))
    rows = token_major(codec.encode(k, v))
    fused, calls = kernels.dequantize_pool, []
    monkeypatch.setattr(kernels, "dequantize_pool", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    via_program = codec.decode_pool(rows, 1, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # available() is False for CPU tensors again
    via_torch = codec.decode_pool(rows, 1, 2)
    assert calls == [1]
    for a, b in zip(via_program, via_torch):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("width", [16, 24, 300])
def test_zero_copy_gather_writes_exactly_the_valid_rows(kernels, width):
    gen = torch.Generator().manual_seed(width)
    pool = torch.randn(500, width, generator=gen).half()
    bh, k = 5, 40
    src = torch.randint(0, 500, (bh, k), generator=gen)
    valid = torch.arange(k) < torch.randint(0, k + 1, (bh, 1), generator=gen)
    out = torch.full((bh * k, width), float("nan"), dtype=pool.dtype)  # poisoned: unwritten rows stay NaN
    kernels.gather_rows(pool, src.int(), valid, out)
    got = out.view(bh, k, width)
    torch.testing.assert_close(got[valid], pool[src[valid]], atol=0, rtol=0)
    assert got[~valid].isnan().all()


@pytest.mark.parametrize("method", ["infinigen", "oracle"])
def test_zero_copy_gather_runs_the_same_decode(kernels, method):
    """The runtime with gather=zero_copy (the rows read by a device program; here Triton's interpreter on the
    CPU, the CUDA code path with copies) gives the host gather's logits and moves the same bytes."""
    from conftest import load_model, method_from_conf, random_ids
    from infinigen.offload.runtime import teacher_forced_logits

    model, _ = load_model("tiny-llama-gqa")
    ids = random_ids(40, model.config.vocab_size, batch=2)
    ref, a = teacher_forced_logits(model, method_from_conf(method), ids, 32)
    out, b = teacher_forced_logits(model, method_from_conf(method), ids, 32, copies=True, gather="zero_copy")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert sum(a.h2d_bytes) == sum(b.h2d_bytes)


# ----------------------------------------------------------------------------------------------- on a GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_dequantisation_on_cuda_is_bit_identical(dtype):
    from baselines.quant import QuantCodec
    from infinigen.offload import kernels
    from infinigen.offload.codecs import head_major, token_major

    b, hk, n, d = 4, 8, 1000, 128
    k, v = (torch.randn(b, hk, n, d, device="cuda").to(dtype) * 3 for _ in range(2))
    codec = QuantCodec(d, 4, 64, dtype)
    rows = token_major(codec.encode(k, v))
    want = codec.decode(head_major(rows, b, hk))
    got = kernels.dequantize_pool(rows, b, hk, d, 4, 64, codec.codes, codec.params, dtype)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.gpu
@cuda
def test_zero_copy_gather_reads_a_pinned_pool_on_cuda():
    from infinigen.offload import kernels

    pool = torch.randn(100_000, 256).half().pin_memory()
    bh, k = 64, 100
    src = torch.randint(0, pool.shape[0], (bh, k), device="cuda")
    valid = torch.arange(k, device="cuda") < torch.randint(0, k + 1, (bh, 1), device="cuda")
    out = torch.full((bh * k, 256), float("nan"), dtype=pool.dtype, device="cuda")
    kernels.gather_rows(pool, src.int(), valid, out)
    got = out.view(bh, k, 256)
    torch.testing.assert_close(got[valid].cpu(), pool[src[valid].cpu()], atol=0, rtol=0)
    assert got[~valid].isnan().all()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method,kwargs", [("infinigen", {}), ("infinigen", {"gather": "zero_copy"}),
                                           ("h2o", {}), ("quant", {}), ("offload", {})])
def test_runtime_on_cuda_in_half_precision_equals_decode_mode(method, kwargs):
    """The CUDA runtime (streams, pinned pools, gather threads, fused kernels) in float16 gives what decode mode
    gives on the same GPU (the same selections: rounding of a few ulps between the two paths' kernels)."""
    from conftest import model_cfg, random_ids
    from infinigen import adapter, modes
    from infinigen.offload.runtime import teacher_forced_logits

    model, _ = adapter.load(model_cfg("tiny-llama-gqa", dtype="float16"), device="cuda")
    ids = random_ids(200, model.config.vocab_size, batch=4).cuda()
    from conftest import method_from_conf

    dec, report = teacher_forced_logits(model, method_from_conf(method), ids, 160, **kwargs)
    ref = modes.decode_logits(model, method_from_conf(method), ids, dense_rows=160)
    diff = (dec.float().log_softmax(-1) - ref.float().log_softmax(-1)).abs().max()
    assert diff < 2e-2, float(diff)
