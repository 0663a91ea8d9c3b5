"""ddptrain: Ray Train's API for data-parallel PyTorch training, without a Ray cluster.

Change ``import ray.train`` to ``import ddptrain as train`` (and ``ray.train.torch`` to
``ddptrain.torch``); the rest of the script stays as it is.
"""

from ddptrain import collective, data
from ddptrain._version import __version__
from ddptrain.backend import Backend, BackendConfig
from ddptrain.base_trainer import BaseTrainer
from ddptrain.callbacks import TrainRunContext, UserCallback
from ddptrain.checkpoint import Checkpoint
from ddptrain.config import (
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
    ValidationConfig,
    ValidationTaskConfig,
)
from ddptrain.context import (
    CheckpointConsistencyMode,
    CheckpointUploadMode,
    PreemptionInfo,
    ReportedCheckpoint,
    ReportedCheckpointStatus,
    StorageContext,
    TrainContext,
    get_all_reported_checkpoints,
    get_checkpoint,
    get_context,
    get_dataset_shard,
    get_preemption_info,
    report,
)
from ddptrain.data_parallel_trainer import DataParallelTrainer
from ddptrain.driver.warm import reuse_workers
from ddptrain.errors import (
    ConfigError,
    ControllerError,
    DdpTrainError,
    DiskFullError,
    HostLostError,
    LaunchError,
    RunPreemptedError,
    TrainingFailedError,
    WorkerDiedError,
    WorkerError,
    WorkerGroupError,
)
from ddptrain.launch.slurm_submit import SlurmConfig, submit
from ddptrain.result import Result

TRAIN_DATASET_KEY = "train"

# No handler is added on purpose: without logging configured, Python still prints our
# warnings (a late rank, a resumed run) to stderr, and users who configure logging get them there.

__all__ = [
    "Backend",
    "BackendConfig",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ControllerError",
    "ConfigError",
    "DataConfig",
    "BaseTrainer",
    "DataParallelTrainer",
    "DdpTrainError",
    "DiskFullError",
    "FailureConfig",
    "HostLostError",
    "LaunchError",
    "LoggingConfig",
    "PreemptionInfo",
    "RunPreemptedError",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "SlurmConfig",
    "StorageContext",
    "TRAIN_DATASET_KEY",
    "TrainContext",
    "TrainRunContext",
    "TrainingFailedError",
    "ValidationConfig",
    "ValidationTaskConfig",
    "UserCallback",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroupError",
    "collective",
    "data",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "report",
    "reuse_workers",
    "submit",
    "__version__",
]
