"""Two engines whose kernel libraries differ, in one process (a router serving both).

One kernel library per ISA serves a process, the first engine's (runtime/step/kernels.py), and a
compiled step resolves its shims from it. An engine built before the one attention op ships a
library without `aoti_torch_cpu_paged_attention`; an engine built now calls it. Loaded after the
older library, the newer engine must be refused in one line that names the shim, the library
loaded first and what to do, not with dlopen's bare "undefined symbol".

The older library here is a stand-in compiled in the test: it exports what a library of before
the contract exported by name (the ISA query, the matmul, embedding and expert shims, the three
older attention shims; never called), so the
compiled step of a real engine meets exactly the gap a real older library leaves.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ifb.runtime.engine_format import EngineConfig

_OLDER_LIBRARY = r"""
extern "C" {
const char* ifb_quant_isa_name() { return ISA; }
int aoti_torch_cpu_quant_matmul() { return 1; }
int aoti_torch_cpu_quant_matmul_int8() { return 1; }
int aoti_torch_cpu_quant_embedding() { return 1; }
int aoti_torch_cpu_grouped_experts() { return 1; }
int aoti_torch_cpu_paged_decode_attention() { return 1; }
int aoti_torch_cpu_paged_decode_attention_window() { return 1; }
int aoti_torch_cpu_paged_decode_attention_softcap() { return 1; }
}
"""

_SERVE_BOTH = """
import sys
from pathlib import Path
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.kernels import ensure_quant_library
ensure_quant_library(Path(sys.argv[1]), sys.argv[2], ())  # the older engine's, loaded first
try:
    Engine.load(sys.argv[3])
except EngineFormatError as error:
    print("REFUSED", error)
"""


def test_a_newer_step_after_an_older_library_is_refused_by_name(tiny_q4_gguf_engine: Path, tmp_path: Path) -> None:
    config = EngineConfig.load(tiny_q4_gguf_engine)
    assert config.kernels is not None
    source = tmp_path / "older.cpp"
    source.write_text(_OLDER_LIBRARY)
    older = tmp_path / "libifb_quant_older.so"
    subprocess.run(
        ["c++", "-shared", "-fPIC", f'-DISA="{config.kernels.isa}"', str(source), "-o", str(older)], check=True
    )
    command = [sys.executable, "-c", _SERVE_BOTH, str(older), config.kernels.isa, str(tiny_q4_gguf_engine)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("REFUSED")]
    assert "aoti_torch_cpu_paged_attention" in line
    assert str(older) in line and "separate processes" in line
