"""Tile arithmetic (cdiv, powers of two, dot tiles) and the config validators every kernel shares:
good values pass, bad ones raise a ValueError that names the config and the field."""

import dataclasses

import pytest

from jattn._src import tiling
from jattn._src.constants import MIN_DOT_TILE


@dataclasses.dataclass
class Config:
    block_m: object = 64
    block_n: object = 16
    num_warps: object = 4
    num_stages: object = 2
    compiler: object = "xla"


def test_cdiv_rounds_up():
    assert [tiling.cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert tiling.cdiv(1000, 128) == 8 and tiling.cdiv(1024, 128) == 8


def test_next_power_of_two_is_the_smallest_power_at_least_x():
    assert [tiling.next_power_of_two(x) for x in (0, 1, 2, 3, 4, 5, 17, 64, 65)] == [
        1, 1, 2, 4, 4, 8, 32, 64, 128]
    assert tiling.next_power_of_two(4.0) == 4  # ints by value


def test_dot_tile_is_a_power_of_two_of_at_least_the_minimum_covering_the_size():
    assert MIN_DOT_TILE == 16
    assert [tiling.dot_tile(s) for s in (1, 15, 16, 17, 64, 100)] == [16, 16, 16, 32, 64, 128]


def test_good_configs_pass_every_check():
    config = Config()
    tiling.check_tiles(config, "block_m", "block_n")
    tiling.check_warps(config, "num_warps")
    tiling.check_positive(config, "num_stages", "block_m")
    tiling.check_compiler(config)
    for warps in tiling.WARP_COUNTS:
        tiling.check_warps(Config(num_warps=warps), "num_warps")
    tiling.check_compiler(Config(compiler="triton"))


@pytest.mark.parametrize("value", [8, 24, 0, -16, 32.0, "64", None])
def test_bad_tiles_raise_naming_the_config_field_and_value(value):
    with pytest.raises(ValueError, match=rf"Config\.block_n={value!r} must be a power of two >= "
                                         f"{MIN_DOT_TILE}"):
        tiling.check_tiles(Config(block_n=value), "block_m", "block_n")


@pytest.mark.parametrize("value", [0, 3, 32, 4.0])
def test_bad_warp_counts_raise_naming_the_field(value):
    with pytest.raises(ValueError, match=rf"Config\.num_warps={value!r} must be 1, 2, 4, 8 or 16"):
        tiling.check_warps(Config(num_warps=value), "num_warps")


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_non_positive_values_raise_naming_the_field(value):
    with pytest.raises(ValueError, match=rf"Config\.num_stages={value!r} must be a positive int"):
        tiling.check_positive(Config(num_stages=value), "num_stages")


def test_unknown_compilers_raise_naming_the_field():
    with pytest.raises(ValueError, match=r"Config\.compiler='mlir' must be 'xla' or 'triton'"):
        tiling.check_compiler(Config(compiler="mlir"))

    @dataclasses.dataclass
    class Other:
        backend: str = "cuda"

    with pytest.raises(ValueError, match=r"Other\.backend='cuda'"):
        tiling.check_compiler(Other(), "backend")


def test_only_the_named_fields_are_checked():
    config = Config(block_m=3, num_warps=5)
    tiling.check_tiles(config, "block_n")
    tiling.check_warps(config)  # no names: nothing to check
    with pytest.raises(ValueError, match="block_m=3"):
        tiling.check_tiles(config, "block_n", "block_m")
