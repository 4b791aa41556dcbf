"""The kernels' ISA variants: built into the package, the best one this CPU runs chosen, an override honoured; the
tests' forced paths (every variant a parameter, emulated CPU kinds) as they claim."""

from __future__ import annotations

import platform

import pytest
import torch

from pdserve.engine import native
from pdserve.engine.layers.dense_kernels import dense_kernel_serves_this_cpu
from pdserve.engine.layers.linear import (
    INT4_KERNEL_MAX_ROWS,
    INT8_AVX2_KERNEL_MAX_ROWS,
    INT8_KERNEL_MAX_ROWS,
    NO_ROW_LIMIT,
    _dequantized_dtype,
    quant_kernel_max_rows,
)
from pdserve.engine.native import ISA_ENV, VARIANT_FEATURES, built_variants, load_kernel_ops, supported_variants
from tests.support import cpu_paths


def test_every_variant_is_built_into_the_package() -> None:
    expected = tuple(VARIANT_FEATURES) if platform.machine() == "x86_64" else ("portable",)
    assert built_variants() == expected


def test_the_best_variant_this_cpu_runs_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    flags = native.cpu_flags()
    runnable = tuple(name for name, needs in VARIANT_FEATURES.items() if needs <= flags and name in built_variants())
    assert supported_variants() == runnable and runnable[0] == "portable"
    kernels = load_kernel_ops()
    assert kernels is not None and (kernels.name, kernels.variant) == (runnable[-1], built_variants().index(runnable[-1]))


def test_an_override_names_a_lower_variant_and_a_bad_one_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_ENV, "portable")
    kernels = load_kernel_ops()
    assert kernels is not None and (kernels.name, kernels.variant) == ("portable", 0)
    assert kernels.ops.quant_path(kernels.variant) == 0  # the portable C code, whatever the CPU
    monkeypatch.setenv(ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match=f"{ISA_ENV} 'avx9000' is not one of the built variants; this CPU runs"):
        load_kernel_ops()
    # An explicit variant wins over the override.
    assert load_kernel_ops("portable").name == "portable"


def test_a_variant_this_cpu_lacks_features_for_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset())  # a CPU with nothing beyond x86-64
    assert supported_variants() == ("portable",)
    if "avx2" in built_variants():
        with pytest.raises(ValueError, match="variant 'avx2' needs CPU features this CPU lacks; this CPU runs portable"):
            load_kernel_ops("avx2")
    assert load_kernel_ops().name == "portable"


def test_an_operator_refuses_a_variant_outside_the_build() -> None:
    kernels = load_kernel_ops()
    assert kernels is not None
    with pytest.raises(RuntimeError, match=r"variant must be in \[0, \d\), got 99"):
        kernels.ops.quant_path(99)


def test_a_forced_variant_hides_the_bigger_cpus_features_from_the_engines_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sapphire_rapids = frozenset(
        {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
         "amx_bf16", "amx_int8", "amx_tile", "avx_vnni", "vaes", "gfni", "aes", "popcnt"}
    )
    monkeypatch.setattr(native, "cpu_flags", lambda: sapphire_rapids)
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert native.dispatch_flags() == sapphire_rapids
    assert native.cpu_has_native_bf16()
    monkeypatch.setenv(ISA_ENV, "avx2")
    # What an AVX2-only CPU has: no AVX-512, AMX, AVX-VNNI or vector crypto; the scalar features stay.
    assert native.dispatch_flags() == frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "aes", "popcnt"})
    assert not native.cpu_has_native_bf16()
    monkeypatch.setenv(ISA_ENV, "avx512_vnni")
    assert native.dispatch_flags() == frozenset(
        {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512_vnni", "aes", "popcnt"}
    )
    monkeypatch.setenv(ISA_ENV, "portable")
    assert native.dispatch_flags() == frozenset({"sse4_2", "bmi2", "aes", "popcnt"})


def test_variants_this_cpu_lacks_are_parameters_skipped_with_the_missing_features(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if built_variants() != tuple(VARIANT_FEATURES):
        pytest.skip(f"this build holds only {', '.join(built_variants()) or 'no kernels'}")
    avx2_only = VARIANT_FEATURES["avx2"] | {"sse4_2", "aes"}  # a Zen 3's vector features
    monkeypatch.setattr(cpu_paths, "cpu_flags", lambda: avx2_only)
    params = cpu_paths.variant_params()
    assert [param.id for param in params] == list(VARIANT_FEATURES)
    reasons = {param.id: [mark.kwargs["reason"] for mark in param.marks] for param in params}
    assert reasons == {
        "portable": [],
        "avx2": [],
        "avx512": ["avx512 needs CPU features this CPU lacks: avx512bw, avx512cd, avx512dq, avx512f, avx512vl"],
        "avx512_vnni": [
            "avx512_vnni needs CPU features this CPU lacks: avx512_vnni, avx512bw, avx512cd, avx512dq, avx512f, "
            "avx512vl"
        ],
        "avx512_bf16": [
            "avx512_bf16 needs CPU features this CPU lacks: avx512_bf16, avx512_vnni, avx512bw, avx512cd, avx512dq, "
            "avx512f, avx512vl"
        ],
    }
    # The parameter is the variant's name, or what ``values`` makes of it.
    assert [param.values for param in cpu_paths.variant_params(("avx2",), lambda name: (name, len(name)))] == [
        ("avx2", 4)
    ]


def test_an_emulated_cpu_kind_makes_the_engines_choices_as_that_cpu_does(monkeypatch: pytest.MonkeyPatch) -> None:
    choices = {}
    for kind in cpu_paths.CPU_KINDS:
        cpu_paths.emulate(monkeypatch, kind)
        choices[kind.name] = (
            dense_kernel_serves_this_cpu(torch.float32), dense_kernel_serves_this_cpu(torch.bfloat16),
            quant_kernel_max_rows("int8"), quant_kernel_max_rows("int4"), _dequantized_dtype(torch.zeros(1)),
        )
    assert choices == {
        "zen3": (False, False, INT8_AVX2_KERNEL_MAX_ROWS, NO_ROW_LIMIT, torch.float32),
        "zen4": (True, True, NO_ROW_LIMIT, NO_ROW_LIMIT, torch.bfloat16),
        "xeon_amx": (False, False, INT8_KERNEL_MAX_ROWS, INT4_KERNEL_MAX_ROWS, torch.bfloat16),
    }
