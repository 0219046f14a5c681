"""The memory snapshots' block checksum (fabric_core.io.snapshot_checksum): what it catches, and that computing it
block by block as the bytes become final gives the checksum of the whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fabric_core.io import snapshot_checksum as sc
from fabric_core.io import snapshot_store as store

SKELETON = b"\x80\x05skeleton"


def _data(size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("size", [0, 64, sc.BLOCK, 3 * sc.BLOCK + 192, 5 * sc.BLOCK])
def test_digesting_piece_by_piece_gives_the_checksum_of_the_whole(size: int):
    data = _data(size)
    whole = sc.checksum(data, size, SKELETON)
    assert whole.startswith(f"{sc.KIND}:") and len(whole.split(":")[1]) == 8
    rng = random.Random(size)
    digest = sc.BlockDigest(data, size)
    for upto in sorted(rng.randrange(0, size + 1) for _ in range(7)):
        digest.advance(upto)
        digest.advance(upto)  # asking twice changes nothing
    assert digest.result(SKELETON) == whole


def test_a_larger_buffer_is_digested_up_to_the_size_only():
    data = _data(2 * sc.BLOCK + 64)
    bigger = torch.cat([data, _data(4096, seed=1)])
    assert sc.checksum(bigger, data.numel(), SKELETON) == sc.checksum(data, data.numel(), SKELETON)


def test_every_single_bit_flip_and_every_changed_word_is_caught():
    size = 2 * sc.BLOCK + 640
    data = _data(size)
    good = sc.checksum(data, size, SKELETON)
    rng = random.Random(0)
    for position in [0, size - 1, sc.BLOCK - 1, sc.BLOCK, *(rng.randrange(size) for _ in range(200))]:
        bit = 1 << rng.randrange(8)
        data[position] ^= bit
        assert sc.checksum(data, size, SKELETON) != good, f"bit {bit} of byte {position}"
        data[position] ^= bit
    words = data.view(torch.int64)
    for index in (rng.randrange(words.numel()) for _ in range(50)):
        before = words[index].item()
        words[index] = before ^ rng.getrandbits(63) | 1
        assert sc.checksum(data, size, SKELETON) != good
        words[index] = before
    assert sc.checksum(data, size, SKELETON) == good


def test_a_torn_block_swapped_blocks_and_a_changed_skeleton_are_caught():
    size = 4 * sc.BLOCK
    data = _data(size)
    good = sc.checksum(data, size, SKELETON)
    torn = data.clone()
    torn[sc.BLOCK : 2 * sc.BLOCK] = _data(sc.BLOCK, seed=7)  # the previous snapshot's bytes left in one block
    assert sc.checksum(torn, size, SKELETON) != good
    zeroed = data.clone()
    zeroed[3 * sc.BLOCK + 4096 :] = 0  # a copy that stopped early
    assert sc.checksum(zeroed, size, SKELETON) != good
    swapped = torch.cat([data[sc.BLOCK : 2 * sc.BLOCK], data[: sc.BLOCK], data[2 * sc.BLOCK :]])
    assert sc.checksum(swapped, size, SKELETON) != good
    assert sc.checksum(data, size, SKELETON + b".") != good


def test_what_the_block_checksum_does_not_catch_is_what_its_docstring_says():
    # two words of one block with the same bits flipped cancel in the XOR: the documented limit
    size = sc.BLOCK
    data = _data(size)
    good = sc.checksum(data, size, SKELETON)
    words = data.view(torch.int64)
    words[3] ^= 0x0100
    words[700] ^= 0x0100
    assert sc.checksum(data, size, SKELETON) == good
    assert "flip the same" in sc.__doc__


def test_files_are_checked_against_their_manifest(tmp_path: Path):
    size = sc.BLOCK + 128
    data = _data(size)
    folder = tmp_path / "step-000000001"
    folder.mkdir()
    (folder / store.DATA).write_bytes(bytes(data.tolist()) + b"\0" * 64)  # a reused file may be longer
    (folder / store.SKELETON).write_bytes(SKELETON)
    manifest = {"format": store.FORMAT, "data_bytes": size, "checksum": sc.checksum(data, size, SKELETON)}
    store.write_manifest(folder, manifest)
    assert sc.verify(folder) == manifest
    raw = bytearray((folder / store.DATA).read_bytes())
    raw[size // 3] ^= 1
    (folder / store.DATA).write_bytes(raw)
    with pytest.raises(store.SnapshotChecksumError, match="does not match the one committed"):
        sc.verify(folder)
    (folder / store.DATA).write_bytes(bytes(raw[: size - 64]))
    with pytest.raises(store.SnapshotChecksumError, match=f"holds {size - 64} bytes, the manifest says {size}"):
        sc.verify(folder)


def test_a_size_that_is_not_whole_words_is_refused():
    with pytest.raises(ValueError, match="whole number of 64-bit words"):
        sc.BlockDigest(_data(100), 100)
