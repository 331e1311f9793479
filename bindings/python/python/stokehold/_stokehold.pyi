"""The compiled extension: what ``stokehold`` re-exports from it is typed here; the
private classes the Python layer wraps are left to ``Any``."""

from typing import Any, Optional

__version__: str

class Error(Exception):
    """stokehold's error: a message naming the file and the problem."""

    cuda_code: Optional[int]
    """The CUDA driver's ``CUresult`` of a failed CUDA call, else ``None``."""
    context_lost: bool
    """Whether the CUDA context is lost (a fault on the device)."""

def __getattr__(name: str) -> Any: ...
