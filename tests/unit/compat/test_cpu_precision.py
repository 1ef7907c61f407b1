"""bf16 on a CPU without native bf16 computes in fp32 (fsdp_recipes.compat.cpu_fsdp.choose_cpu_precision), says so in
one line and in fsdp_report.json; --cpu_bf16 true keeps bf16; CPUs with native bf16 and accelerators keep it. (The
same in real runs: tests/integration/test_cpu_runs.py.)"""

from __future__ import annotations

import pytest

from fsdp_recipes.compat import cpu_fsdp
from fsdp_recipes.compat.cpu_fsdp import choose_cpu_precision, cpu_name, native_bf16
from fsdp_recipes.errors import RecipeError

# Abridged /proc/cpuinfo texts of real machines (the first processor; the lines that matter, in their order).
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 ssse3 fma avx f16c avx2 bmi2 sha_ni vaes vpclmulqdq rdpid fsrm
"""
ICELAKE_AVX512 = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bitalg
"""
ZEN4_AVX512_BF16 = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni avx512_bitalg
"""
SAPPHIRE_RAPIDS_AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse avx avx2 avx512f avx512bw avx512vl avx512_vnni amx_bf16 amx_tile amx_int8
"""
NEOVERSE_N1 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""
NEOVERSE_V1 = (
    "processor\t: 0\n"
    "BogoMIPS\t: 2100.00\n"
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
    "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm "
    "bf16 dgh rng\n"
    "CPU implementer\t: 0x41\n"
    "CPU part\t: 0xd40\n"
)
POWER9 = """processor\t: 0
cpu\t\t: POWER9, altivec supported
clock\t\t: 2300.000000MHz
"""


@pytest.mark.parametrize(
    "text, expected",
    [
        (EPYC_AVX2, False),
        (ICELAKE_AVX512, False),
        (ZEN4_AVX512_BF16, True),
        (SAPPHIRE_RAPIDS_AMX, True),
        (NEOVERSE_N1, False),
        (NEOVERSE_V1, True),
        (POWER9, None),
        ("", None),
    ],
    ids=[
        "x86-avx2",
        "x86-avx512-no-bf16",
        "x86-avx512_bf16",
        "x86-amx_bf16",
        "arm-no-bf16",
        "arm-bf16",
        "power",
        "none",
    ],
)
def test_native_bf16_from_cpuinfo(text, expected):
    assert native_bf16(text) is expected


def test_only_whole_instruction_names_count():
    assert native_bf16("flags\t\t: avx2 avx512_bf16x xavx512_bf16\n") is False
    # SVE's bf16 alone is not the base BF16 feature
    assert native_bf16("Features\t: fp asimd svebf16\n") is False


def test_cpu_name():
    assert cpu_name(EPYC_AVX2) == "AMD EPYC 7B13"
    # Arm has no model name: the machine's architecture stands in
    assert cpu_name(NEOVERSE_V1)


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(cpu_fsdp, "accelerator_present", lambda: False)
    # the decision is per process: none left to other tests
    monkeypatch.setattr(cpu_fsdp, "_CPU_PRECISION", None)


def test_bf16_from_the_launcher_computes_in_fp32_without_native_bf16(no_accelerator):
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    decision = choose_cpu_precision(False, False, env=env, cpuinfo=EPYC_AVX2)
    assert env["ACCELERATE_MIXED_PRECISION"] == "no" and decision.mixed_precision == "no"
    assert decision.line() == (
        "bf16 mixed precision (accelerate's mixed_precision: bf16) computes in fp32 here: this CPU (AMD EPYC "
        "7B13) has no "
        "native bf16 instructions (no avx512_bf16 or amx_bf16 in /proc/cpuinfo's flags), so bf16 runs many "
        "times slower "
        "than fp32; --cpu_bf16 true keeps bf16"
    )
    assert decision.record() == {
        "asked_by": "bf16 mixed precision (accelerate's mixed_precision: bf16)",
        "cpu": "AMD EPYC 7B13",
        "native_bf16": False,
        "forced": False,
        "compute": "float32",
        "note": decision.line(),
    }
    assert cpu_fsdp.cpu_precision() == decision


def test_bf16_true_of_the_recipe_computes_in_fp32_on_arm_without_bf16(no_accelerator):
    env = {}
    decision = choose_cpu_precision(True, False, env=env, cpuinfo=NEOVERSE_N1)
    assert decision.mixed_precision == "no" and env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert decision.line().startswith("bf16 mixed precision (bf16: true) computes in fp32 here")
    assert "(no bf16 in /proc/cpuinfo's Features)" in decision.line()


def test_force_keeps_bf16_and_says_so(no_accelerator):
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    decision = choose_cpu_precision(False, True, env=env, cpuinfo=EPYC_AVX2)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and decision.mixed_precision == "bf16"
    assert decision.line().startswith(
        "bf16 mixed precision (accelerate's mixed_precision: bf16) keeps bf16 compute (--cpu_bf16 true) although"
    )
    assert decision.record()["compute"] == "bfloat16" and decision.record()["forced"] is True


@pytest.mark.parametrize("cpuinfo", [ZEN4_AVX512_BF16, SAPPHIRE_RAPIDS_AMX, NEOVERSE_V1, POWER9])
def test_native_or_unknown_cpus_keep_bf16_without_a_word(no_accelerator, cpuinfo):
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    decision = choose_cpu_precision(False, False, env=env, cpuinfo=cpuinfo)
    assert (
        env["ACCELERATE_MIXED_PRECISION"] == "bf16" and decision.mixed_precision == "bf16" and decision.line() is None
    )


def test_accelerators_and_runs_without_bf16_are_left_alone(no_accelerator, monkeypatch):
    env = {"ACCELERATE_MIXED_PRECISION": "no"}
    assert choose_cpu_precision(False, False, env=env, cpuinfo=EPYC_AVX2) is None and env == {
        "ACCELERATE_MIXED_PRECISION": "no"
    }
    monkeypatch.setattr(cpu_fsdp, "accelerator_present", lambda: True)
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    assert choose_cpu_precision(True, False, env=env, cpuinfo=EPYC_AVX2) is None and env == {
        "ACCELERATE_MIXED_PRECISION": "bf16"
    }
    assert cpu_fsdp.cpu_precision() is None


def test_force_without_bf16_is_an_error(no_accelerator):
    with pytest.raises(
        RecipeError,
        match="cpu_bf16 keeps bf16 mixed precision on a CPU without native bf16, and this run asks for none",
    ):
        choose_cpu_precision(False, True, env={"ACCELERATE_MIXED_PRECISION": "no"}, cpuinfo=EPYC_AVX2)


def test_bf16_weights_are_named_where_they_compute_in_bf16(no_accelerator):
    """--dtype bfloat16 (or a bf16 model loaded with --dtype auto) computes in bf16 whatever the mixed precision: on a
    CPU without native bf16 that is one line naming the fix; elsewhere, and for fp32 weights, nothing."""
    import torch

    from fsdp_recipes.compat.cpu_fsdp import bf16_weights_line

    line = bf16_weights_line(torch.bfloat16, "--dtype bfloat16", EPYC_AVX2)
    assert line.startswith(
        "the model's weights are bfloat16 (--dtype bfloat16): they compute in bf16, and this CPU (AMD EPYC 7B13)"
    )
    assert line.endswith("--dtype float32 computes in fp32")
    assert bf16_weights_line(torch.float32, "--dtype float32", EPYC_AVX2) is None
    assert bf16_weights_line(torch.bfloat16, "--dtype bfloat16", ZEN4_AVX512_BF16) is None
    assert bf16_weights_line(torch.bfloat16, "--dtype bfloat16", NEOVERSE_V1) is None
