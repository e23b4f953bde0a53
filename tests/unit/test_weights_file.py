"""The engine's weights file: streamed writes in any order, plain safetensors, mapped without a copy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ifb.runtime.engine_format.weights_file import TensorEntry, WeightsWriter, map_weights


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5),
        "b.packed": torch.randint(0, 256, (7, 33), dtype=torch.uint8),
        "c.bias": torch.randn(11).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    writer = WeightsWriter(path, {n: TensorEntry(t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    for name in reversed(list(tensors)):  # order of arrival is free
        writer.write(name, tensors[name])
    writer.close()


def test_written_file_is_safetensors_and_maps_back_bit_for_bit(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    _write(path, tensors)
    for loaded in (load_file(str(path)), map_weights(path)):
        assert set(loaded) == set(tensors)
        for name, tensor in tensors.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_mapped_tensors_are_aligned_and_private(tmp_path: Path) -> None:
    """Element-aligned data; writing a mapped tensor changes neither the file nor a second mapping."""
    path = tmp_path / "w.safetensors"
    _write(path, _tensors())
    first, second = map_weights(path), map_weights(path)
    for tensor in first.values():
        if tensor.numel():
            assert tensor.data_ptr() % tensor.element_size() == 0
    first["a.weight"].fill_(7.0)
    assert not torch.equal(second["a.weight"], first["a.weight"])
    assert not torch.equal(load_file(str(path))["a.weight"], first["a.weight"])


def test_writer_refuses_unknown_names_wrong_shapes_and_missing_tensors(tmp_path: Path) -> None:
    writer = WeightsWriter(tmp_path / "w.safetensors", {"x": TensorEntry(torch.float32, (2, 2))})
    with pytest.raises(ValueError, match="not in the weights file"):
        writer.write("y", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="shape"):
        writer.write("x", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="lacks x"):
        writer.close()


def test_a_tensor_written_in_pieces_from_threads_maps_back(tmp_path: Path) -> None:
    """`write_at`: pieces in any order, from several threads, between whole tensors, land in place."""
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    writer = WeightsWriter(path, {n: TensorEntry(t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    packed = tensors["b.packed"].reshape(-1).numpy()
    pieces = [(at, packed[at : at + 10]) for at in range(0, packed.size, 10)]
    writer.write("a.weight", tensors["a.weight"])
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda piece: writer.write_at("b.packed", piece[0], piece[1].data), reversed(pieces)))
    writer.write("c.bias", tensors["c.bias"])
    writer.write("empty", tensors["empty"])
    writer.close()
    assert torch.equal(map_weights(path)["b.packed"], tensors["b.packed"])
    assert torch.equal(map_weights(path)["a.weight"], tensors["a.weight"])


def test_pieces_past_the_tensor_or_short_of_it_are_refused(tmp_path: Path) -> None:
    writer = WeightsWriter(tmp_path / "w.safetensors", {"x": TensorEntry(torch.uint8, (2, 4))})
    with pytest.raises(ValueError, match="bytes 6..10 of a 8-byte tensor"):
        writer.write_at("x", 6, bytes(4))
    with pytest.raises(ValueError, match="not in the weights file"):
        writer.write_at("y", 0, bytes(4))
    writer.write_at("x", 0, bytes(4))
    with pytest.raises(ValueError, match="lacks x"):  # half of it came
        writer.close()
