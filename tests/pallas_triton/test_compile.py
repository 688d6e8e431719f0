"""The Triton-compile path's IR edit and parameter checks (no GPU or `triton` needed)."""

import pytest

from jattn._src.pallas_triton import compile as ptc

# Two dots as Pallas prints them (one with an input precision, one without).
IR = """\
      %5 = tt.dot %3, %4, %cst, inputPrecision = tf32 : tensor<128x128xf8E4M3FN> * \
tensor<128x256xf8E4M3FN> -> tensor<128x256xf32>
      %9 = tt.dot %7, %8, %5 : tensor<16x32xbf16> * tensor<32x64xbf16> -> tensor<16x64xf32>
"""


def test_imprecise_acc_is_set_on_every_dot():
    edited = ptc._with_imprecise_acc(IR, 128)
    lines = edited.splitlines()
    assert lines[0].endswith("inputPrecision = tf32 {maxNumImpreciseAcc = 128 : i32} : "
                             "tensor<128x128xf8E4M3FN> * tensor<128x256xf8E4M3FN> -> "
                             "tensor<128x256xf32>")
    assert "%5 {maxNumImpreciseAcc = 128 : i32} : tensor<16x32xbf16>" in lines[1]


def test_an_unrecognised_dot_raises_rather_than_compiling_unchanged():
    odd = "  %5 = tt.dot %3, %4, %cst {someAttr = 1} -> tensor<16x16xf32>\n"
    with pytest.raises(RuntimeError, match="could not set maxNumImpreciseAcc on every tt.dot"):
        ptc._with_imprecise_acc(odd, 128)


def test_the_knob_needs_the_triton_compiler():
    with pytest.raises(ValueError, match="takes effect with compiler='triton' only"):
        ptc.compiler_params(4, 3, compiler="xla", max_num_imprecise_acc=128)
    with pytest.raises(ValueError, match="compiler must be one of"):
        ptc.compiler_params(4, 3, compiler="nvcc")
