"""The test run's ISA summary (tests/isa_report.py) as an AVX2-only machine prints it: the AVX-512
paths show as skipped with the reason, never as covered."""

from __future__ import annotations

from collections import Counter

from isa_report import IsaReport

from ifb.plugins.quant_build import QuantIsa, best_isa, isa_features

AVX2_ONLY = frozenset({"sse4_2", "avx", *isa_features(QuantIsa.AVX2)})


def test_an_avx2_only_run_names_the_avx512_paths_skipped_and_why() -> None:
    assert best_isa(AVX2_ONLY) is QuantIsa.AVX2  # the builder's own choice for such a CPU
    report = IsaReport(ran=Counter({QuantIsa.AVX2: 40}))
    report.skipped[QuantIsa.AVX512] = Counter({"this CPU cannot run the avx512 path": 3})
    lines = report.lines((QuantIsa.AVX2, AVX2_ONLY, ""))
    assert lines[0] == "ISA paths: this CPU builds avx2; ran: avx2 (40 tests)"
    assert (
        "skipped: avx512_vnni: no test can run it here: this CPU lacks avx512_vnni, avx512bw, avx512f, avx512vl"
        in (lines[1])
    )
    assert lines[2] == "  skipped: avx512: this CPU cannot run the avx512 path (3)"
    assert "does not show" in lines[3] and len(lines) == 4


def test_a_run_that_ran_every_path_lists_no_skip() -> None:
    report = IsaReport(ran=Counter({QuantIsa.AVX512_VNNI: 30, QuantIsa.AVX512: 3, QuantIsa.AVX2: 4}))
    features = frozenset(isa_features(QuantIsa.AVX512_VNNI))
    assert report.lines((QuantIsa.AVX512_VNNI, features, "")) == [
        "ISA paths: this CPU builds avx512_vnni; ran: avx512_vnni (30 tests), avx512 (3 tests), avx2 (4 tests)"
    ]


def test_a_selection_without_kernel_tests_says_so() -> None:
    features = frozenset(isa_features(QuantIsa.AVX512_VNNI))
    lines = IsaReport().lines((QuantIsa.AVX512_VNNI, features, ""))
    assert lines[0].endswith("ran: none (no kernel test ran)")
    assert all("no test of it ran in this selection" in line for line in lines[1:4])
