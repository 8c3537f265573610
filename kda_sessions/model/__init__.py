"""The hybrid KDA + MLA model: layers, the two entry points, loading and saving."""

from .batch import CheckpointStates, ForwardBatch, StatePools
from .loader import CheckpointError, load_model, save_model
from .model import HybridModel

__all__ = ["CheckpointError", "CheckpointStates", "ForwardBatch", "HybridModel", "StatePools", "load_model", "save_model"]
