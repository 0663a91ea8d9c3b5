"""LightGBM in ddptrain workers, under Ray Train's names.

Change ``ray.train.lightgbm`` to ``ddptrain.lightgbm``::

    import lightgbm
    import ddptrain
    from ddptrain.lightgbm import LightGBMTrainer, RayTrainReportCallback, get_network_params

    def train_fn(config):
        train_df = ddptrain.get_dataset_shard("train").materialize().to_pandas()
        valid_df = ddptrain.get_dataset_shard("valid").materialize().to_pandas()
        train_set = lightgbm.Dataset(train_df.drop(columns="y"), label=train_df["y"])
        valid_set = lightgbm.Dataset(valid_df.drop(columns="y"), label=valid_df["y"])
        lightgbm.train({**config, **get_network_params()}, train_set, num_boost_round=100,
                       valid_sets=[valid_set], valid_names=["valid"],
                       callbacks=[RayTrainReportCallback(frequency=10)])

    result = LightGBMTrainer(train_fn, train_loop_config={"objective": "binary"},
                             datasets={"train": train_ds, "valid": valid_ds},
                             dataset_config=ddptrain.DataConfig(datasets_to_split=["train"]),
                             scaling_config=ddptrain.ScalingConfig(num_workers=2)).fit()
    booster = RayTrainReportCallback.get_model(result.checkpoint)

LightGBM does not combine eval metrics across workers: with the validation set split, the
metrics reported (rank 0's) cover rank 0's part only. Hence ``datasets_to_split=["train"]``.

Needs ``pip install ddptrain[lightgbm]`` (LightGBM >= 4.0); ``import ddptrain`` never imports
LightGBM.
"""

from ddptrain import _gbdt

_gbdt.require("lightgbm", "lightgbm", (4, 0), "LightGBM")

from ddptrain.lightgbm.callback import RayTrainReportCallback  # noqa: E402
from ddptrain.lightgbm.config import LightGBMConfig, PortInUseError, get_network_params  # noqa: E402
from ddptrain.lightgbm.lightgbm_trainer import LightGBMTrainer  # noqa: E402

__all__ = ["LightGBMConfig", "LightGBMTrainer", "PortInUseError", "RayTrainReportCallback", "get_network_params"]
