"""llama.cpp's own `convert_hf_to_gguf.py` (and its own gguf-py) as a test input: HF folder -> GGUF.

The converter is pure Python: it ships in the llama-cpp-python sdist under vendor/llama.cpp. The
sdist is fetched once per machine from the package registry at a pinned version (the only network
use of the test suite; `IFB_LLAMA_CPP_SDIST=path/to/llama_cpp_python-VERSION.tar.gz` skips it),
and only the converter's files are extracted into a cache outside the repository:

    ~/.cache/ifb/llama-cpp-python-0.3.36/   ($XDG_CACHE_HOME/ifb/... when set)
        convert_hf_to_gguf.py  conversion/  gguf-py/gguf/

Two pytest processes may ask at once: the download and extraction happen under a file lock, into
a temporary folder renamed into place, so a reader sees the whole tree or none.

The converter runs in a subprocess with llama.cpp's gguf-py first on the path, never the `gguf`
package installed for ifb, so a file is written exactly as llama.cpp writes it. Its imports are
torch, numpy, transformers, yaml (a transformers dependency) and, for a `tokenizer.model`,
sentencepiece (the `dev` extra). Q4_K_M needs llama-quantize (C++) and is not made here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# The converter's own files inside the sdist's vendor/llama.cpp (gguf-py's tests and examples left out).
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
SDIST_ENV = "IFB_LLAMA_CPP_SDIST"
ROOT = Path(__file__).resolve().parent.parent

# Run in the subprocess: each job is one call of the converter's own main() with its own argv,
# so torch and transformers are imported once for a batch of files.
_DRIVER = """
import json, sys
tree = sys.argv[1]
sys.path[:0] = [tree + "/gguf-py", tree]
import gguf
assert gguf.__file__.startswith(tree), ("not llama.cpp's gguf-py", gguf.__file__)
import convert_hf_to_gguf
for job in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", *job]
    convert_hf_to_gguf.main()
"""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ifb" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"


def _sdist_name() -> str:
    return f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"


def _find_or_download_sdist(workdir: Path) -> Path:
    """The pinned sdist: $IFB_LLAMA_CPP_SDIST, bench/peers.py's download if it is this version,
    else `pip download` into `workdir`."""
    given = os.environ.get(SDIST_ENV)
    if given:
        path = Path(given)
        if path.name != _sdist_name() or not path.is_file():
            raise FileNotFoundError(f"{SDIST_ENV}={given}: expected an existing file named {_sdist_name()}")
        return path
    bench_copy = ROOT / "bench" / "out" / "llama.cpp" / "sdist" / _sdist_name()
    if bench_copy.is_file():
        return bench_copy
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(workdir),
    ]  # fmt: skip
    logger.info("fetching the llama-cpp-python %s sdist (once per machine)", LLAMA_CPP_PYTHON_VERSION)
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    sdist = workdir / _sdist_name()
    if done.returncode != 0 or not sdist.is_file():
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return sdist


def _extract(sdist: Path, into: Path) -> None:
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            relative = member.name.removeprefix(prefix)
            if relative != member.name and relative.startswith(CONVERTER_FILES) and member.isfile():
                member.name = relative
                members.append(member)
        tar.extractall(into, members=members, filter="data")
    missing = [name for name in CONVERTER_FILES if not (into / name).exists()]
    if missing:
        raise RuntimeError(f"{sdist} lacks {missing} under {prefix}: the converter moved; update {__name__}")


def converter_tree() -> Path:
    """The folder holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ (fetched
    and extracted on first use)."""
    tree = cache_dir()
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    tree.parent.mkdir(parents=True, exist_ok=True)
    with open(tree.parent / f"{tree.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the tree
        if (tree / "convert_hf_to_gguf.py").is_file():
            return tree
        with tempfile.TemporaryDirectory(dir=tree.parent, prefix=f".{tree.name}-") as work:
            staging = Path(work) / "tree"
            staging.mkdir()
            _extract(_find_or_download_sdist(Path(work)), staging)
            (staging / "source.json").write_text(json.dumps({"llama-cpp-python": LLAMA_CPP_PYTHON_VERSION}))
            if tree.exists():  # a tree left half-made by hand: the rename below needs the name free
                shutil.rmtree(tree)
            staging.rename(tree)  # atomic: readers see the whole tree or none
    return tree


def convert_many(jobs: Sequence[tuple[Path, Path, str]], timeout_s: float = 900) -> list[Path]:
    """Convert each (hf_dir, out, outtype) with llama.cpp's converter in one subprocess."""
    for hf_dir, _, outtype in jobs:
        if outtype not in OUTTYPES:
            raise ValueError(
                f"outtype {outtype!r} for {hf_dir}: the converter writes {OUTTYPES} (Q4_K_M needs llama-quantize)"
            )
    tree = converter_tree()
    argv = [[str(hf_dir), "--outfile", str(out), "--outtype", outtype] for hf_dir, out, outtype in jobs]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)])}
    env.pop("NO_LOCAL_GGUF", None)  # the converter puts its own gguf-py on the path unless this is set
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(tree), json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    outs = [out for _, out, _ in jobs]
    missing = [str(out) for out in outs if not out.is_file()]
    if missing:
        raise RuntimeError(f"llama.cpp's converter wrote no {missing}:\n{done.stderr[-4000:]}")
    return outs


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """`convert_hf_to_gguf.py hf_dir --outfile out --outtype outtype`, llama.cpp's gguf-py first
    on the path; returns `out`. outtype: f32, f16, bf16 or q8_0."""
    return convert_many([(hf_dir, out, outtype)])[0]
