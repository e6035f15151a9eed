"""Kernel choice: the preference order, SAGE_KERNELS, and each kernel's stated reason for refusing inputs."""
import pytest
import torch
import torch.nn.functional as F

from helpers import random_qkv
from sage_compile import kernels
from sage_compile.kernels import dispatch
from sage_compile.numerics import spec
from sage_compile.kernels import KERNEL_MODULES, KernelArgs, mask_problem


def _cpu_args(head_dim=64):
    q, k, v = (torch.randn(1, 2, 8, head_dim, dtype=torch.bfloat16) for _ in range(3))
    p = spec.prepare(q, k, v, head_dim ** -0.5, spec.Scheme())
    return KernelArgs.from_prepared(p, None, 0, head_dim, torch.bfloat16)


def test_default_order_is_by_measured_speed():
    assert dispatch.kernel_order() == KERNEL_MODULES
    names = [n.rsplit(".", 1)[-1] for n in KERNEL_MODULES]
    assert names.index("sm90") < names.index("triton")  # sm90 measured faster at both head dims


def test_sage_kernels_pins_order_and_rejects_unknown(monkeypatch):
    monkeypatch.setenv("SAGE_KERNELS", "reference, cpu")
    assert [n.rsplit(".", 1)[-1] for n in dispatch.kernel_order()] == ["reference", "cpu"]
    module, _ = dispatch.choose(_cpu_args())
    assert module.NAME == "reference"
    site = _cpu_args().site
    assert dispatch.kernel_for_site(site)[0] == "reference"
    monkeypatch.setenv("SAGE_KERNELS", "cpu")
    assert dispatch.kernel_for_site(site)[0] == "cpu"  # not cached across
    monkeypatch.setenv("SAGE_KERNELS", "cpu,warp_drive")
    with pytest.raises(ValueError, match="warp_drive"):
        dispatch.kernel_order()


def test_cpu_inputs_get_the_cpu_kernel_with_reasons_from_gpu_kernels():
    module, reasons = dispatch.choose(_cpu_args())
    assert module.NAME == "cpu"
    assert "CUDA" in reasons["triton"] or "Triton is not installed" in reasons["triton"]
    assert "CUDA" in reasons["sm90"] or "not built" in reasons["sm90"]


def test_mask_problem_names_what_breaks_the_contract():
    """The GPU kernels' shared mask check (kernels.mask_problem): [B|1, Hq|1, Nq|1, Nk], bool or fp32."""
    import dataclasses

    args = _cpu_args()  # B=1, Hq=2, Nq=Nk=8
    for good in (torch.ones(1, 2, 8, 8, dtype=torch.bool), torch.zeros(1, 1, 1, 8), torch.zeros(1, 2, 1, 8)):
        assert mask_problem(dataclasses.replace(args, attn_mask=good)) is None
    for bad, words in ((torch.zeros(1, 2, 8, 8, dtype=torch.float16), "bool or float32"),
                       (torch.zeros(2, 8, 8), "4-D"), (torch.zeros(1, 2, 2, 8), "does not fit"),
                       (torch.zeros(1, 3, 8, 8), "does not fit"), (torch.zeros(1, 2, 8, 7), "does not fit")):
        assert words in mask_problem(dataclasses.replace(args, attn_mask=bad)), bad.shape


def test_sm90_refuses_cpu_tensors_when_built():
    try:
        from sage_compile.kernels import sm90
    except ImportError:  # the extension is built only where nvcc and a Hopper GPU (or SAGE_CUDA_ARCHS) exist
        pytest.skip("sage_compile._sm90 not built here")
    assert "CUDA" in sm90.supports(_cpu_args().site)
    with pytest.raises(ValueError):
        kernels.run(sm90, _cpu_args(), torch.empty(1, 2, 8, 64, dtype=torch.bfloat16), torch.empty(1, 2, 8))


def test_supports_is_pure_and_speaks_of_the_scheme():
    """Each family decides from the site alone (no tensors): the reasons name the scheme's fields."""
    from sage_compile.kernels import KernelSite, cpu, reference

    site = KernelSite(spec.Scheme(), torch.device("cpu"), torch.bfloat16, 64)
    assert cpu.supports(site) is None and reference.supports(site) is None
    name, reasons = dispatch.kernel_for_site(site)
    assert name == "cpu" and set(reasons) <= {"sm90", "sm89", "triton"}


def test_thresholds_follow_the_k_granularity(monkeypatch):
    """per_thread K runs a faster sm90 instantiation, with its own measured table; CPU never waits."""
    from sage_compile.kernels import thresholds

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    for key in thresholds.MEASURED:
        _, d, causal = key
        assert thresholds.min_seq_len(cuda, d, causal) == thresholds.MEASURED[key]
        assert thresholds.min_seq_len(cuda, d, causal, "per_thread") == thresholds.MEASURED_PER_THREAD_K[key]
    # the faster instantiation never starts later, and its own table is the one read (it starts earlier somewhere)
    assert all(thresholds.MEASURED_PER_THREAD_K[key] <= thresholds.MEASURED[key] for key in thresholds.MEASURED)
    assert thresholds.min_seq_len(cuda, 64, False, "per_thread") < thresholds.min_seq_len(cuda, 64, False)
    assert thresholds.min_seq_len(torch.device("cpu"), 128, False, "per_thread") == 0


def test_sites_without_a_fused_producer_read_their_own_thresholds(monkeypatch):
    """A site whose prep is a pass of its own reads MEASURED_STANDALONE eagerly (the fused prep kernels) and
    MEASURED_COMPILED_STANDALONE compiled (Inductor's fusion of the aten prep): neither starts earlier than behind a
    fused producer, the compiled one not earlier than the eager one, and sdpa_is_faster asks for the right one."""
    from sage_compile import SageConfig
    from sage_compile.kernels import thresholds
    from sage_compile.policy.support import AttentionCall, sdpa_is_faster

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    for key, fused in thresholds.MEASURED.items():
        _, d, causal = key
        assert thresholds.min_seq_len(cuda, d, causal, producer="none") == thresholds.MEASURED_STANDALONE[key] >= fused
        assert (thresholds.min_seq_len(cuda, d, causal, "per_thread", producer="none")
                == thresholds.MEASURED_STANDALONE_PER_THREAD_K[key] >= thresholds.MEASURED_PER_THREAD_K[key])
        # compiled, the prep is Inductor's fusion of the aten prep: its own table, never earlier than the eager one
        for granularity, table in (("per_token", thresholds.MEASURED_COMPILED_STANDALONE),
                                   ("per_thread", thresholds.MEASURED_COMPILED_STANDALONE_PER_THREAD_K)):
            assert (thresholds.min_seq_len(cuda, d, causal, granularity, producer="none", compiled=True) == table[key]
                    >= thresholds.min_seq_len(cuda, d, causal, granularity, producer="none"))
    seen = []
    monkeypatch.setattr(thresholds, "min_seq_len",
                        lambda *args, compiled: seen.append((args[-1], compiled)) or 16384)
    q = torch.empty(1, 2, 8192, 128, dtype=torch.bfloat16)
    call = AttentionCall(q, q, q, None, 0.0, False, None, False)
    assert "8192 < 16384" in sdpa_is_faster(call, SageConfig(), producer="none")
    assert "bench eager" in sdpa_is_faster(call, SageConfig(), producer="none")
    with torch._subclasses.FakeTensorMode():  # as a pass sees a compiled site
        fake = torch.empty(1, 2, 8192, 128, dtype=torch.bfloat16)
    assert "bench e2e --producer none" in sdpa_is_faster(AttentionCall(fake, fake, fake), SageConfig(), producer="none")
    assert seen == [("none", False), ("none", False), ("none", True)]


def test_sites_behind_a_qk_norm_read_their_own_thresholds(monkeypatch):
    """A fused producer with a QK-norm (its prep reduces each row before the rotary) has its own table, never earlier
    than the rotary's alone, for either K granularity, and sdpa_is_faster names the measurement it used."""
    from sage_compile import SageConfig
    from sage_compile.kernels import thresholds
    from sage_compile.policy.support import AttentionCall, sdpa_is_faster

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    for key in thresholds.MEASURED:
        _, d, causal = key
        assert (thresholds.min_seq_len(cuda, d, causal, "per_thread", producer="qk_norm")
                == thresholds.MEASURED_QK_NORM_PER_THREAD_K[key] >= thresholds.MEASURED_PER_THREAD_K[key])
        assert (thresholds.min_seq_len(cuda, d, causal, producer="qk_norm")
                == thresholds.MEASURED_QK_NORM[key] >= max(thresholds.MEASURED[key], thresholds.MEASURED_PER_THREAD_K[key]))
    with torch._subclasses.FakeTensorMode():  # a compiled site on a CUDA device, as a pass sees it
        q = torch.empty(1, 2, 8192, 128, dtype=torch.bfloat16, device="cuda")
    call = AttentionCall(q, q, q, None, 0.0, True, None, False)
    assert "8192 < 16384" in sdpa_is_faster(call, SageConfig(), producer="qk_norm")
    assert "qknorm" in sdpa_is_faster(call, SageConfig(), producer="qk_norm")
    assert sdpa_is_faster(call, SageConfig(), producer="rotary") is None  # behind a rotary alone: from 8K


def test_thresholds_of_masked_sites(monkeypatch):
    """A site with an attn_mask has its own measured table: a mask with one row for all queries (key padding)
    from MEASURED_KEY_MASK; an fp32 mask with a row per query never (measured slower); a bool one per query
    the unmasked table."""
    from sage_compile.kernels import thresholds

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    padding = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    for d in (64, 128):
        assert thresholds.min_seq_len(cuda, d, False, mask=padding) == thresholds.MEASURED_KEY_MASK[(9, d)]
        assert thresholds.min_seq_len(cuda, d, False, mask=torch.zeros(64)) == thresholds.MEASURED_KEY_MASK[(9, d)]
        assert thresholds.min_seq_len(cuda, d, False, mask=torch.zeros(2, 1, 64, 64)) == thresholds.NEVER
        expanded = torch.zeros(2, 1, 1, 64).expand(2, 1, 64, 64)  # one row for all queries, stride 0
        assert thresholds.min_seq_len(cuda, d, False, mask=expanded) == thresholds.MEASURED_KEY_MASK[(9, d)]
        full_bool = torch.ones(64, 64, dtype=torch.bool)
        assert thresholds.min_seq_len(cuda, d, False, mask=full_bool) == thresholds.MEASURED[(9, d, False)]
    assert thresholds.min_seq_len(torch.device("cpu"), 128, False, mask=torch.zeros(2, 1, 64, 64)) == 0


def test_masked_threshold_reasons_name_the_mask(monkeypatch):
    """explain()'s reason for a masked site kept as SDPA says which masked measurement decided it (the
    thresholds of a Hopper GPU, asked for meta tensors standing in for CUDA ones)."""
    from sage_compile import SageConfig
    from sage_compile.kernels import thresholds
    from sage_compile.policy.support import AttentionCall, sdpa_is_faster

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real = thresholds.min_seq_len
    monkeypatch.setattr(thresholds, "min_seq_len", lambda device, *a, **k: real(torch.device("cuda"), *a, **k))
    q = torch.empty(1, 2, 1024, 128, device="meta")
    for mask, words in ((torch.zeros(1, 1, 1024, 1024), "every key length for this mask"),
                        (torch.ones(1, 1, 1, 1024, dtype=torch.bool), "key length 1024 < 4096 (sites with a mask "
                                                                      "shared by all queries")):
        reason = sdpa_is_faster(AttentionCall(q, q, q, attn_mask=mask), SageConfig(), producer="rotary")
        assert words in reason and "bench e2e --mask" in reason, reason
    assert "measured on H100" in sdpa_is_faster(AttentionCall(q, q, q), SageConfig(), producer="rotary")


def test_fp16_pv_sites_have_their_own_thresholds(monkeypatch):
    """pv='fp16' runs a slower kernel (half-rate P·V) with its own measured tables — unmasked and key padding —
    and explain() names that measurement; min_seq_len still overrides it; CPU never waits."""
    from sage_compile import SageConfig
    from sage_compile.kernels import thresholds
    from sage_compile.policy.support import AttentionCall, sdpa_is_faster

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    padding = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    for (_, d, causal), threshold in thresholds.MEASURED_PV16.items():
        assert thresholds.min_seq_len(cuda, d, causal, pv="fp16") == threshold
        key_mask = thresholds.MEASURED_PV16_KEY_MASK[(9, d)]
        assert thresholds.min_seq_len(cuda, d, causal, mask=padding, pv="fp16") == key_mask
        assert thresholds.min_seq_len(cuda, d, causal, mask=torch.zeros(2, 1, 64, 64), pv="fp16") == thresholds.NEVER
        assert key_mask >= thresholds.MEASURED_KEY_MASK[(9, d)]  # never earlier than fp8
    assert thresholds.min_seq_len(torch.device("cpu"), 128, False, pv="fp16") == 0
    real = thresholds.min_seq_len
    monkeypatch.setattr(thresholds, "min_seq_len", lambda device, *a, **k: real(cuda, *a, **k))
    q = torch.empty(1, 2, 32768, 128, device="meta")
    reason = sdpa_is_faster(AttentionCall(q, q, q), SageConfig(pv="fp16"), producer="rotary")
    assert "every key length for this pv" in reason and "pv='fp16' measured on the H100" in reason, reason
    assert sdpa_is_faster(AttentionCall(q, q, q), SageConfig(pv="fp16", min_seq_len=0), producer="rotary") is None
    assert sdpa_is_faster(AttentionCall(q, q, q), SageConfig(), producer="rotary") is None  # fp8 at 32K: sage
    padded = torch.ones(1, 1, 1, 32768, dtype=torch.bool)
    padded_call = AttentionCall(q, q, q, attn_mask=padded)
    assert sdpa_is_faster(padded_call, SageConfig(pv="fp16"), producer="rotary") is None  # ≥ 16K
    short = torch.empty(1, 2, 4096, 128, device="meta")
    reason = sdpa_is_faster(AttentionCall(short, short, short, attn_mask=padded[..., :4096]), SageConfig(pv="fp16"),
                            producer="rotary")
    assert "key length 4096 < 16384" in reason and "pv='fp16' measured" in reason, reason


def test_an_emulating_kernel_is_reported(monkeypatch):
    """A family that computes a site in a format its device lacks (the Triton kernel's NVFP4 off Blackwell) says so:
    a warning on the first call, a counter on every call, and explain's kernel column. The CPU kernel stands in."""
    import sage_compile
    from sage_compile import SageConfig, sage_attention
    from sage_compile.kernels import cpu

    monkeypatch.setattr(cpu, "emulation", lambda site: "NVFP4 emulated here" if site.scheme.fp4 else None,
                        raising=False)
    q, k, v = random_qkv(1, 2, 2, 32, 32, 64, seed=1)
    config = SageConfig(qk="fp4", pv="fp4")
    with pytest.warns(UserWarning, match="the cpu kernel runs NVFP4 emulated here"):
        sage_attention(q, k, v, config=config)
    sage_attention(q, k, v, config=config)
    sage_attention(q, k, v)  # the 8-bit default: not emulated
    assert torch._dynamo.utils.counters["sage"]["emulated"] == 2
    explained = sage_compile.explain(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v, config=config)
    assert explained.sites[0].kernel == "cpu (NVFP4 emulated here)"


def test_nvfp4_sites_have_no_threshold(monkeypatch):
    """NVFP4 is not measured (on sm90 it is an emulation, asked for its numerics): no key length keeps it on SDPA."""
    from sage_compile.kernels import thresholds

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert thresholds.min_seq_len(torch.device("cuda"), 128, False, pv="fp4") == 0
    assert thresholds.min_seq_len(torch.device("cuda"), 128, False) > 0


def test_an_unknown_producer_is_refused():
    from sage_compile.kernels import thresholds

    with pytest.raises(ValueError, match="producer='rope'"):
        thresholds.min_seq_len(torch.device("cpu"), 128, False, producer="rope")


def test_a_call_laid_out_as_an_earlier_one_skips_the_checks(monkeypatch):
    """The plan cache: the contract is checked and the family chosen once per call signature; a call with another
    layout, dtype or kernel order is checked again, so a bad call is still refused after a good one."""
    import dataclasses

    checked = []
    monkeypatch.setattr(dispatch, "check_inputs", lambda *a: checked.append(1) or kernels.check_inputs(*a))
    args = _cpu_args()
    out, lse = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16), torch.empty(1, 2, 8)
    fresh = _cpu_args()  # new tensors, the same signature
    assert dispatch.run(args, out, lse) == "cpu" and dispatch.run(fresh, out, lse) == "cpu"
    assert len(checked) == 1
    expected, _ = spec.quantized_attention_reference(**{f.name: getattr(fresh, f.name)
                                                        for f in dataclasses.fields(fresh)})
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the cached launch read the new call's tensors
    with pytest.raises(ValueError, match="k_scale has shape"):
        dispatch.run(dataclasses.replace(args, k_scale=args.k_scale[..., :4]), out, lse)
    with pytest.raises(ValueError, match="out.dtype"):
        dispatch.run(args, out.float(), lse)
    monkeypatch.setenv("SAGE_KERNELS", "reference")
    assert dispatch.run(args, out, lse) == "reference"
    assert len(checked) == 4
