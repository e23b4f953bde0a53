"""build_step_inputs: packing order, positions and slots from block tables, padding, logits rows, contract names."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from ifb.runtime.engine_format import STEP_INPUT_NAMES
from ifb.runtime.step.network import StepNetwork
from ifb.runtime.step.step_inputs import RequestSlice, StepInputs, build_step_inputs

BLOCK_SIZE = 4


def context_chunk(sample: bool = False) -> RequestSlice:
    """5 tokens at positions 2..6 over scattered blocks 7 then 3 (a mid-prompt chunk by default)."""
    return RequestSlice(token_ids=[10, 11, 12, 13, 14], start_position=2, block_table=[7, 3], sample=sample)


def last_chunk() -> RequestSlice:
    """A prompt's 3-token last chunk in block 2; the table holds one more block than needed."""
    return RequestSlice(token_ids=[30, 31, 32], start_position=0, block_table=[2, 11], sample=True)


def decode_at(token: int, position: int, block_table: list[int]) -> RequestSlice:
    return RequestSlice(token_ids=[token], start_position=position, block_table=block_table, sample=True)


def mixed_step() -> StepInputs:
    """Decode, mid-prompt chunk, decode, last chunk, given in that (interleaved) order."""
    slices = [
        decode_at(20, 9, [5, 9, 1, 6]),
        context_chunk(),
        decode_at(40, 4, [8, 0]),
        last_chunk(),
    ]
    return build_step_inputs(slices, BLOCK_SIZE)


def test_context_chunks_are_packed_before_decodes_whatever_the_input_order() -> None:
    """Both chunks (in their given order) come first, then the two decode tokens."""
    assert mixed_step().input_ids.tolist() == [10, 11, 12, 13, 14, 30, 31, 32, 20, 40]


def test_positions_continue_from_each_start_position() -> None:
    """Each slice's positions run from start_position over its tokens."""
    assert mixed_step().positions.tolist() == [2, 3, 4, 5, 6, 0, 1, 2, 9, 4]


def test_slots_follow_the_block_table() -> None:
    """slot = block_table[pos // block_size] * block_size + pos % block_size, across scattered blocks."""
    assert mixed_step().slot_mapping.tolist() == [
        7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2,  # positions 2..6 over blocks 7, 3
        2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2,  # positions 0..2 in block 2
        1 * 4 + 1,  # position 9: third block (1)
        0 * 4 + 0,  # position 4: second block (0)
    ]  # fmt: skip


def test_context_rows_are_padded_with_their_last_row() -> None:
    """The shorter chunk's query rows repeat its last packed row up to the longest chunk."""
    assert mixed_step().context_query_rows.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 7, 7]]


def test_block_tables_are_cut_to_the_blocks_used_and_padded_with_the_last_block() -> None:
    """Tables keep ceil(end / block_size) blocks, padded with the row's last block id."""
    step = mixed_step()
    assert step.context_block_tables.tolist() == [[7, 3], [2, 2]]
    assert step.decode_block_tables.tolist() == [[5, 9, 1], [8, 0, 0]]


def test_decode_rows_and_sequence_lengths() -> None:
    """Decode tokens sit after the context rows; a decode's sequence length includes its own token."""
    step = mixed_step()
    assert step.decode_query_rows.tolist() == [8, 9]
    assert step.decode_seq_lens.tolist() == [10, 5]


def test_logits_rows_follow_the_order_of_the_sampling_slices() -> None:
    """Sampling slices were given as decode(20), decode(40), last chunk: rows 8, 9, then 7 (not packed order)."""
    assert mixed_step().logits_indices.tolist() == [8, 9, 7]


def test_mid_prompt_chunk_yields_no_logits_row() -> None:
    """The same chunk gives one logits row (its last token) when it samples and none when it does not."""
    assert build_step_inputs([context_chunk(sample=False)], BLOCK_SIZE).logits_indices.tolist() == []
    assert build_step_inputs([context_chunk(sample=True)], BLOCK_SIZE).logits_indices.tolist() == [4]


def test_decode_only_step_has_empty_context_tensors_of_width_one() -> None:
    """No chunks: context tensors have zero rows and width 1 (the step contract's minimum)."""
    step = build_step_inputs([decode_at(20, 9, [5, 9, 1])], BLOCK_SIZE)
    assert step.context_query_rows.shape == (0, 1)
    assert step.context_block_tables.shape == (0, 1)
    assert step.decode_query_rows.tolist() == [0]


def test_context_only_step_has_empty_decode_tensors() -> None:
    """No decodes: decode rows and lengths are empty, decode block tables are [0, 1]."""
    step = build_step_inputs([last_chunk()], BLOCK_SIZE)
    assert step.decode_query_rows.shape == (0,)
    assert step.decode_seq_lens.shape == (0,)
    assert step.decode_block_tables.shape == (0, 1)


def test_every_tensor_is_int64() -> None:
    """All step inputs are long tensors (the compiled step's input dtype)."""
    step = mixed_step()
    assert {t.dtype for t in step.as_args()} == {torch.long}


def test_empty_step_raises() -> None:
    """No slices at all is a ValueError, not an empty batch."""
    with pytest.raises(ValueError, match="at least one"):
        build_step_inputs([], BLOCK_SIZE)


@pytest.mark.parametrize(
    "piece",
    [
        RequestSlice(token_ids=[1, 2, 3], start_position=3, block_table=[4], sample=True),  # ends at 6: 2 blocks
        RequestSlice(token_ids=[1], start_position=4, block_table=[4], sample=True),  # position 4: block 2
    ],
)
def test_block_table_too_short_raises(piece: RequestSlice) -> None:
    """A table with fewer blocks than the slice's last position needs is a ValueError naming both counts."""
    with pytest.raises(ValueError, match="1 blocks, 2 needed"):
        build_step_inputs([piece], BLOCK_SIZE)


def test_step_inputs_fields_are_the_contract_names_in_order() -> None:
    """StepInputs' fields are STEP_INPUT_NAMES, same order (as_args relies on it)."""
    assert tuple(f.name for f in dataclasses.fields(StepInputs)) == STEP_INPUT_NAMES


def test_as_args_returns_the_tensors_in_contract_order() -> None:
    """as_args()[i] is the field named STEP_INPUT_NAMES[i]."""
    step = mixed_step()
    for name, tensor in zip(STEP_INPUT_NAMES, step.as_args(), strict=True):
        assert tensor is getattr(step, name)


def test_step_network_forward_takes_the_contract_then_kv_pools() -> None:
    """StepNetwork.forward's parameters are STEP_INPUT_NAMES followed by kv_pools."""
    parameters = list(inspect.signature(StepNetwork.forward).parameters)
    assert parameters[0] == "self"
    assert tuple(parameters[1:]) == (*STEP_INPUT_NAMES, "kv_pools")
