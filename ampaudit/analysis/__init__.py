"""Shape and dtype propagation under a target autocast policy (:class:`AmpProp`), and derived facts."""
from ampaudit.analysis.amp_prop import AMP_KEY, AmpInfo, AmpProp

__all__ = ["AMP_KEY", "AmpInfo", "AmpProp"]
