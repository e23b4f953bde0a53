"""The compile phase of `ifb build` at two revisions of ifb, alternated in one run (issue #39).

    .venv/bin/python bench/compile_ab.py --old HEAD~1 --rounds 2 [--new REV] [--keep DIR] [-- BUILD ARGS]

Each side builds the same source (the bundled SmolLM2 unless BUILD ARGS name one: `-- FILE.gguf`)
in a fresh process from an empty compile cache that holds only this machine's kernel library (it
does not depend on the model, and `make install` compiles it once), so every round pays the whole
step compile as a first build of a new file does. `--old`/`--new` are git revisions, extracted
with `git archive`; `--new` defaults to the working tree. Prints each build's phases line and the
step graph's node count, then each side's median compile seconds and their ratio. Sides
alternate so that a change of load (another build, a test run) falls on both. `--keep DIR` leaves
each side's last engine in DIR/old and DIR/new, for bench/step_ab.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("builder", "runtime", "plugins", "cli")  # mapped to ifb.<name> by the editable install
KERNELS = Path(os.environ.get("IFB_CACHE_DIR", Path.home() / ".cache" / "ifb")) / "compiled" / "kernels"


def extract_revision(revision: str, into: Path) -> Path:
    """The `ifb` package as it was at `revision`, laid out as the editable install imports it."""

    def archive(path: str, target: Path, strip: int) -> None:
        target.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "-C", str(REPO), "archive", revision, path], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(target), f"--strip-components={strip}"], input=tar.stdout, check=True)

    archive("ifb", into, 0)
    for name in SUBPACKAGES:
        archive(name, into / "ifb" / name, 1)
    return into


def build_once(package_root: Path | None, scratch: Path, engine: Path, build_args: list[str]) -> tuple[float, str]:
    """(compile seconds, the build's phases and node-count lines) of one build into `engine` from an
    empty cache."""
    cache = scratch / "cache"
    scratch.mkdir(parents=True, exist_ok=True)
    engine.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(engine, ignore_errors=True)
    if KERNELS.is_dir():
        shutil.copytree(KERNELS, cache / "compiled" / "kernels")
    env = {**os.environ, "IFB_CACHE_DIR": str(cache)}
    if package_root is not None:
        env["PYTHONPATH"] = str(package_root)
    command = [sys.executable, "-c", "from ifb.cli.main import cli; cli()", "build", "-o", str(engine)]
    command += ["--calibration", "serve", *build_args]
    # from a neutral folder: the repository's own `ifb/` would shadow an extracted revision
    run = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"build failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "phases" in line or "nodes" in line]
    match = re.search(r"compile ([0-9.]+)s", "\n".join(lines))
    if match is None:
        raise SystemExit("no compile phase in the build's output:\n" + "\n".join(lines))
    return float(match.group(1)), "\n    ".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="git revision of the baseline")
    parser.add_argument("--new", default=None, help="git revision to compare (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="leave each side's last engine in KEEP/old, KEEP/new")
    parser.add_argument("build_args", nargs="*", help="after --: the source and options of `ifb build`")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ifb-compile-ab-") as temp:
        root = Path(temp)
        new_root = None if args.new is None else extract_revision(args.new, root / "new")
        sides: dict[str, Path | None] = {"old": extract_revision(args.old, root / "old"), "new": new_root}
        seconds: dict[str, list[float]] = {"old": [], "new": []}
        for round_index in range(args.rounds):
            for side, package_root in sides.items():
                engine = (args.keep or root / "engines") / side
                compile_s, lines = build_once(package_root, root / "scratch", engine.resolve(), args.build_args)
                seconds[side].append(compile_s)
                load = Path("/proc/loadavg").read_text().split()[0]
                print(
                    f"{side} round {round_index + 1} (load {load}): compile {compile_s:.1f} s\n    {lines}", flush=True
                )
    old, new = statistics.median(seconds["old"]), statistics.median(seconds["new"])
    print(f"median compile: old {old:.1f} s, new {new:.1f} s, new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
