"""concurrent_object_builds (builder/concurrent_objects.py): the wrapper object's compiler runs while
the next build does, the link waits for it, and a failed compile raises torch's CppCompileError.

The builders are torch's own CppBuilder; only their command lines are shell commands, so the order
of events is observable: the wrapper's "compiler" finishes only once the kernels' has run, which a
sequential build would never let it see (it gives up after 60 s and fails)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch._inductor import cpp_builder
from torch._inductor.exc import CppCompileError

from ifb.builder.concurrent_objects import concurrent_object_builds


class ShellBuilder(cpp_builder.CppBuilder):
    """torch's CppBuilder for `name` in `folder`, running `script` instead of a compiler."""

    def __init__(self, name: str, folder: Path, script: str, compile_only: bool = True) -> None:
        super().__init__(name, [], cpp_builder.CppOptions(compile_only=compile_only), str(folder))
        self.script = script

    def get_command_line(self) -> str:
        return f"sh -c '{self.script}'"


def wait_for(path: Path) -> str:
    """Shell: wait (at most 60 s) until `path` exists, else fail."""
    return f"i=0; until [ -e {path} ]; do i=$((i+1)); [ $i -gt 6000 ] && exit 3; sleep 0.01; done"


def test_the_wrapper_compiles_while_the_kernels_do_and_the_link_waits_for_it(tmp_path: Path) -> None:
    kernels_done, wrapper_done, linked = tmp_path / "k", tmp_path / "w", tmp_path / "linked"
    wrapper = ShellBuilder("step.wrapper", tmp_path, f"{wait_for(kernels_done)}; touch {wrapper_done}")
    kernels = ShellBuilder("step.kernel", tmp_path, f"touch {kernels_done}")
    link = ShellBuilder("step", tmp_path, f"test -e {wrapper_done} && touch {linked}", compile_only=False)
    original = cpp_builder.CppBuilder.build
    with concurrent_object_builds():
        wrapper.build()
        assert not wrapper_done.exists()  # returned at once: its compiler waits for the kernels'
        kernels.build()
        assert wrapper_done.exists()  # the kernels' build returned after the wrapper's finished
        link.build()
    assert linked.exists()
    assert cpp_builder.CppBuilder.build is original  # torch's own build again outside the context


def test_a_failed_wrapper_compile_raises_with_the_compilers_output(tmp_path: Path) -> None:
    wrapper = ShellBuilder("step.wrapper", tmp_path, "echo step.wrapper.cpp:7: error: no such member; exit 1")
    kernels = ShellBuilder("step.kernel", tmp_path, "true")
    with pytest.raises(CppCompileError, match="no such member"), concurrent_object_builds():
        wrapper.build()
        kernels.build()


def test_a_build_that_fails_elsewhere_stops_the_wrapper_compiler(tmp_path: Path) -> None:
    wrapper = ShellBuilder("step.wrapper", tmp_path, wait_for(tmp_path / "never"))
    with pytest.raises(RuntimeError, match="lowering failed"), concurrent_object_builds():
        wrapper.build()
        raise RuntimeError("lowering failed")
    # abandoned: killed and waited for, so no compiler outlives the build
    assert not any(tmp_path.glob("step.wrapper-*")), "its scratch folder is removed"
