"""relayrl's contracts: the data that crosses boundaries and the engine / workflow ABCs.

Importing this package is cheap: it needs torch and PyYAML, never transformers.
"""

from relayrl.api.commands import ServerConfig
from relayrl.api.config import ConfigError, RunConfig, load_config
from relayrl.api.engine import DataItem, InferenceEngine, LossFn, LossWeightFn, PostFn, TensorDict, TrainEngine
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse, SaveLoadMeta, WeightUpdate
from relayrl.api.workflow import (
    RolloutWorkflow,
    SampleStatus,
    StatusCounter,
    Trajectory,
    TrajectoryError,
    concat_trajectories,
    trajectory_from_response,
    validate_trajectory,
)

__all__ = [
    "ConfigError",
    "DataItem",
    "GenerationConfig",
    "InferenceEngine",
    "LossFn",
    "LossWeightFn",
    "ModelRequest",
    "ModelResponse",
    "PostFn",
    "RolloutWorkflow",
    "RunConfig",
    "SampleStatus",
    "SaveLoadMeta",
    "ServerConfig",
    "StatusCounter",
    "TensorDict",
    "TrainEngine",
    "Trajectory",
    "TrajectoryError",
    "WeightUpdate",
    "concat_trajectories",
    "load_config",
    "trajectory_from_response",
    "validate_trajectory",
]
