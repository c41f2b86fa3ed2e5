"""The gguf kernels on a chosen instruction set and numerics, or any other setting, for the length of a test block."""

import contextlib

from specdec.common.quantized.kernels import kernels, use_kernels


@contextlib.contextmanager
def kernel_settings(isa: str, numerics: str):
    """The kernels on one instruction set in one numerics (kernels.cpp), then back to this machine's own."""
    ops = kernels()
    own = ops.isa(), ops.numerics()
    try:
        use_kernels(ops, isa, numerics)
        yield
    finally:
        use_kernels(ops, *own)


@contextlib.contextmanager
def switched(read, write, value):
    """write(value) for the block, then back to what read() gave before (e.g. torch's thread count)."""
    own = read()
    write(value)
    try:
        yield
    finally:
        write(own)
