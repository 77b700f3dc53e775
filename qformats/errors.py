"""Typed errors of qformats: every message says what was expected, what was found, and where."""


class QFormatsError(ValueError):
    """Base class of every error this library raises on bad input."""


class FormatError(QFormatsError):
    """An unknown or invalid element format (name, bit widths, special-value convention, codes)."""


class SchemeError(QFormatsError):
    """A quantization scheme that does not fit the data (shape, axis, group size, dtype)."""


class CheckpointError(QFormatsError):
    """A checkpoint file or config that cannot be read or written; names the file and tensor."""


class ModelError(QFormatsError):
    """A model or rule set that cannot be quantized; names the module path."""


class KernelError(QFormatsError):
    """A kernel call with inputs the kernel cannot take (shapes, dtypes, formats)."""
