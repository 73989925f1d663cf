"""Model -> graph. :func:`capture` traces with torch.fx and records, per node, the owning module and user source line."""
from ampaudit.capture.fx_capture import Capture, SourceLoc, capture

__all__ = ["Capture", "SourceLoc", "capture"]
