"""XGBoost in ddptrain workers, under Ray Train's names.

Change ``ray.train.xgboost`` to ``ddptrain.xgboost``::

    import xgboost
    import ddptrain
    from ddptrain.xgboost import RayTrainReportCallback, XGBoostTrainer

    def train_fn(config):
        train_df = ddptrain.get_dataset_shard("train").materialize().to_pandas()
        dtrain = xgboost.DMatrix(train_df.drop(columns="y"), label=train_df["y"])
        xgboost.train(config, dtrain, num_boost_round=100, evals=[(dtrain, "train")],
                      callbacks=[RayTrainReportCallback(frequency=10)])

    result = XGBoostTrainer(train_fn, train_loop_config={"tree_method": "hist"},
                            datasets={"train": ds},
                            scaling_config=ddptrain.ScalingConfig(num_workers=2)).fit()
    booster = RayTrainReportCallback.get_model(result.checkpoint)

Needs ``pip install ddptrain[xgboost]`` (XGBoost >= 2.1); ``import ddptrain`` never imports
XGBoost.
"""

from ddptrain import _gbdt

_gbdt.require("xgboost", "xgboost", (2, 1), "XGBoost")

from ddptrain.xgboost.callback import RayTrainReportCallback  # noqa: E402
from ddptrain.xgboost.config import XGBoostConfig  # noqa: E402
from ddptrain.xgboost.xgboost_trainer import XGBoostTrainer  # noqa: E402

__all__ = ["RayTrainReportCallback", "XGBoostConfig", "XGBoostTrainer"]
