"""The gguf kernels on a chosen instruction set and numerics for the length of a test block."""

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
